"""DP training of linear probes: many configs at once, in memory, streamed, sharded, or Poisson.

One step of config p (Mehta et al. 2023; Panda et al. 2023, Alg. 1):

    g = (sum_i clip_C(grad_i) + N(0, (sigma C)^2 I)) / N        # privatize: nothing in between
    params <- params - lr * optimizer(g)                         # post-processing (optax)

Weights start at zero and biases at a constant, so at the first step every config of a sweep
sits at the same point: the clipped sum is computed once per distinct clip norm and shared.
Configs are stacked along a leading axis P (weights (P, d, C)), so each later step does one
matmul for all of them. Configs with fewer steps than the longest simply stop updating.

Four drivers share the same step (`_privatize_and_update`) and the same noise
(`fold_in(key, step)`), so they give the same result for the same keys:
  * `train_probe`: features in memory (optionally row-sharded over devices with a `mesh`);
  * `train_probe_streaming`: the clipped sum accumulated over row chunks streamed from disk;
  * `train_probe_poisson`: masked DP-SGD with Poisson subsampling (Beltran et al. 2024).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import queue
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from accounting import DpPlan
from probe.clipping import (
    LOSSES,
    Loss,
    clipped_grad_sum,
    feature_gram,
    zero_nonfinite_rows,
)
from probe.executables import cached_call
from probe.mechanism import gaussian_noise
from probe.normalization import NORMALIZATIONS, normalize_features
from probe.optimizers import OPTIMIZERS, make_optimizer

__all__ = [
    "ProbeSpec",
    "RunSpec",
    "TrainResult",
    "apply_update",
    "init_params",
    "make_data_mesh",
    "noisy_mean",
    "prefetch",
    "prepare_features",
    "shard_rows",
    "train_probe",
    "train_probe_poisson",
    "train_probe_streaming",
]


@dataclasses.dataclass(frozen=True)
class ProbeSpec:
    """Program-shaping choices of a probe. None of them changes epsilon.

    Attributes:
      num_classes: C.
      loss: "softmax" or "sigmoid" (one-vs-all).
      optimizer: one of `probe.OPTIMIZERS`.
      bias_init: initial bias; None gives 0 for softmax and -10 for sigmoid (Mehta et al. E.3).
      normalization: per-example feature normalization ("none", "l2", "group").
      groups: number of groups for "group" normalization.
      momentum, b1, b2, eps, weight_decay: optimizer hyperparameters (see `make_optimizer`).
    """

    num_classes: int
    loss: Loss = "softmax"
    optimizer: str = "adam"
    bias_init: float | None = None
    normalization: str = "none"
    groups: int = 1
    momentum: float = 0.9
    b1: float = 0.9
    b2: float = 0.999
    eps: float | None = None
    weight_decay: float = 0.0

    def __post_init__(self):
        if self.num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {self.num_classes}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(
                f"normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}"
            )

    @property
    def initial_bias(self) -> float:
        if self.bias_init is not None:
            return float(self.bias_init)
        return -10.0 if self.loss == "sigmoid" else 0.0

    def make_optimizer(self):
        return make_optimizer(
            self.optimizer,
            momentum=self.momentum,
            b1=self.b1,
            b2=self.b2,
            eps=self.eps,
            weight_decay=self.weight_decay,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"bias_init": self.initial_bias}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One config of a sweep: its DP mechanism and its learning rate."""

    plan: DpPlan
    learning_rate: float

    def __post_init__(self):
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"learning_rate must be finite and > 0, got {self.learning_rate}")


@dataclasses.dataclass
class TrainResult:
    """Trained stacked parameters (numpy, leading axis = run) and clipping statistics.

    Only `params` is a DP output. `clipped_fraction` and `batch_sizes` (the sampled logical
    batch sizes of Poisson training, (steps, runs)) are exact statistics of the private data:
    for local debugging only, never to be published.
    From `train_probe(..., wait=False)` the fields are JAX arrays still being computed (and
    `clipped_fraction` is None) until `wait()` is called.
    """

    params: dict
    clipped_fraction: np.ndarray | None  # mean over steps of the fraction of examples clipped
    batch_sizes: np.ndarray | None = None
    _finish: Callable | None = dataclasses.field(default=None, repr=False, compare=False)

    def wait(self) -> TrainResult:
        """Block until training is done and make the fields NumPy; returns self."""
        if self._finish is not None:
            finish, self._finish = self._finish, None
            self.params, self.clipped_fraction = finish()
        return self


