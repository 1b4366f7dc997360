"""DP training of linear probes with the features in memory, optionally sharded over devices.

All steps of all configs of a sweep run in a few compiled programs: the first step (shared by
every config that starts from zero, `probe.step`), then blocks of steps in a `fori_loop`.
The input boundary checks public metadata only (shapes, dtypes: `prepare_inputs`), and every
row that cannot contribute (non-finite features, a label outside [0, C)) becomes a null row,
so no outcome depends on whether one private row is bad.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dpprobe.dp.accumulate import x64_jit
from dpprobe.dp.clipping import valid_labels, zero_nonfinite_rows
from dpprobe.probe import programs
from dpprobe.probe.clipping import clipped_grad_sum, feature_gram
from dpprobe.probe.normalization import normalize_features
from dpprobe.probe.sharding import shard_rows
from dpprobe.probe.specs import PerformanceFlags, ProbeSpec, RunSpec, TrainResult
from dpprobe.probe.step import (
    RunArrays,
    dp_update,
    init_state,
    result,
    run_arrays,
    shared_start_sums,
    step_bar,
    step_blocks,
)

__all__ = ["check_full_batch", "check_labels", "prepare_features", "prepare_inputs",
           "train_probe"]


def check_labels(labels) -> np.ndarray:
    """The labels as a 1-D integer array (shape and dtype only: values are private)."""
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be a 1-D integer array, got {labels.dtype} {labels.shape}")
    return labels


def prepare_features(features, spec: ProbeSpec, feature_dtype: str | None = None) -> np.ndarray:
    """Shape and dtype checked (public metadata), each example normalized, optionally cast to
    `feature_dtype`; float16 stays float16. The values are not inspected here: each compiled
    program first turns rows that are not finite into null rows (`zero_nonfinite_rows`, fused
    with the float32 cast, so it costs no extra pass over the features)."""
    features = np.asarray(features)
    if features.ndim not in (2, 3):
        raise ValueError(f"features must be (N, d) or (N, views, d), got shape {features.shape}")
    if not np.issubdtype(features.dtype, np.floating):
        raise ValueError(f"features must be floating point, got {features.dtype}")
    if spec.normalization != "none":  # "none" leaves the array as it is (float16 too)
        features = np.asarray(_normalize(features, spec.normalization, groups=spec.groups))
    else:
        features = np.asarray(normalize_features(features, "none"))
    return features if feature_dtype is None else features.astype(feature_dtype)


# The per-example normalization as one compiled program. Run eagerly, each of its operations
# was a pass of its own over every feature, in a program of its own: GroupNorm on 60,000 x
# 3,969 float16 features (Fashion-MNIST's ScatterNet store) took 6.5-7.5 s before every probe
# job's first step, 2.0 s compiled (2-core CPU). It is a function of each example alone.
_normalize = jax.jit(normalize_features, static_argnames=("method", "groups", "eps"))


def prepare_inputs(features, labels, spec: ProbeSpec, feature_dtype: str | None = None):
    """(features, one-hot labels (N, C), mask (N,)): `prepare_features`; a label outside
    [0, C) gives a masked row (it contributes nothing) rather than an error whose occurrence
    would depend on one private record."""
    features = prepare_features(features, spec, feature_dtype)
    labels = check_labels(labels)
    if len(features) != len(labels):
        raise ValueError(f"{len(features)} feature rows but {len(labels)} labels")
    valid = valid_labels(labels, spec.num_classes)
    onehot = np.eye(spec.num_classes, dtype=np.float32)[np.where(valid, labels, 0)]
    return features, onehot * valid[:, None], valid.astype(np.float32)


def check_full_batch(runs: Sequence[RunSpec]) -> None:
    for run in runs:
        if run.plan.sampling_probability != 1.0:
            raise ValueError("this trainer is full batch; use train_probe_poisson for q < 1")


def _prepare_rows(features, onehot, mask):
    """The in-memory rows as every step reads them, computed once for all blocks of steps:
    float32 features with non-finite rows nulled (`zero_nonfinite_rows`), one-hot labels, the
    mask and the per-example Gram matrices. Once, not once per compiled block of steps: with a
    progress bar a sweep runs about 20 blocks, and each converted every feature again (the
    default sweep on 200,000 x 512, T = 39, loaded 2-core CPU: 125 -> 98 CPU seconds). The
    first step prepares them inside its own program. The sum's float64 operands are not
    prepared here: each block of rows (`dp.accumulate.sum_block_rows`) is widened inside the
    sum, in cache, where a float64 copy of every feature (and XLA's second copy of it for the
    loop over blocks: 2 x 307 MB at 50,000 x 768) cost the single-step sweep of 40 runs
    0.9 of its 1.2 s per step."""
    features, mask = zero_nonfinite_rows(features.astype(jnp.float32), mask)
    gram = feature_gram(features if features.ndim == 3 else features[:, None, :])
    return features, onehot, mask, gram


_prepare = x64_jit(_prepare_rows)


def _sum_fn(rows, spec: ProbeSpec):
    """The clipped-sum function of the prepared in-memory rows (`_prepare`)."""
    features, onehot, mask, gram = rows

    def sum_fn(params, clip):
        return clipped_grad_sum(params, features, onehot, clip, loss=spec.loss, mask=mask,
                                gram=gram, finite_rows=True)

    return sum_fn


@functools.partial(x64_jit, static_argnames=("spec",))
def _first_step(features, onehot, mask, runs: RunArrays, *, spec):
    rows = _prepare_rows(features, onehot, mask)
    sum_fn = _sum_fn(rows, spec)
    dim = rows[0].shape[-1]
    state = init_state(spec, runs, dim)
    sums, num_clipped = shared_start_sums(spec, runs, dim, sum_fn)
    return dp_update(spec, runs, state, sums, num_clipped, 0, runs.denominator)


@functools.partial(x64_jit, static_argnames=("spec",), donate_argnames=("state",))
def _more_steps(state, start, stop, rows, runs: RunArrays, *, spec):
    sum_fn = _sum_fn(rows, spec)

    def body(step, state):
        sums, num_clipped = sum_fn(state.params, runs.clip)
        return dp_update(spec, runs, state, sums, num_clipped, step, runs.denominator)

    return jax.lax.fori_loop(start, stop, body, state)


# Stored on disk by the `dpprobe` command: a repeated sweep skips tracing (`probe.programs`).
_first_step = programs.stored("probe.train._first_step", _first_step, x64=True)
_more_steps = programs.stored("probe.train._more_steps", _more_steps, x64=True)


def train_probe(features, labels, runs: Sequence[RunSpec], keys: jax.Array, spec: ProbeSpec, *,
                flags: PerformanceFlags | None = None, progress: bool = False,
                num_examples: int | None = None) -> TrainResult:
    """Train one zero-initialized linear probe per run, full batch, all runs in one program.

    Args:
      features: (N, d) or (N, views, d) training features; views are averaged per example
        before clipping (augmentation multiplicity, De et al. 2022 eq. 4,
        https://arxiv.org/abs/2204.13650).
      labels: (N,) integer labels in [0, num_classes).
      runs: the configs; every `run.plan` must be full batch (sampling_probability 1).
      keys: (len(runs),) secret noise keys from `dp.make_keys` (OS entropy).
      spec: loss, optimizer, normalization.
      flags: speed knobs (`flags.mesh` shards rows over devices; `flags.feature_dtype`);
        None gives the defaults.
      progress: show a progress bar over steps.
      num_examples: N (public), when `features` are this process's rows of a multi-process
        job (`dp.distributed.process_rows`, padded with null rows to the same count on every
        process); default: the rows given, times the processes when `flags.mesh` is set.

    Returns:
      TrainResult with params {"w": (P, d, C), "b": (P, C)} (NumPy).

    Formal guarantee:
      rows are distinct individuals; the neighbouring relation is zero-out (one row replaced by a
      null row that contributes nothing; N public); each run is then exactly the mechanism of its
      `DpPlan`, if `keys` are secret (`make_keys`). Rows with non-finite features or labels outside
      [0, C) are such null rows. In floating point: the clipped sum is accumulated in float64
      over blocks of rows and noised in float64, so one row moves the computed sum by at most
      C (1 + 1e-6) for N up to 10^9 (`dp.accumulate`; on D devices, N up to 3.4e9 / (D + 1)).
    """
    flags = flags or PerformanceFlags()
    check_full_batch(runs)
    total = max(run.plan.steps for run in runs)  # public
    with step_bar(total, progress, "probe steps") as bar:
        # What the bar's heartbeat names while a call runs long. Normalizing and moving the
        # features takes seconds at N x d = 60,000 x 3,969. The first call of each program
        # compiles it (a cached program's one-step call returns in well under the
        # heartbeat's interval, so only a compile shows the note).
        bar.wait_for("preparing the features")
        feats, onehot, mask = prepare_inputs(features, labels, spec, flags.feature_dtype)
        # N is public; in a multi-host job each process passes its own, equally many rows.
        if num_examples is None:
            num_examples = len(feats) * (jax.process_count() if flags.mesh is not None else 1)
        arrays = run_arrays(runs, keys, num_examples)
        if flags.mesh is None:  # on the device once, not once per block of steps
            data = jax.device_put((feats, onehot, mask))
        else:  # each device sums its own rows; XLA reduces the partial sums
            feats, onehot, mask, padding = shard_rows(flags.mesh, feats, onehot, mask)
            data = (feats, onehot, mask * padding)
        bar.wait_for("compiling the first step")
        state = _first_step(*data, arrays, spec=spec)
        bar.update(1)
        bar.wait_for("compiling the steps")
        if total > 1:
            rows = _prepare(*data)
            del data  # the float16 or float32 copy: `rows` holds what the steps read
        for start, stop in step_blocks(total, bar):
            state = _more_steps(state, start, stop, rows, arrays, spec=spec)
            bar.wait_for(f"steps {start + 1}-{stop}")  # named after this block's compile
            if not bar.disable:  # the bar counts computed steps, not dispatched ones
                jax.block_until_ready(state)
        return result(state, arrays)
