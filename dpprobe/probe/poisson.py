"""Masked DP-SGD with Poisson subsampling (Beltran et al. 2024, https://arxiv.org/abs/2406.17298,
Alg. A1), without recompilation.

Each step, each run's logical batch is Poisson sampled (`dp.poisson_batches`, on
`jax_privacy.batch_selection`) and cut into physical batches of a fixed size p, the last one
padded and masked, so one compiled kernel serves every step whatever the sampled sizes. The
noisy clipped sum is divided by the expected batch size q N (`probe.step`), and each run is
exactly the Poisson-sampled Gaussian of its `DpPlan`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dpprobe.dp.accumulate import add_parts, x64_jit
from dpprobe.dp.clipping import zero_nonfinite_rows
from dpprobe.dp.sampling import poisson_batches
from dpprobe.probe.clipping import clipped_grad_sum
from dpprobe.probe.specs import PerformanceFlags, ProbeSpec, RunSpec, TrainResult
from dpprobe.probe.step import dp_update_jit, init_state_jit, result, run_arrays, step_bar
from dpprobe.probe.train import prepare_inputs

__all__ = ["train_probe_poisson"]


@functools.partial(x64_jit, static_argnames=("spec",))
def _batch_sums(params, features, onehot, mask, clip, *, spec):
    """Per-run clipped sums of one physical batch: features (P, p, [V,] d), mask (P, p)."""

    def one(w, b, x, y, m, c):
        x, m = zero_nonfinite_rows(x.astype(jnp.float32), m)  # the input boundary
        sums, count = clipped_grad_sum({"w": w[None], "b": b[None]}, x, y, c[None],
                                       loss=spec.loss, mask=m, finite_rows=True)
        return jax.tree.map(lambda s: s[0], sums), count[0]

    return jax.vmap(one)(params["w"], params["b"], features, onehot, mask, clip)


def train_probe_poisson(
    features,
    labels,
    runs: Sequence[RunSpec],
    keys: jax.Array,
    spec: ProbeSpec,
    *,
    flags: PerformanceFlags | None = None,
    rng: np.random.Generator | None = None,
    progress: bool = False,
) -> TrainResult:
    """Masked DP-SGD with Poisson subsampling; runs may have any q in (0, 1].

    Args:
      features, labels, runs, keys, spec, progress: as for `probe.train_probe`.
      flags: `physical_batch_size` (p, rows per compiled call) and `feature_dtype` are used.
      rng: the batch sampler's generator; None (the only private choice) seeds a fresh one from
        OS entropy. A seeded generator makes the batches public: for tests only.

    Returns:
      TrainResult whose `batch_sizes` (steps, runs) holds each sampled logical batch size
      (0 once a run has finished its steps): private, for local debugging only.

    Formal guarantee:
      As `train_probe`; the batch of each step includes every row independently with probability q,
      so each run is the Poisson-sampled Gaussian of its `DpPlan`. The physical batches' sums
      are float64 and added with a compensated sum (`dp.accumulate`), then noised in float64:
      one row moves a step's computed sum by at most C (1 + 1e-6) for batches up to 10^9 rows.
    """
    flags = flags or PerformanceFlags()
    feats, onehot, mask = prepare_inputs(features, labels, spec, flags.feature_dtype)
    arrays = run_arrays(runs, keys, len(feats))
    state = init_state_jit(spec, arrays, feats.shape[-1])
    total = int(arrays.steps.max())
    batch_sizes = np.zeros((total, len(runs)), np.int64)
    batches = poisson_batches(len(feats), [r.plan.sampling_probability for r in runs],
                              arrays.steps, flags.physical_batch_size, rng)
    with step_bar(total, progress, "probe steps (Poisson)") as bar:
        for step, batch in enumerate(batches):
            bar.wait_for(f"step {step + 1}" + (" (the first compiles)" if step == 0 else ""))
            batch_sizes[step] = batch.sizes
            sums = None
            for index, batch_mask in zip(batch.index, batch.mask, strict=True):
                sums = add_parts(sums, _batch_sums(state.params, feats[index], onehot[index],
                                                   batch_mask * mask[index], arrays.clip,
                                                   spec=spec))
            state = dp_update_jit(spec, arrays, state, *sums.value(), step,
                                  batch.sizes.astype(np.float32))
            bar.update(1)
    return result(state, arrays, batch_sizes)