class _State(NamedTuple):
    """What one program hands the next. The optimizer state travels as its flat tuple of
    leaves (rebuilt by `_opt_state` inside each program), so that a cached executable's
    output tree holds no optax class and a cached run never imports optax."""

    params: dict
    opt_state: tuple
    clipped_total: jax.Array  # (P,) sum over steps of the clipped fraction


class _Runs(NamedTuple):
    """Per-run arrays (NumPy: the jitted steps take them as arguments, no eager device ops)."""

    noise_std: jax.Array  # sigma * C (0 for non-private runs)
    clip: jax.Array
    lr: jax.Array
    steps: jax.Array
    keys: jax.Array
    unique_clips: jax.Array  # distinct clip norms, for the shared first step
    clip_index: jax.Array  # run -> index into unique_clips


def init_params(num_runs: int, dim: int, spec: ProbeSpec) -> dict:
    """Zero weights and constant biases for `num_runs` stacked linear models."""
    return {
        "w": jnp.zeros((num_runs, dim, spec.num_classes), jnp.float32),
        "b": jnp.full((num_runs, spec.num_classes), spec.initial_bias, jnp.float32),
    }


def noisy_mean(sums: dict, noise_std: jax.Array, keys: jax.Array, step, denominator) -> dict:
    """(sum + N(0, std^2 I)) / denominator, per run, with the noise of `fold_in(key, step)`."""

    def one(key, std, denom, sum_w, sum_b):
        # One draw for all coordinates (it compiles faster than one draw per leaf).
        noise = gaussian_noise(jax.random.fold_in(key, step), sum_w.size + sum_b.size)
        return {
            "w": (sum_w + std * noise[: sum_w.size].reshape(sum_w.shape)) / denom,
            "b": (sum_b + std * noise[sum_w.size:]) / denom,
        }

    denominator = jnp.broadcast_to(jnp.asarray(denominator, jnp.float32), noise_std.shape)
    return jax.vmap(one)(keys, noise_std, denominator, sums["w"], sums["b"])


def apply_update(tx, params, opt_state, grads, learning_rate, active):
    """params - lr * tx(grads) for runs where `active`; inactive runs are left unchanged."""
    updates, new_state = jax.vmap(tx.update)(grads, opt_state, params)

    def select(new, old):
        return jnp.where(active.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)

    new_params = jax.tree.map(
        lambda p, u: p - learning_rate.reshape((-1,) + (1,) * (u.ndim - 1)) * u, params, updates
    )
    return jax.tree.map(select, new_params, params), jax.tree.map(select, new_state, opt_state)


def _privatize_and_update(spec, runs: _Runs, state: _State, sums, num_clipped, step, denominator,
                          batch_size) -> _State:
    """Noise the clipped sums, then step the optimizer of every run still active."""
    grads = noisy_mean(sums, runs.noise_std, runs.keys, step, denominator)
    active = step < runs.steps
    tx = spec.make_optimizer()
    params, opt_state = apply_update(
        tx, state.params, _opt_state(tx, state), grads, runs.lr, active
    )
    clipped = jnp.where(active, num_clipped / jnp.maximum(batch_size, 1.0), 0.0)
    return _State(params, tuple(jax.tree.leaves(opt_state)), state.clipped_total + clipped)


def _opt_state(tx, state: _State):
    """The optax state of every run, rebuilt from the flat leaves `_State` carries."""
    structure = jax.tree.structure(jax.eval_shape(jax.vmap(tx.init), state.params))
    return jax.tree.unflatten(structure, state.opt_state)


def _initial_state(spec: ProbeSpec, num_runs: int, dim: int) -> _State:
    params = init_params(num_runs, dim, spec)
    opt_state = jax.vmap(spec.make_optimizer().init)(params)
    return _State(params, tuple(jax.tree.leaves(opt_state)),
                  jnp.zeros((num_runs,), jnp.float32))


