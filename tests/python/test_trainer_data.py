"""ddpx-train --data: idx directories of any count and image size (the files
carry their own), and torch.save files of a dict {train_x, train_y, test_x,
test_y} for image and token models; bad files of each kind end with an error
naming the file and what is wrong. Single process unless noted."""
import re

import numpy as np
import pytest
import torch

from trainer_util import TRAIN, model, mpirun_cmd, read_metrics, run

IDX = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
       "t10k-labels-idx1-ubyte"]
IDX_TYPES = {np.uint8: 0x08, np.int8: 0x09, np.int16: 0x0B, np.int32: 0x0C, np.float32: 0x0D,
             np.float64: 0x0E}


def write_idx(path, a):
    a = np.ascontiguousarray(a)
    head = bytes([0, 0, IDX_TYPES[a.dtype.type], a.ndim]) + b"".join(
        int(s).to_bytes(4, "big") for s in a.shape)
    path.write_bytes(head + a.astype(a.dtype.newbyteorder(">")).tobytes())


def read_idx(path):
    b = path.read_bytes()
    assert b[2] == 0x08
    shape = [int.from_bytes(b[4 + 4 * i:8 + 4 * i], "big") for i in range(b[3])]
    return np.frombuffer(b, np.uint8, offset=4 + 4 * b[3]).reshape(shape)


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """The generated image set (ddpx-train writes it), as uint8 arrays."""
    d = tmp_path_factory.mktemp("gen")
    r = run([TRAIN, "--model", model("mlp"), "--data-cache", d, "--steps", 1, "--quiet"])
    assert r.returncode == 0, r.stderr
    return [read_idx(d / f) for f in IDX]


@pytest.fixture(scope="module")
def odd_idx(tmp_path_factory, generated):
    """1437 training and 263 test samples of it: not MNIST's counts."""
    d = tmp_path_factory.mktemp("odd")
    counts = [1437, 1437, 263, 263]
    for f, a, n in zip(IDX, generated, counts):
        write_idx(d / f, a[:n])
    return d


def trains(args, cmd=None):
    r = run(cmd or [TRAIN, *map(str, args)])
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def test_idx_of_any_count_trains(tmp_path, odd_idx):
    """An epoch is the file's 1437 samples: 44 steps of 32 (LibTorch's MNIST
    reader refused anything but 60000)."""
    metrics = tmp_path / "m.jsonl"
    r = trains(["--model", model("mlp"), "--data", odd_idx, "--epochs", 2, "--batch-size", 32,
                "--log-every", 44, "--metrics", metrics])
    assert "88 steps of 32" in r.stdout
    end = read_metrics(metrics)[-1]
    assert end["event"] == "end" and end["step"] == 88
    assert end["test_accuracy"] > 0.5, end  # 10 classes; seen: 0.9 and above


def test_torch_save_file_trains_exactly_as_the_same_idx(tmp_path, odd_idx, generated):
    """The same uint8 images and labels, once as idx files and once as a
    torch.save dict ([N, H, W] uint8, int64 labels): the same run, bit for bit."""
    data = tmp_path / "odd.pt"
    x, y, tx, ty = (torch.from_numpy(a[:n].copy()) for a, n in zip(generated,
                                                                  [1437, 1437, 263, 263]))
    torch.save({"train_x": x, "train_y": y.long(), "test_x": tx, "test_y": ty.long()}, data)
    runs = []
    for source in (odd_idx, data):
        metrics = tmp_path / f"m{len(runs)}.jsonl"
        trains(["--model", model("mlp"), "--data", source, "--steps", 30, "--batch-size", 16,
                "--log-every", 10, "--metrics", metrics])
        runs.append([(m["step"], m.get("loss"), m.get("test_accuracy")) for m in
                     read_metrics(metrics)])
    assert runs[0] == runs[1]


class Planes(torch.nn.Module):
    """A classifier of 3x12x20 images into 26 classes: neither MNIST's size
    nor its class count."""

    def __init__(self):
        super().__init__()
        self.ddpx_input = "image"
        self.num_classes = 26
        self.image_shape = [3, 12, 20]
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.fc = torch.nn.Linear(8 * 12 * 20, 26)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def planes_data(n, seed):
    """Class c: a fixed random 3x12x20 pattern plus noise (float images)."""
    g = torch.Generator().manual_seed(7)
    protos = torch.randn(26, 3, 12, 20, generator=g)
    g.manual_seed(seed)
    y = torch.randint(0, 26, (n,), generator=g)
    return protos[y] + 0.8 * torch.randn(n, 3, 12, 20, generator=g), y


def test_another_image_size_and_class_count_under_mpirun(tmp_path):
    path, data = tmp_path / "planes.pt", tmp_path / "planes_data.pt"
    torch.jit.script(Planes()).save(str(path))
    x, y = planes_data(901, 1)
    tx, ty = planes_data(300, 2)
    torch.save({"train_x": x, "train_y": y, "test_x": tx, "test_y": ty}, data)
    r = trains(None, cmd=mpirun_cmd(2, "--model", path, "--data", data, "--steps", 40,
                                    "--batch-size", 16, "--lr", 0.02))
    acc = float(re.search(r"test accuracy ([\d.]+)%", r.stdout).group(1))
    assert acc > 50, r.stdout  # 26 classes: chance is 3.8%


def documents(spec, n, seed):
    """Token documents whose label is their topic: every word is drawn from
    the topic's block of the vocabulary, with some words from anywhere."""
    vocab, s, w, classes = spec
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    block = vocab // classes
    x = y.view(n, 1, 1) * block + torch.randint(0, block, (n, s, w), generator=g)
    noise = torch.rand(n, s, w, generator=g) < 0.3
    return torch.where(noise, torch.randint(0, vocab, (n, s, w), generator=g), x), y


