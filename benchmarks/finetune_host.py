"""The finetuning trainer's host time per step: what a GPU waits on when its batches are small.

On an H100 a ViT-tiny physical batch of 64 at 32 px computes in 6 ms, yet `train_finetune`
took 89 ms a step of 4 such batches (README, "The H100 again"): the step was Python's and
JAX's dispatch work on the host. This measures that work on any machine, with a model of
ViT-tiny's structure (timm's VisionTransformer: 12 blocks, 152 trained arrays, patch 8 on
16 px images) but 8 wide, physical batches of 2: the device's compute is then negligible, and
what is timed is the host's share of a step (sampling, the jitted calls that sum its
physical batches' clipped gradients in float64, one per `--batches-per-call` batches, the
update). DP-SGD (`DpPlan(1, T, 1, 1)`, q = 1: k physical
batches every step) and the non-private reference (`DpPlan(0, T, 1, inf)`), timed in turn,
medians of wall time over `--steps`-step calls after compiling ones.
Run: .venv/bin/python benchmarks/finetune_host.py [--train all,bias] [--steps 30 --repeats 5]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import _path  # noqa: F401 - first: keeps this folder off the import path
import numpy as np


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", default="all,bias")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches-per-step", type=int, default=4)
    parser.add_argument("--batches-per-call", type=int, default=None,
                        help="FinetuneFlags.batches_per_call (default: the trainer's rule, "
                        "1 on a CPU; k: the step's batches in one looped call, as on a GPU)")
    args = parser.parse_args()
    import timm
    from flax import nnx

    from dpprobe import accounting, finetune
    from dpprobe.finetune.models.timm_weights import vit_from_timm

    k, p = args.batches_per_step, 2
    model = vit_from_timm(timm.models.VisionTransformer(
        img_size=16, patch_size=8, in_chans=3, num_classes=10, embed_dim=8, depth=12,
        num_heads=1), 10, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (k * p, 16, 16, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, k * p)
    print(f"{'train':6} {'DP ms/step':>11} {'non-private':>12} {'DP ms/batch':>12}  (k = {k})")
    for mode in args.train.split(","):
        spec = finetune.FinetuneSpec(10, optimizer="sgd", learning_rate=0.1, ema_decay=None,
                                     mean=(0.5,) * 3, std=(0.5,) * 3, train=mode)
        flags = finetune.FinetuneFlags(physical_batch_size=p,
                                       batches_per_call=args.batches_per_call)

        def run(steps, private, spec=spec, flags=flags):
            plan = (accounting.DpPlan(1.0, steps, 1.0, 1.0) if private
                    else accounting.DpPlan(0.0, steps, 1.0, math.inf))
            finetune.train_finetune(model, images, labels, plan, spec, flags=flags)

        for private in (True, False):
            run(2, private)
            run(args.steps, private)  # the update is compiled per step count
        times = {True: [], False: []}
        for _ in range(args.repeats):
            for private in (True, False):
                start = time.perf_counter()
                run(args.steps, private)
                times[private].append(time.perf_counter() - start)
        dp_ms, plain_ms = (1e3 * statistics.median(times[v]) / args.steps for v in (True, False))
        print(f"{mode:6} {dp_ms:11.1f} {plain_ms:12.1f} {dp_ms / k:12.2f}", flush=True)


if __name__ == "__main__":
    main()
