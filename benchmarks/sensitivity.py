"""Floating-point sensitivity of the streamed probe's clipped sum at N = 10^4, 10^6, 10^7.

The adversarial case for rounding: N copies of one row whose gradient is clipped (each
contributes exactly C, all aligned), and the same rows with one made a null record (zero-out
neighbours). Both run through `probe.train_probe_streaming` (the `--stream` trainer; rows
generated chunk by chunk, nothing stored), and the sum it hands to the DP update is read in
float64; the ratio ||S(D) - S(D')|| / C must stay within 1 + 1e-6 (`dp.accumulate`). The
worst ratio over a few rows is printed per N.

Run from any tree (the "before" numbers: the tree on PYTHONPATH is the one measured):
  PYTHONPATH=/path/to/tree .venv/bin/python benchmarks/sensitivity.py [--sizes 1e4 1e6 1e7]
"""

from __future__ import annotations

import argparse
import time

import _path  # noqa: F401 - first: keeps this folder off the import path
import jax
import numpy as np

import dpprobe.probe.streaming  # noqa: F401 (loads the submodule)
from dpprobe import accounting, dp, probe

CLIP, NUM_CLASSES = 1.0, 3
SPEC = probe.ProbeSpec(NUM_CLASSES, optimizer="sgd")
ROWS = [np.array([3.1, -1.7, 2.3, 0.7, -2.9]) * 7.3, np.array([0.3, 5.0, -0.2, 1.1, 4.4]),
        np.array([-9.0, 0.01, 3.3, 2.2, 0.5]) * 1.7]


def streamed_sum(row: np.ndarray, num_rows: int, null_first: bool, rows_per_chunk: int):
    """The float64 clipped sum the streamed trainer hands to its DP update at step 0."""
    seen = []
    real = probe.streaming.dp_update_jit

    def spy(spec, arrays, state, sums, *rest):
        seen.append(np.concatenate([np.asarray(sums["w"], np.float64).ravel(),
                                    np.asarray(sums["b"], np.float64).ravel()]))
        return real(spec, arrays, state, sums, *rest)

    def chunks():
        block = np.tile(row.astype(np.float32), (rows_per_chunk, 1))
        for start in range(0, num_rows, rows_per_chunk):
            count = min(rows_per_chunk, num_rows - start)
            labels = np.zeros(count, np.int64)
            if null_first and start == 0:
                labels[0] = dp.NULL_LABEL
            yield block[:count], labels

    runs = [probe.RunSpec(accounting.DpPlan(1.0, 1, clip_norm=CLIP), 1.0)]
    probe.streaming.dp_update_jit = spy
    try:
        probe.train_probe_streaming(chunks, runs, dp.make_keys(1), SPEC, num_examples=num_rows,
                                    dim=len(row),
                                    flags=probe.PerformanceFlags(rows_per_chunk=rows_per_chunk))
    finally:
        probe.streaming.dp_update_jit = real
    return seen[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e4, 1e6, 1e7])
    parser.add_argument("--rows-per-chunk", type=int, default=32768)
    args = parser.parse_args()
    print(f"tree: {probe.__file__.rsplit('/probe/', 1)[0]}  rows per chunk: "
          f"{args.rows_per_chunk}  jax {jax.__version__}")
    header = "max ||S(D) - S(D')|| / C"
    print(f"{'N':>10}  {header:>28}  {'per row':>40}  {'time':>6}")
    for size in args.sizes:
        num_rows, start = int(size), time.perf_counter()
        ratios = []
        for row in ROWS:
            full = streamed_sum(row, num_rows, False, args.rows_per_chunk)
            other = streamed_sum(row, num_rows, True, args.rows_per_chunk)
            ratios.append(float(np.linalg.norm(full - other)) / CLIP)
        worst = max(ratios)
        print(f"{num_rows:>10.0e}  {worst:>28.9f}  "
              f"{' '.join(f'{r:.9f}' for r in ratios):>40}  {time.perf_counter() - start:5.0f}s")


if __name__ == "__main__":
    main()
