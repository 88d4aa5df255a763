#!/usr/bin/env python3
"""Scripts the models of torchscript_models/ and saves DIR/{lenet,mlp,han,transformer}.pt
for ddpx-train (run at build time by torchscript_models/CMakeLists.txt).

    export_models.py --out DIR [--lib libddpx.so] [--aten] [--seed N]

--lib defaults to $DDPX_LIB. The layers are ddpx.nn's TiledConv2d and
FusedGRU, from this tree's plugin/python, on the library --lib loaded. --aten
makes the models use torch.nn.Conv2d / GRU (the ATen ops) instead, as a
reference; such files load without the plugin. The weights depend on --seed
only, not on --aten, so the two variants of a model hold the same parameters.
"""
import argparse
import os
import sys
import warnings

import torch

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
MODELS_DIR = os.path.join(ROOT, "torchscript_models")
sys.path.insert(0, MODELS_DIR)
# This tree's ddpx package (ddpx.nn), ahead of an installed one: the build
# scripts the layers it is building. The models import it only for the
# default (non --aten) export, after main() has loaded --lib, which the
# package then reuses rather than load a second libddpx.so.
sys.path.insert(0, os.path.join(ROOT, "plugin", "python"))

from han import HAN  # noqa: E402
from lenet import LeNet  # noqa: E402
from mlp import MLP  # noqa: E402
from transformer import Transformer  # noqa: E402

MODELS = {"lenet": LeNet, "mlp": MLP, "han": HAN, "transformer": Transformer}


def build(name: str, seed: int = 0, aten: bool = False) -> torch.nn.Module:
    """The eager model `name` with the export defaults, initialised from `seed`
    alone (each model from its own fresh generator state)."""
    if name not in MODELS:
        raise ValueError(f"name must be one of {sorted(MODELS)}, got {name!r}")
    with torch.random.fork_rng(devices=[]):  # leave the caller's generator as it was
        torch.manual_seed(seed)
        return MODELS[name](aten=aten)


def script(model: torch.nn.Module) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        # torch 2.15 marks torch.jit.script deprecated; C++ trainers still need it.
        warnings.simplefilter("ignore", FutureWarning)
        return torch.jit.script(model)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for the .pt files (one per model)")
    parser.add_argument("--lib", default=os.environ.get("DDPX_LIB"),
                        help="path of libddpx.so (default: $DDPX_LIB)")
    parser.add_argument("--aten", action="store_true",
                        help="use the ATen ops instead of ddpx's (reference models)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights")
    args = parser.parse_args(argv)

    if not args.aten:
        if not args.lib:
            parser.error("--lib is required (or set DDPX_LIB) unless --aten is given")
        if not os.path.isfile(args.lib):
            parser.error(f"--lib {args.lib}: no such file")
        torch.ops.load_library(args.lib)
    os.makedirs(args.out, exist_ok=True)
    for name in MODELS:
        path = os.path.join(args.out, f"{name}.pt")
        script(build(name, args.seed, args.aten)).save(path)
        print(f"export_models: {path}")


if __name__ == "__main__":
    main()