def _shared_start_sums(spec, runs: _Runs, dim, sum_fn):
    """Step-0 clipped sums: every run starts at the same point, so compute one per clip norm."""
    start = init_params(runs.unique_clips.shape[0], dim, spec)
    sums, num_clipped = sum_fn(start, runs.unique_clips)
    return jax.tree.map(lambda s: s[runs.clip_index], sums), num_clipped[runs.clip_index]


# ----------------------------------------------------------------------------------------------
# In memory (optionally sharded over devices)
# ----------------------------------------------------------------------------------------------


def _gram(features):
    return feature_gram(features if features.ndim == 3 else features[:, None, :])


@functools.partial(jax.jit, static_argnames=("spec",))
def _first_step(features, onehot, mask, num_examples, runs: _Runs, *, spec):
    """Step 0 of every run (rows with non-finite features are null rows: they add nothing)."""
    # A float16 cache stays float16 in memory; the cast and the zeroing fuse into one pass.
    features, mask = zero_nonfinite_rows(features.astype(jnp.float32), mask)
    state = _initial_state(spec, runs.lr.shape[0], features.shape[-1])
    gram = _gram(features)

    def sum_fn(params, clip):
        return clipped_grad_sum(params, features, onehot, clip, loss=spec.loss, mask=mask,
                                gram=gram, finite_rows=True)

    sums, num_clipped = _shared_start_sums(spec, runs, features.shape[-1], sum_fn)
    return _privatize_and_update(spec, runs, state, sums, num_clipped, 0, num_examples,
                                 num_examples)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
def _more_steps(state, start, stop, features, onehot, mask, num_examples, runs: _Runs, *, spec):
    features, mask = zero_nonfinite_rows(features.astype(jnp.float32), mask)
    gram = _gram(features)  # O(N d), loop-invariant: computed once per block of steps

    def body(step, state):
        sums, num_clipped = clipped_grad_sum(
            state.params, features, onehot, runs.clip, loss=spec.loss, mask=mask, gram=gram,
            finite_rows=True,
        )
        return _privatize_and_update(spec, runs, state, sums, num_clipped, step, num_examples,
                                     num_examples)

    return jax.lax.fori_loop(start, stop, body, state)


def prepare_features(features, spec: ProbeSpec):
    """Check the shape and dtype (public metadata) and normalize each example; float16 is kept.

    The values are not inspected: a row with NaN or Inf contributes nothing to any clipped sum
    (`probe.clipped_grad_sum`), so no outcome depends on whether one private row is bad.
    """
    features = np.asarray(features)
    if features.ndim not in (2, 3):
        raise ValueError(f"features must be (N, d) or (N, views, d), got shape {features.shape}")
    if not np.issubdtype(features.dtype, np.floating):
        raise ValueError(f"features must be floating point, got {features.dtype}")
    return normalize_features(features, spec.normalization, groups=spec.groups)


def _check_labels(labels) -> np.ndarray:
    """The labels as a 1-D integer array (shape and dtype only: values are private)."""
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be a 1-D integer array, got {labels.dtype} {labels.shape}")
    return labels


def _onehot(labels, num_classes) -> tuple[np.ndarray, np.ndarray]:
    """(one-hot (N, C), 0/1 mask): a label outside [0, C) gives a masked row, which contributes
    nothing, rather than an error whose occurrence would depend on one private record."""
    labels = _check_labels(labels)
    valid = (labels >= 0) & (labels < num_classes)
    onehot = np.eye(num_classes, dtype=np.float32)[np.where(valid, labels, 0)]
    return onehot * valid[:, None], valid.astype(np.float32)


