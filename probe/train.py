"""Full-batch DP training of linear probes, many configs in one compiled program.

One step of config p (Mehta et al. 2023; Panda et al. 2023, Alg. 1):

    g = (sum_i clip_C(grad_i) + N(0, (sigma C)^2 I)) / N        # privatize: nothing in between
    params <- params - lr * optimizer(g)                         # post-processing (optax)

Weights start at zero and biases at a constant, so at the first step every config of a sweep
sits at the same point: the clipped sum is computed once per distinct clip norm and shared.
Configs are stacked along a leading axis P (weights (P, d, C)), so each later step does one
matmul for all of them. Configs with fewer steps than the longest simply stop updating.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from accounting import DpPlan
from probe.clipping import LOSSES, Loss, clipped_grad_sum, feature_gram
from probe.normalization import NORMALIZATIONS, normalize_features
from probe.optimizers import OPTIMIZERS, make_optimizer

__all__ = [
    "ProbeSpec",
    "RunSpec",
    "TrainResult",
    "apply_update",
    "init_params",
    "make_keys",
    "noisy_mean",
    "prepare_features",
    "train_probe",
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
    """Trained stacked parameters (numpy, leading axis = run) and clipping statistics."""

    params: dict
    clipped_fraction: np.ndarray  # mean over steps of the fraction of examples clipped


def make_keys(count: int, seed: int | None = None) -> jax.Array:
    """`count` independent noise keys: from OS entropy, or derived from `seed` if given."""
    if seed is None:
        data = np.frombuffer(os.urandom(8 * count), dtype=np.uint32).reshape(count, 2)
        return jax.random.wrap_key_data(jnp.asarray(data))
    base = jax.random.key(seed)
    return jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.arange(count))


def init_params(num_runs: int, dim: int, spec: ProbeSpec) -> dict:
    """Zero weights and constant biases for `num_runs` stacked linear models."""
    return {
        "w": jnp.zeros((num_runs, dim, spec.num_classes), jnp.float32),
        "b": jnp.full((num_runs, spec.num_classes), spec.initial_bias, jnp.float32),
    }


def noisy_mean(sums: dict, noise_std: jax.Array, keys: jax.Array, step, denominator) -> dict:
    """(sum + N(0, std^2 I)) / denominator, per run, with the noise of `fold_in(key, step)`."""

    def one(key, std, sum_w, sum_b):
        key_w, key_b = jax.random.split(jax.random.fold_in(key, step))
        return {
            "w": (sum_w + std * jax.random.normal(key_w, sum_w.shape, sum_w.dtype)) / denominator,
            "b": (sum_b + std * jax.random.normal(key_b, sum_b.shape, sum_b.dtype)) / denominator,
        }

    return jax.vmap(one)(keys, noise_std, sums["w"], sums["b"])


def apply_update(tx, params, opt_state, grads, learning_rate, active):
    """params - lr * tx(grads) for runs where `active`; inactive runs are left unchanged."""
    updates, new_state = jax.vmap(tx.update)(grads, opt_state, params)

    def select(new, old):
        shape = (-1,) + (1,) * (new.ndim - 1)
        return jnp.where(active.reshape(shape), new, old)

    new_params = jax.tree.map(
        lambda p, u: p - learning_rate.reshape((-1,) + (1,) * (u.ndim - 1)) * u, params, updates
    )
    return jax.tree.map(select, new_params, params), jax.tree.map(select, new_state, opt_state)


def _noise_std(sigma, clip):
    # Non-private runs have sigma = 0 and clip = inf: their noise is exactly zero.
    return jnp.where(sigma > 0, sigma * jnp.where(jnp.isfinite(clip), clip, 0.0), 0.0)


@functools.partial(jax.jit, static_argnames=("spec",))
def _train_full_batch(
    features, onehot, mask, num_examples, sigma, clip, lr, steps, keys, unique_clips, clip_index,
    *, spec: ProbeSpec,
):
    num_runs, dim = sigma.shape[0], features.shape[-1]
    tx = spec.make_optimizer()
    gram = feature_gram(features if features.ndim == 3 else features[:, None, :])
    noise_std = _noise_std(sigma, clip)
    params = init_params(num_runs, dim, spec)
    opt_state = jax.vmap(tx.init)(params)

    def grad_step(step, params, opt_state, sums, num_clipped):
        grads = noisy_mean(sums, noise_std, keys, step, num_examples)
        active = step < steps
        params, opt_state = apply_update(tx, params, opt_state, grads, lr, active)
        return params, opt_state, jnp.where(active, num_clipped / num_examples, 0.0)

    # Step 0: every run starts at the same point; one clipped sum per distinct clip norm.
    start = init_params(unique_clips.shape[0], dim, spec)
    shared, shared_clipped = clipped_grad_sum(
        start, features, onehot, unique_clips, loss=spec.loss, mask=mask, gram=gram
    )
    sums = jax.tree.map(lambda s: s[clip_index], shared)
    params, opt_state, clipped = grad_step(0, params, opt_state, sums, shared_clipped[clip_index])

    def body(step, carry):
        params, opt_state, clipped_total = carry
        sums, num_clipped = clipped_grad_sum(
            params, features, onehot, clip, loss=spec.loss, mask=mask, gram=gram
        )
        params, opt_state, clipped = grad_step(step, params, opt_state, sums, num_clipped)
        return params, opt_state, clipped_total + clipped

    params, _, clipped = jax.lax.fori_loop(1, jnp.max(steps), body, (params, opt_state, clipped))
    return params, clipped / steps


def prepare_features(features, spec: ProbeSpec) -> jax.Array:
    """Validate and normalize features ((N, d) or (N, views, d)) to float32."""
    features = np.asarray(features)
    if features.ndim not in (2, 3):
        raise ValueError(f"features must be (N, d) or (N, views, d), got shape {features.shape}")
    if not np.issubdtype(features.dtype, np.floating):
        raise ValueError(f"features must be floating point, got {features.dtype}")
    if not np.isfinite(features).all():
        bad = int((~np.isfinite(features)).reshape(len(features), -1).any(axis=1).sum())
        raise ValueError(f"features contain NaN or Inf in {bad} rows; re-extract or drop them")
    return normalize_features(features, spec.normalization, groups=spec.groups)


def _onehot(labels, num_classes) -> jax.Array:
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be a 1-D integer array, got {labels.dtype} {labels.shape}")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(
            f"labels must lie in [0, {num_classes}), got range [{labels.min()}, {labels.max()}]"
        )
    return jax.nn.one_hot(labels, num_classes, dtype=jnp.float32)


def run_arrays(runs: Sequence[RunSpec]) -> dict:
    """Per-run privacy and optimization arrays (host side), with the step-0 clip grouping."""
    if not runs:
        raise ValueError("runs must not be empty")
    clip = np.array([r.plan.clip_norm for r in runs], np.float32)
    unique_clips, clip_index = np.unique(clip, return_inverse=True)
    return {
        "sigma": jnp.asarray([r.plan.noise_multiplier for r in runs], jnp.float32),
        "clip": jnp.asarray(clip),
        "lr": jnp.asarray([r.learning_rate for r in runs], jnp.float32),
        "steps": jnp.asarray([r.plan.steps for r in runs], jnp.int32),
        "unique_clips": jnp.asarray(unique_clips),
        "clip_index": jnp.asarray(clip_index.reshape(-1), jnp.int32),
    }


def train_probe(
    features,
    labels,
    runs: Sequence[RunSpec],
    keys: jax.Array,
    spec: ProbeSpec,
) -> TrainResult:
    """Train one zero-initialized linear probe per run, full batch, all runs in one program.

    Args:
      features: (N, d) or (N, views, d) training features; views are averaged per example
        before clipping (augmentation multiplicity, De et al. 2022 eq. 4).
      labels: (N,) integer labels in [0, num_classes).
      runs: the configs; every `run.plan` must be full batch (sampling_probability 1).
      keys: (len(runs),) noise keys, e.g. from `make_keys` (OS entropy unless seeded).
      spec: loss, optimizer, normalization.

    Returns:
      TrainResult with params {"w": (P, d, C), "b": (P, C)}.

    DP contract: rows are distinct individuals; N is treated as public (add/remove-one
    neighbours); each run is then exactly the mechanism of its `DpPlan`.
    """
    for run in runs:
        if run.plan.sampling_probability != 1.0:
            raise ValueError("train_probe is full batch; use train_probe_poisson for q < 1")
    if keys.shape[0] != len(runs):
        raise ValueError(f"need one key per run: {len(runs)} runs, {keys.shape[0]} keys")
    feats = prepare_features(features, spec)
    onehot = _onehot(labels, spec.num_classes)
    if feats.shape[0] != onehot.shape[0]:
        raise ValueError(f"{feats.shape[0]} feature rows but {onehot.shape[0]} labels")
    arrays = run_arrays(runs)
    mask = jnp.ones((feats.shape[0],), jnp.float32)
    params, clipped = _train_full_batch(
        feats, onehot, mask, float(feats.shape[0]), arrays["sigma"], arrays["clip"],
        arrays["lr"], arrays["steps"], keys, arrays["unique_clips"], arrays["clip_index"],
        spec=spec,
    )
    return TrainResult(jax.tree.map(np.asarray, params), np.asarray(clipped))
