"""Rows per float64 block of the probe's clipped sum on wide rows: the shipped rule and others.

`dp.accumulate.sum_block_rows` reduces a small sum (at most `SMALL_SUM_BYTES`) or a narrow one
(at most `SMALL_SUM_WIDTH` entries per feature: one run of up to 16 classes) in blocks that
fit `BLOCK_BYTES`, any other in blocks of `SUM_BLOCK_ROWS` (1,024) rows. One run on many
features (ScatterNet's 15,552 at 32 px RGB, 20,736 at 64 px gray) is a sum of more than
`SMALL_SUM_BYTES` but few entries per feature, whose 1,024-row blocks would hold 127-170 MB of
float64 operands (the rule before `SMALL_SUM_WIDTH`: `--rows 1024`). This benchmark times
the probe with the rule as shipped and with other fixed rows per block, in turn, on random
float32 features:

  * the clipped sum alone: `probe.clipped_grad_sum` in one `x64_jit` program (median of
    --repeats calls after a warm-up, `probe_step.py`'s `_time`);
  * the trainer: `probe.train_probe`'s cost of one more step, (t(1 + K) - t(1)) / K, medians
    of interleaved calls (`probe_step.py`'s `_marginal`).

The sums are the same float64 sums at any rows per block (a block of at most 2^15 rows keeps
the sensitivity bound); only the speed changes. The machine is shared and noisy: compare within
one run, and repeat it.

Run: .venv/bin/python benchmarks/block_rows.py [--shapes 1437x20736x10x1,8192x15552x10x1]
     [--rows shipped,1024] [--repeats 5] [--steps 10]
"""

from __future__ import annotations

import argparse
import os

import _path  # first: keeps this folder off the import path

os.environ["DPPROBE_STORED_PROGRAMS"] = "0"  # programs stored on disk would skip the patched rule
import jax  # noqa: E402
import jax.numpy as jnp
import numpy as np


def _probe_step():
    """`probe_step.py`, whose timers (`_time`, `_marginal`) this benchmark uses."""
    return _path.load_benchmark("probe_step")


def _shapes(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",")]


def _rule(rows: str) -> None:
    """Rows per block: "shipped" (`dp.accumulate.sum_block_rows`) or a fixed number; compiled
    programs are dropped, so the next call traces with it."""
    from dpprobe.dp import accumulate
    from dpprobe.probe import clipping

    clipping.sum_block_rows = (accumulate.sum_block_rows if rows == "shipped"
                               else lambda row_bytes, sum_bytes, views=1: int(rows))
    jax.clear_caches()


def clipped_sum_ms(features, onehot, runs, repeats) -> float:
    from dpprobe import probe
    from dpprobe.dp.accumulate import x64_jit

    dim, classes = features.shape[1], onehot.shape[1]
    params = {"w": jnp.full((runs, dim, classes), 1e-3, jnp.float32),
              "b": jnp.zeros((runs, classes), jnp.float32)}
    spec = probe.ProbeSpec(classes)
    fn = x64_jit(lambda p, x, y, c: probe.clipped_grad_sum(p, x, y, c, loss=spec.loss))
    clip = jnp.ones((runs,), jnp.float32)
    median, _ = _probe_step()._time(lambda: fn(params, features, onehot, clip), repeats)
    return 1e3 * median


def trainer_step_ms(features, labels, classes, runs, steps, repeats) -> float:
    """`probe.train_probe`'s cost of one more step (`probe_step.py`'s marginal cost)."""
    from dpprobe import accounting, dp, probe

    spec = probe.ProbeSpec(classes)
    keys = dp.make_keys(runs)

    def run(total):
        specs = [probe.RunSpec(accounting.DpPlan(2.0, total), 0.1) for _ in range(runs)]
        probe.train_probe(features, labels, specs, keys, spec)

    per_step, _, _ = _probe_step()._marginal(run, steps, repeats)
    return 1e3 * per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1437x20736x10x1,8192x15552x10x1",
                        help="N x d x classes x runs, comma-separated")
    parser.add_argument("--rows", default="shipped,1024",
                        help="rows per block to compare: 'shipped' or numbers, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="K: the trainer's extra steps")
    args = parser.parse_args()
    from dpprobe.dp.accumulate import sum_block_rows

    print(f"load average {os.getloadavg()[0]:.2f}; milliseconds, medians; rows in turn")
    print("| N x d, classes, runs | rows per block | clipped sum (ms) | trainer step (ms) |")
    print("| --- | --- | --- | --- |")
    rng = np.random.default_rng(0)
    for n, dim, classes, runs in _shapes(args.shapes):
        features = rng.normal(size=(n, dim)).astype(np.float32)
        labels = rng.integers(0, classes, n)
        onehot = jax.nn.one_hot(labels, classes)
        x = jnp.asarray(features)
        for rows in args.rows.split(","):
            _rule(rows)
            shown = (f"{min(n, sum_block_rows(8 * dim, 8 * runs * classes * dim)):,} (shipped)"
                     if rows == "shipped" else f"{int(rows):,}")
            summed = clipped_sum_ms(x, onehot, runs, args.repeats)
            step = trainer_step_ms(features, labels, classes, runs, args.steps, args.repeats)
            print(f"| {n:,} x {dim:,}, {classes}, {runs} | {shown} | {summed:.0f} | "
                  f"{step:.0f} |", flush=True)
        _rule("shipped")


if __name__ == "__main__":
    main()