def _runs_arrays(runs: Sequence[RunSpec], keys: jax.Array) -> _Runs:
    """Per-run privacy and optimization arrays, with the step-0 clip grouping."""
    if not runs:
        raise ValueError("runs must not be empty")
    if keys.shape[0] != len(runs):
        raise ValueError(f"need one key per run: {len(runs)} runs, {keys.shape[0]} keys")
    sigma = np.array([r.plan.noise_multiplier for r in runs], np.float32)
    clip = np.array([r.plan.clip_norm for r in runs], np.float32)
    # Non-private runs have sigma = 0 and may have clip = inf: their noise is exactly zero.
    noise_std = np.where(sigma > 0, sigma * np.where(np.isfinite(clip), clip, 0.0), 0.0)
    unique_clips, clip_index = np.unique(clip, return_inverse=True)
    return _Runs(
        noise_std=noise_std.astype(np.float32),
        clip=clip,
        lr=np.array([r.learning_rate for r in runs], np.float32),
        steps=np.array([r.plan.steps for r in runs], np.int32),
        keys=keys,
        unique_clips=unique_clips,
        clip_index=clip_index.reshape(-1).astype(np.int32),
    )


def _check_full_batch(runs: Sequence[RunSpec]) -> None:
    for run in runs:
        if run.plan.sampling_probability != 1.0:
            raise ValueError("this trainer is full batch; use train_probe_poisson for q < 1")


def make_data_mesh(num_devices: int | None = None) -> jax.sharding.Mesh:
    """A 1-D mesh named "data" over the first `num_devices` devices (default: all)."""
    devices = jax.devices()[: num_devices or jax.device_count()]
    return _auto_mesh(jax.sharding.Mesh(np.array(devices), ("data",)))


def _auto_mesh(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
    """The same mesh with automatic (compiler-chosen) axes: XLA inserts the cross-device
    reduction of the clipped sums itself."""
    auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=auto)