@pytest.fixture(scope="module")
def han_spec():
    m = torch.jit.load(model("han"))
    return m.vocab_size, m.sentences, m.words, m.num_classes


def test_torch_save_tokens_train_han(tmp_path, han_spec):
    data = tmp_path / "docs.pt"
    x, y = documents(han_spec, 640, 1)
    tx, ty = documents(han_spec, 200, 2)
    torch.save({"train_x": x, "train_y": y, "test_x": tx, "test_y": ty}, data)
    r = trains(["--model", model("han"), "--data", data, "--steps", 40, "--batch-size", 16,
                "--optimizer", "adam", "--lr", 0.01])
    assert "40 steps of 16" in r.stdout
    acc = float(re.search(r"test accuracy ([\d.]+)%", r.stdout).group(1))
    assert acc > 100 / han_spec[3] + 25, r.stdout


def fails_with(args, *needles):
    r = run([TRAIN, *map(str, args)], timeout=120)
    assert r.returncode != 0, r.stdout
    for n in needles:
        assert n in r.stderr, r.stderr


def idx_dir(tmp_path, generated, edit):
    d = tmp_path / "idx"
    d.mkdir()
    arrays = [a[:100] for a in generated]
    for f, a in zip(IDX, arrays):
        write_idx(d / f, a)
    return d, edit(d, arrays)


@pytest.mark.parametrize("case", ["labels short", "32x32 images", "type code", "short header",
                                  "rank 5", "huge sizes", "token model"])
def test_bad_idx_directory(tmp_path, generated, case):
    def edit(d, a):
        if case == "labels short":
            write_idx(d / IDX[1], a[1][:99])
            return [str(d / IDX[1]), "holds 99 labels for 100 samples"]
        if case == "32x32 images":
            write_idx(d / IDX[0], np.zeros((100, 32, 32), np.uint8))
            return [str(d / IDX[0]), "holds images of 1x32x32", "takes 1x28x28"]
        if case == "type code":
            b = bytearray((d / IDX[2]).read_bytes())
            b[2] = 0x0A
            (d / IDX[2]).write_bytes(bytes(b))
            return [str(d / IDX[2]), "corrupt idx file", "is not an idx header"]
        if case == "short header":
            (d / IDX[3]).write_bytes(b"\0\0\x08\x01\0")
            return [str(d / IDX[3]), "shorter than its header"]
        if case == "huge sizes":  # 2^102 elements, 0 mod 2^64: a bare header must not pass
            sizes = [1 << 16, 1 << 24, 1 << 31, 1 << 31]
            (d / IDX[0]).write_bytes(b"\0\0\x08\x04" + b"".join(n.to_bytes(4, "big")
                                                                for n in sizes))
            return [str(d / IDX[0]), "its header promises"]
        if case == "rank 5":
            b = bytearray((d / IDX[0]).read_bytes())
            b[3] = 5
            (d / IDX[0]).write_bytes(bytes(b))
            return [str(d / IDX[0]), "is not an idx header"]
        return ["is a token model", "torch.save"]

    d, needles = idx_dir(tmp_path, generated, edit)
    fails_with(["--model", model("han" if case == "token model" else "lenet"), "--data", d,
                "--steps", 1], *needles)


def images_dict(n=50):
    x = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8)
    return {"train_x": x, "train_y": torch.arange(n) % 10, "test_x": x[:20],
            "test_y": torch.arange(20) % 10}


@pytest.mark.parametrize("case", ["garbage", "a tensor", "missing key", "a list", "float labels",
                                  "label 10", "NCHW of 2 channels", "token shape", "token id"])
def test_bad_torch_save_file(tmp_path, han_spec, case):
    path = tmp_path / "bad.pt"
    name = "mlp"
    d = images_dict()
    if case == "garbage":
        path.write_bytes(b"\x80\x02not a pickle at all" * 10)
        needles = ["neither an idx directory nor a file written by torch.save", str(path)]
    elif case == "a tensor":
        torch.save(d["train_x"], path)
        needles = ["holds a Tensor", "save a dict"]
    else:
        if case == "missing key":
            del d["test_y"]
            needles = ["has no key 'test_y'", "train_x, train_y, test_x"]
        elif case == "a list":
            d["test_x"] = [1, 2, 3]
            needles = ["'test_x' holds a", "not a tensor"]
        elif case == "float labels":
            d["train_y"] = d["train_y"].float()
            needles = ["['train_y'] holds labels of dtype Float"]
        elif case == "label 10":
            d["test_y"][7] = 10
            needles = ["['test_y']: label 10 at item 7 is not a class of model", "(0..9)"]
        elif case == "NCHW of 2 channels":
            d["train_x"] = torch.zeros(50, 2, 28, 28)
            needles = ["['train_x'] holds images of 2x28x28", "takes 1x28x28"]
        else:
            name = "han"
            vocab, s, w, classes = han_spec
            x, y = documents(han_spec, 30, 3)
            if case == "token shape":
                x = x[:, :, :-1]
                needles = [f"holds a tensor of dtype Long and shape [30x{s}x{w - 1}]",
                           f"[N, {s}x{w}]"]
            else:
                x[4, 1, 2] = vocab
                needles = [f"token id {vocab} in item 4 is outside model", f"(0..{vocab - 1})"]
            d = {"train_x": x, "train_y": y, "test_x": x, "test_y": y}
        torch.save(d, path)
    fails_with(["--model", model(name), "--data", path, "--steps", 1], *needles)
