"""The peer of scripts/bench/train: PyTorch's DistributedDataParallel (Python,
Gloo) training the same scripted model file on the same kind of data, with
the same batch size, optimizer and logging windows as ddpx-train, and (for
scripts/bench/layerdrop) the same layer-drop pattern, drawn by
torch.ops.ddpx.layer_drop_scales, with find_unused_parameters=True as DDP
needs for it. --device cuda: the model and batches on the GPU (every rank on
GPU 0 when they share one: Gloo, as NCCL cannot), --amp bf16|fp16 autocast
around forward and loss (fp16 with a GradScaler), as ddpx-train's flags.
Image data standardised with the training set's statistics as ddpx-train
does; the test split (t10k-*) evaluated at the end. Launched under mpirun;
prints one JSON line (rank 0)."""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def load_images(d, split="train"):
    """(images, labels) of a split; images standardised with the training
    set's mean and standard deviation, computed in double (ddpx-train's)."""
    def raw(s):
        return np.fromfile(os.path.join(d, f"{s}-images-idx3-ubyte"), dtype=np.uint8, offset=16)
    x = raw("train" if split == "train" else "t10k").astype(np.float64)
    train = x if split == "train" else raw("train").astype(np.float64)
    mean, sd = train.mean(), train.std() or 1.0
    lab = np.fromfile(os.path.join(d, f"{split}-labels-idx1-ubyte"), dtype=np.uint8, offset=8)
    x = torch.from_numpy(((x - mean) / sd).astype(np.float32).reshape(-1, 1, 28, 28))
    return x, torch.from_numpy(lab.astype(np.int64))


def test_accuracy(model, d, device, amp):
    """The share of the test split the model gets right (rank 0, batches of 256)."""
    if not d or not os.path.exists(os.path.join(d, "t10k-images-idx3-ubyte")):
        return None
    x, y = load_images(d, "t10k")
    model.eval()
    right = 0
    with torch.no_grad(), torch.autocast(device.type, dtype=amp, enabled=amp is not None):
        for b in range(0, len(y), 256):
            right += (model(x[b:b + 256].to(device)).argmax(1).cpu() == y[b:b + 256]).sum().item()
    model.train()
    return right / len(y)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", help="idx directory (image models)")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--target", type=float, default=0.0, help="window accuracy to time")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    p.add_argument("--layer-drop", default="none", help="as ddpx-train's")
    p.add_argument("--pld-gamma", type=float, default=0.001)
    p.add_argument("--layer-drop-pattern", choices=["shared", "per-rank"], default="shared")
    p.add_argument("--seed", type=int, default=1, help="of the drop pattern, as ddpx-train's")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none")
    a = p.parse_args()
    device = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    amp = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[a.amp]
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", 0))
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", 1))
    local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    torch.ops.load_library(os.environ["DDPX_LIB"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=rank,
                            world_size=world)
    torch.manual_seed(1)
    model = torch.jit.load(a.model, map_location=device)
    model.train()
    drop = a.layer_drop != "none"
    ddp = DDP(model, find_unused_parameters=drop,
              device_ids=[device.index] if device.type == "cuda" else None)
    scaler = torch.amp.GradScaler(device.type, enabled=a.amp == "fp16")
    if a.optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    depth = len(model.block_scale) if drop else 0
    if model.ddpx_input == "image":
        x_all, y_all = load_images(a.data)
    else:
        n = 20000
        x_all = torch.randint(1, model.vocab_size, (n, model.sentences, model.words))
        y_all = torch.randint(0, model.num_classes, (n,))
    idx = torch.randperm(len(y_all), generator=torch.Generator().manual_seed(1))[rank::world]
    windows, step_s, tta = [], [], None
    correct = count = 0
    t0 = tw = time.perf_counter()
    for step in range(1, a.steps + 1):
        b = (step - 1) * a.batch_size % (len(idx) - a.batch_size)
        rows = idx[b:b + a.batch_size]
        x, y = x_all[rows].to(device, non_blocking=True), y_all[rows].to(device, non_blocking=True)
        t_step = time.perf_counter()
        if drop:  # step - 1: ddpx-train counts steps from 0 when drawing
            model.block_scale = torch.ops.ddpx.layer_drop_scales(
                a.layer_drop, step - 1, depth, rank, a.seed, a.pld_gamma, a.layer_drop_pattern)
        opt.zero_grad()
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            logits = ddp(x)
            loss = F.cross_entropy(logits, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        step_s.append(time.perf_counter() - t_step)
        # Summed on the device (no sync a step, as ddpx-train), read per window.
        correct = correct + (logits.argmax(1) == y).sum()
        count += len(y)
        if step % a.log_every == 0:
            w = torch.tensor([float(correct), count], dtype=torch.float64)  # (Gloo: a CPU tensor)
            dist.all_reduce(w)
            now = time.perf_counter()
            windows.append(w[1].item() / (now - tw))
            if tta is None and a.target and w[0].item() / w[1].item() >= a.target:
                tta = now - t0
            tw, correct, count = now, 0, 0
    if rank == 0:
        steady = windows[1:] or windows
        print(json.dumps({"samples_per_s": float(np.median(steady)), "time_to_accuracy_s": tta,
                          "test_accuracy": test_accuracy(model, a.data, device, amp),
                          "elapsed_s": time.perf_counter() - t0,
                          "step_ms": 1000 * float(np.median(step_s[len(step_s) // 5:]))}),
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