def shard_rows(mesh: jax.sharding.Mesh, *arrays):
    """Pad rows to a multiple of the mesh size and shard them over its 'data' axis.

    Returns the sharded arrays followed by a 0/1 row mask (padding rows are 0). In a
    multi-host job (`jax.distributed.initialize()`), pass each process's own rows (every
    process the same number): the global array is assembled with
    `jax.make_array_from_process_local_data`.
    """
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = _auto_mesh(mesh)
    num_local = arrays[0].shape[0]
    local_devices = len([d for d in mesh.devices.flat if d.process_index == jax.process_index()])
    padded = -(-num_local // local_devices) * local_devices
    mask = np.ones((num_local,), np.float32)
    out = []
    for array in (*arrays, mask):
        array = np.asarray(array)
        pad = np.zeros((padded - num_local, *array.shape[1:]), array.dtype)
        sharding = NamedSharding(mesh, PartitionSpec("data", *([None] * (array.ndim - 1))))
        out.append(jax.make_array_from_process_local_data(sharding, np.concatenate([array, pad])))
    return out


def _step_blocks(total: int, progress: bool, desc: str) -> Iterator[tuple[int, int]]:
    """(start, stop) blocks of steps 1..total-1, about 20 of them, with a progress bar."""
    block = max(1, (total - 1) // 20)
    with tqdm(total=total, initial=1, unit="step", desc=desc, disable=not progress,
              file=sys.stderr, dynamic_ncols=True, leave=False) as bar:
        for start in range(1, total, block):
            stop = min(start + block, total)
            yield start, stop
            bar.update(stop - start)


def train_probe(
    features,
    labels,
    runs: Sequence[RunSpec],
    keys: jax.Array,
    spec: ProbeSpec,
    *,
    mesh: jax.sharding.Mesh | None = None,
    progress: bool = False,
    wait: bool = True,
) -> TrainResult:
    """Train one zero-initialized linear probe per run, full batch, all runs in one program.

    Args:
      features: (N, d) or (N, views, d) training features; views are averaged per example
        before clipping (augmentation multiplicity, De et al. 2022 eq. 4).
      labels: (N,) integer labels in [0, num_classes).
      runs: the configs; every `run.plan` must be full batch (sampling_probability 1).
      keys: (len(runs),) secret noise keys from `probe.make_keys` (OS entropy).
      spec: loss, optimizer, normalization.
      mesh: optional `jax.sharding.Mesh` with a "data" axis: rows are sharded over its devices
        (data parallel); the clipped sums are reduced across devices and the noise is added
        once, to the reduced sum.
      progress: show a progress bar over steps.
      wait: return when training is done, with NumPy arrays. False returns as soon as the
        work is dispatched (JAX runs it asynchronously), so that the caller can prepare its
        next program (e.g. `evaluate_chunks(result.params, ...)`) meanwhile; then call
        `result.wait()`.

    Returns:
      TrainResult with params {"w": (P, d, C), "b": (P, C)}.

    DP contract: rows are distinct individuals; the neighbouring relation is zero-out (one row
    replaced by a null row that contributes nothing; N public); each run is then exactly the
    mechanism of its `DpPlan`, if `keys` are secret (`make_keys`). Rows with non-finite
    features or labels outside [0, C) are such null rows.
    """
    _check_full_batch(runs)
    arrays = _runs_arrays(runs, keys)
    feats = prepare_features(features, spec)
    onehot, valid = _onehot(labels, spec.num_classes)
    if feats.shape[0] != onehot.shape[0]:
        raise ValueError(f"{feats.shape[0]} feature rows but {onehot.shape[0]} labels")
    num_examples = np.float32(feats.shape[0])
    if mesh is None:  # on the device once, not once per block of steps
        feats, onehot, mask = jax.device_put((feats, onehot, valid))
    else:
        feats, onehot, valid, mask = shard_rows(mesh, feats, onehot, valid)
        mask = mask * valid
    data = (feats, onehot, mask, num_examples)
    first_step = functools.partial(cached_call, _first_step) if mesh is None else _first_step
    state = first_step(*data, arrays, spec=spec)
    total = max(r.plan.steps for r in runs)
    for start, stop in _step_blocks(total, progress, "probe steps"):
        state = _more_steps(state, start, stop, *data, arrays, spec=spec)
    result = TrainResult(state.params, None, None, functools.partial(
        _finish_result, state, arrays))
    return result.wait() if wait else result


def _finish_result(state: _State, runs: _Runs):
    clipped = np.asarray(state.clipped_total) / np.asarray(runs.steps)
    return jax.tree.map(np.asarray, state.params), clipped


def _result(state: _State, runs: _Runs, batch_sizes=None) -> TrainResult:
    params, clipped = _finish_result(state, runs)
    return TrainResult(params, clipped, batch_sizes)


# ----------------------------------------------------------------------------------------------
# Streamed from disk (stores larger than memory)
# ----------------------------------------------------------------------------------------------


def prefetch(iterable: Iterable, depth: int = 2) -> Iterator:
    """Iterate `iterable` in a background thread, `depth` items ahead (I/O overlaps compute)."""
    items: queue.Queue = queue.Queue(maxsize=depth)
    done = object()

    def worker():
        try:
            for item in iterable:
                items.put(item)
        except BaseException as err:  # re-raised in the consumer
            items.put(err)
        items.put(done)

    threading.Thread(target=worker, daemon=True).start()
    while (item := items.get()) is not done:
        if isinstance(item, BaseException):
            raise item
        yield item


def _onehot_masked(labels, mask, num_classes):
    """In-program `_onehot`: labels outside [0, C) become masked rows."""
    valid = (labels >= 0) & (labels < num_classes)
    return jax.nn.one_hot(labels, num_classes, dtype=jnp.float32), mask * valid


@functools.partial(jax.jit, static_argnames=("spec",))
def _chunk_sums(params, features, labels, mask, clip, *, spec):
    """Clipped sums of one (padded) row chunk, after per-example normalization."""
    # Normalize first: a finite but huge row can normalize to NaN, which the zeroing catches.
    features = normalize_features(features.astype(jnp.float32), spec.normalization,
                                  groups=spec.groups)
    features, mask = zero_nonfinite_rows(features, mask)
    onehot, mask = _onehot_masked(labels, mask, spec.num_classes)
    return clipped_grad_sum(params, features, onehot, clip, loss=spec.loss, mask=mask,
                            finite_rows=True)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
def _finish_step(state, sums, num_clipped, step, denominator, batch_size, runs: _Runs, *, spec):
    return _privatize_and_update(spec, runs, state, sums, num_clipped, step, denominator,
                                 batch_size)


def _padded_chunks(chunks: Iterable, spec: ProbeSpec, rows: int | None):
    """Pad each chunk to `rows` rows (mask 0) so one compiled kernel serves all."""
    for features, labels in chunks:
        features = np.asarray(features)
        labels = _check_labels(labels)
        count = len(labels)
        target = rows or count
        if count > target:
            raise ValueError(f"chunk of {count} rows exceeds the chunk size {target}")
        mask = np.zeros((target,), np.float32)
        mask[:count] = 1.0
        if count < target:
            features = np.concatenate(
                [features, np.zeros((target - count, *features.shape[1:]), features.dtype)]
            )
            labels = np.concatenate([labels, np.zeros(target - count, labels.dtype)])
        yield features, labels.astype(np.int32), mask


def train_probe_streaming(
    chunks: Callable[[], Iterable[tuple[np.ndarray, np.ndarray]]],
    runs: Sequence[RunSpec],
    keys: jax.Array,
    spec: ProbeSpec,
    *,
    num_examples: int,
    dim: int,
    rows_per_chunk: int | None = None,
    prefetch_depth: int = 2,
    progress: bool = False,
) -> TrainResult:
    """Full-batch training with the clipped sum accumulated over streamed row chunks.

    The full-batch gradient is a sum over examples, so summing per-chunk clipped sums gives the
    in-memory result (up to float summation order); the noise is added once per step, to the
    total. Memory is O(rows_per_chunk (d + P C)), whatever N is.

    Args:
      chunks: a callable returning a fresh iterable of (features, labels) row chunks (e.g.
        `extract.iter_split_chunks(store, "train")`); it is called once per step.
      runs, keys, spec: as for `train_probe`.
      num_examples: N (the chunks must hold exactly N rows in total).
      dim: feature dim d.
      rows_per_chunk: pad every chunk to this many rows (default: the first chunk's size), so
        that one compiled kernel serves every chunk.
      prefetch_depth: chunks read ahead in a background thread.
      progress: show a progress bar over steps and chunks.
    """
    _check_full_batch(runs)
    arrays = _runs_arrays(runs, keys)
    state = _initial_state(spec, len(runs), dim)
    total = max(r.plan.steps for r in runs)
    denominator = np.float32(num_examples)
    first_start = init_params(arrays.unique_clips.shape[0], dim, spec)
    bar = tqdm(total=total, unit="step", desc="probe steps (streamed)", disable=not progress,
               file=sys.stderr, dynamic_ncols=True, leave=False)
    with bar:
        for step in range(total):
            # Step 0: every run sits at the same point, so one sum per distinct clip norm.
            params, clip = (first_start, arrays.unique_clips) if step == 0 else (
                state.params, arrays.clip)
            sums, num_clipped, seen = None, None, 0
            for features, labels, mask in prefetch(
                _padded_chunks(chunks(), spec, rows_per_chunk), prefetch_depth
            ):
                rows_per_chunk = rows_per_chunk or len(mask)
                part, part_clipped = _chunk_sums(params, features, labels, mask, clip, spec=spec)
                sums = part if sums is None else jax.tree.map(jnp.add, sums, part)
                num_clipped = part_clipped if num_clipped is None else num_clipped + part_clipped
                seen += int(mask.sum())
            if seen != num_examples:
                raise ValueError(f"the chunks held {seen} rows, expected {num_examples}")
            if step == 0:
                sums = jax.tree.map(lambda s: s[arrays.clip_index], sums)
                num_clipped = num_clipped[arrays.clip_index]
            state = _finish_step(state, sums, num_clipped, step, denominator, denominator,
                                 arrays, spec=spec)
            bar.update(1)
    return _result(state, arrays)


# ----------------------------------------------------------------------------------------------
# Poisson-subsampled minibatches: masked DP-SGD (Beltran et al. 2024, Alg. A1)
# ----------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("spec",))
def _poisson_batch_sums(params, features, labels, mask, clip, *, spec):
    """Per-run clipped sums of one physical batch: features (P, p, [V,] d), mask (P, p)."""
    features = features.astype(jnp.float32)
    onehot, mask = _onehot_masked(labels, mask, spec.num_classes)

    def one(w, b, x, y, m, c):
        sums, count = clipped_grad_sum({"w": w[None], "b": b[None]}, x, y, c[None],
                                       loss=spec.loss, mask=m)
        return jax.tree.map(lambda s: s[0], sums), count[0]

    return jax.vmap(one)(params["w"], params["b"], features, onehot, mask, clip)


def train_probe_poisson(
    features,
    labels,
    runs: Sequence[RunSpec],
    keys: jax.Array,
    spec: ProbeSpec,
    *,
    physical_batch_size: int = 256,
    rng: np.random.Generator | None = None,
    progress: bool = False,
) -> TrainResult:
    """Masked DP-SGD with Poisson subsampling (Beltran et al. 2024, Alg. A1), without recompiles.

    Each step, each run draws its logical batch by Poisson sampling: B ~ Binomial(N, q), then a
    uniformly random subset of size B (the same distribution as including every example
    independently with probability q). The batch is cut into physical batches of a fixed size
    p; the last one is padded and the padding masked out, so one compiled kernel serves every
    step. The noisy clipped sum is divided by the expected batch size q N, and the run is
    exactly the Poisson-sampled Gaussian of its `DpPlan`.

    Args:
      features, labels, runs, keys, spec: as for `train_probe`; runs may have any q in (0, 1].
      physical_batch_size: p, rows per compiled kernel call.
      rng: the batch sampler's generator; None (the only private choice) seeds a fresh one from
        OS entropy. A seeded generator makes the batches public: for tests only.
      progress: show a progress bar over steps.

    Returns:
      TrainResult whose `batch_sizes` (steps, runs) holds each sampled logical batch size
      (0 once a run has finished its steps): private, for local debugging only.

    DP contract: as `train_probe`; the batch of each step includes every row independently with
    probability q, so each run is the Poisson-sampled Gaussian of its `DpPlan`.
    """
    if physical_batch_size < 1:
        raise ValueError(f"physical_batch_size must be >= 1, got {physical_batch_size}")
    arrays = _runs_arrays(runs, keys)
    feats = np.asarray(prepare_features(features, spec))
    label_array = _check_labels(labels)
    if len(feats) != len(label_array):
        raise ValueError(f"{len(feats)} feature rows but {len(label_array)} labels")
    num_examples, num_runs, p = len(feats), len(runs), physical_batch_size
    rates = np.array([r.plan.sampling_probability for r in runs])
    steps = np.array([r.plan.steps for r in runs])
    rng = np.random.default_rng() if rng is None else rng  # OS entropy
    denominator = (rates * num_examples).astype(np.float32)
    state = _initial_state(spec, num_runs, feats.shape[-1])
    total = int(steps.max())
    batch_sizes = np.zeros((total, num_runs), np.int64)
    bar = tqdm(total=total, unit="step", desc="probe steps (Poisson)", disable=not progress,
               file=sys.stderr, dynamic_ncols=True, leave=False)
    with bar:
        for step in range(total):
            chosen = []
            for r in range(num_runs):
                size = rng.binomial(num_examples, rates[r]) if step < steps[r] else 0
                chosen.append(rng.choice(num_examples, size=size, replace=False))
                batch_sizes[step, r] = size
            num_batches = max(1, -(-int(batch_sizes[step].max()) // p))
            sums, num_clipped = None, None
            for j in range(num_batches):
                index = np.zeros((num_runs, p), np.int64)
                mask = np.zeros((num_runs, p), np.float32)
                for r, rows in enumerate(chosen):
                    part = rows[j * p:(j + 1) * p]
                    index[r, :len(part)] = part
                    mask[r, :len(part)] = 1.0
                part_sums, part_clipped = _poisson_batch_sums(
                    state.params, feats[index], label_array[index], mask, arrays.clip, spec=spec
                )
                sums = part_sums if sums is None else jax.tree.map(jnp.add, sums, part_sums)
                num_clipped = part_clipped if num_clipped is None else num_clipped + part_clipped
            state = _finish_step(state, sums, num_clipped, step, denominator,
                                 batch_sizes[step].astype(np.float32), arrays, spec=spec)
            bar.update(1)
    return _result(state, arrays, batch_sizes)
