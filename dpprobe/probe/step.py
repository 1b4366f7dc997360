"""The step every probe trainer shares, and the state it carries.

One step of config p (Mehta et al. 2022, https://arxiv.org/abs/2205.02973; Panda et al. 2022,
https://arxiv.org/abs/2212.06470, Alg. 1):

    g = (sum_i clip_C(grad_i) + N(0, (sigma C)^2 I)) / denominator    # privatize
    params <- params - lr * optimizer(g)                               # post-processing (optax)

as the optax chain `dp.private_optimizer` (the privatizer, the mean, the optimizer). Configs
are stacked along a leading axis P (weights (P, d, C)) and the transformation is vmapped over
them, so one program steps every config of a sweep. Weights start at zero and biases at a
constant, so at the first step every config sits at the same point: the clipped sum is
computed once per distinct clip norm (`shared_start_sums`). Configs with fewer steps than the
longest stop updating.

A trainer (in memory, streamed, Poisson) only decides how the clipped sums are computed; it
hands them to `dp_update`, which is the same for all, so they agree for the same keys.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpprobe.dp.accumulate import x64_jit
from dpprobe.dp.noise import noise_stddev
from dpprobe.dp.optimizers import private_optimizer
from dpprobe.probe.specs import Params, ProbeSpec, RunSpec, TrainResult
from dpprobe.probe.step_bar import step_bar

__all__ = ["RunArrays", "State", "dp_update", "dp_update_jit", "init_params",
           "init_state", "init_state_jit", "result", "run_arrays", "shared_start_sums",
           "step_bar", "step_blocks"]


class RunArrays(NamedTuple):
    """Per-run arrays (NumPy, so the jitted steps take them as arguments)."""

    noise_std: np.ndarray  # sigma * C (0 for non-private runs)
    clip: np.ndarray
    lr: np.ndarray
    steps: np.ndarray
    denominator: np.ndarray  # N full batch, q N with Poisson sampling
    keys: jax.Array
    unique_clips: np.ndarray  # distinct clip norms, for the shared first step
    clip_index: np.ndarray  # run -> index into unique_clips


class State(NamedTuple):
    """What one step hands the next: stacked params, their optax states, clipping counts."""

    params: Params
    opt_state: Any
    clipped_total: jax.Array  # (P,) sum over steps of the fraction of examples clipped


def run_arrays(runs: Sequence[RunSpec], keys: jax.Array, num_examples: int) -> RunArrays:
    """Per-run privacy and optimization arrays, with the step-0 clip grouping."""
    if not runs:
        raise ValueError("runs must not be empty")
    if keys.shape[0] != len(runs):
        raise ValueError(f"need one key per run: {len(runs)} runs, {keys.shape[0]} keys")
    clip = np.array([r.plan.clip_norm for r in runs], np.float32)
    unique_clips, clip_index = np.unique(clip, return_inverse=True)
    rates = np.array([r.plan.sampling_probability for r in runs], np.float64)
    return RunArrays(
        noise_std=np.array([noise_stddev(r.plan) for r in runs], np.float32),
        clip=clip,
        lr=np.array([r.learning_rate for r in runs], np.float32),
        steps=np.array([r.plan.steps for r in runs], np.int32),
        denominator=(rates * num_examples).astype(np.float32),
        keys=keys,
        unique_clips=unique_clips,
        clip_index=clip_index.reshape(-1).astype(np.int32),
    )


def init_params(num_runs: int, dim: int, spec: ProbeSpec) -> Params:
    """Zero weights and constant biases for `num_runs` stacked linear models."""
    return {
        "w": jnp.zeros((num_runs, dim, spec.num_classes), jnp.float32),
        "b": jnp.full((num_runs, spec.num_classes), spec.initial_bias, jnp.float32),
    }


def _transform(spec: ProbeSpec, stddev, key, denominator, learning_rate):
    return private_optimizer(spec.make_optimizer(learning_rate), stddev=stddev, key=key,
                             expected_batch_size=denominator)


def _per_run(runs: RunArrays):
    return runs.noise_std, runs.keys, runs.denominator, runs.lr


def init_state(spec: ProbeSpec, runs: RunArrays, dim: int) -> State:
    params = init_params(runs.lr.shape[0], dim, spec)
    opt_state = jax.vmap(lambda std, key, den, lr, p: _transform(spec, std, key, den, lr).init(p)
                         )(*_per_run(runs), params)
    return State(params, opt_state, jnp.zeros(runs.lr.shape, jnp.float32))


def dp_update(spec: ProbeSpec, runs: RunArrays, state: State, sums: Params, num_clipped,
              step, batch_size) -> State:
    """Privatize the clipped sums and step the optimizer of every run still active.

    Args:
      sums: {"w": (P, d, C), "b": (P, C)}: each run's sum of clipped per-example gradients.
      num_clipped: (P,) examples clipped (a private diagnostic).
      step: the step index (the noise of step t is `fold_in(key, t)`).
      batch_size: (P,) or scalar, the number of rows summed (for the clipped fraction only).
    """

    def one(std, key, den, lr, grads, opt_state, params):
        updates, opt_state = _transform(spec, std, key, den, lr).update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params, opt_state = jax.vmap(one)(*_per_run(runs), sums, state.opt_state, state.params)
    active = step < runs.steps

    def select(new, old):
        return jnp.where(active.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)

    clipped = jnp.where(active, num_clipped / jnp.maximum(batch_size, 1.0), 0.0)
    clipped = clipped.astype(state.clipped_total.dtype)  # x64 programs: counts are int64
    return State(jax.tree.map(select, params, state.params),
                 jax.tree.map(select, opt_state, state.opt_state),
                 state.clipped_total + clipped)


# For the trainers whose steps are Python loops (streamed, Poisson): one compiled call each,
# with x64 scoped to it (the sums arrive in float64, `dp.accumulate`).
dp_update_jit = x64_jit(dp_update, static_argnames=("spec",), donate_argnames=("state",))
init_state_jit = x64_jit(init_state, static_argnames=("spec", "dim"))


def shared_start_sums(spec: ProbeSpec, runs: RunArrays, dim: int, sum_fn):
    """Step-0 clipped sums: every run starts at the same point, so one per clip norm."""
    start = init_params(runs.unique_clips.shape[0], dim, spec)
    sums, num_clipped = sum_fn(start, runs.unique_clips)
    return jax.tree.map(lambda s: s[runs.clip_index], sums), num_clipped[runs.clip_index]


def result(state: State, runs: RunArrays, batch_sizes=None) -> TrainResult:
    """The frozen result, as NumPy (waits for the device)."""
    clipped = np.asarray(state.clipped_total) / runs.steps
    return TrainResult(jax.tree.map(np.asarray, state.params), clipped, batch_sizes)


# Seconds between moves of a shown step bar: blocks of steps are sized to take about this long.
BAR_SECONDS = 2.0


def step_blocks(total: int, bar, seconds: float = BAR_SECONDS) -> Iterator[tuple[int, int]]:
    """(start, stop) blocks of steps 1..total-1, advancing `bar` (each block is one compiled
    call whose bounds are traced: any block size runs the same program).

    With the bar shown, the caller waits for each block's result before asking for the next
    (JAX dispatches asynchronously: a bar advanced at dispatch races ahead, then stalls until
    the end), and each block is sized from the time per step measured so far, so that the bar
    moves about every `seconds` whatever N and d: 1 step, then at most 4x the last block.
    The block sizes never change what is computed, only when the host looks. Without the
    bar: one block."""
    if bar.disable:
        if total > 1:
            yield 1, total
        return
    start, block = 1, 1
    while start < total:
        stop = min(start + block, total)
        began = time.perf_counter()
        yield start, stop
        per_step = (time.perf_counter() - began) / (stop - start)
        bar.update(stop - start)
        block = max(1, min(4 * block, int(seconds / max(per_step, 1e-9))))
        start = stop
