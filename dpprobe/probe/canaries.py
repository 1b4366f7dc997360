"""Canaries for auditing the DP linear probe, trained with the production trainer.

The canary is white-box and lives in feature space (a user controls the features, so an
adversary can craft a row; Nasr et al. 2023, https://arxiv.org/abs/2302.07956, Sec. 4). The
features get one extra dimension, zero for every data row; the canary row is `CANARY_NORM` along
it and zero elsewhere, with label `CANARY_LABEL`. Its gradient (x r^T, r) lies in the extra row
of the weights, w[d, :], but for its bias part (a share 1/sqrt(1 + CANARY_NORM^2) of its norm);
no data row ever moves w[d, :]. Its norm, CANARY_NORM ||r||, is far above the clip norm, so it
is clipped to C: the most a zero-out neighbour may contribute, where nothing else is.

Its neighbour: the same rows with the canary replaced by a null record (a label outside the
class set, which `probe.prepare_inputs` masks), so both training sets have N + 1 rows (zero-out
neighbours, N public), and both are trained by `probe.train_probe` with `dp.make_keys`:
the clipper, the noise and the optimizer a user runs. Appending the zero column belongs to the
audit: every data row's gradient is what it was, and the audit measures the mechanism on this
setup (store rows, feature width, classes, optimizer, steps).

The score of a model is the movement of its released weights along the canary's descent
direction, -<w_T[d, :], u> / lr (w_0 = 0), u the unit direction of the canary's gradient at the
initial parameters. With a learning rate small enough that the canary's residual does not move
(`audit_learning_rate`; it is post-processing, so the claim does not depend on it), the
canary's clipped gradient is C u at every step, and for DP-SGD the score is
(T C + N(0, T sigma^2 C^2)) / N with the canary and N(0, T sigma^2 C^2) / N without: exactly
the sqrt(T)/sigma-Gaussian-DP pair the accountant claims (Nasr et al.'s gradient canary). Other
optimizers release less; the projection is then a good test, not the best one (for single-step
Adam, i.e. sign-SGD, it is the small-signal likelihood ratio of the signs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dpprobe.dp.clipping import NULL_LABEL
from dpprobe.dp.noise import make_keys
from dpprobe.probe.clipping import residuals
from dpprobe.probe.specs import ProbeSpec, RunSpec
from dpprobe.probe.train import check_full_batch, check_labels, train_probe

__all__ = [
    "CANARY_LABEL",
    "CANARY_NORM",
    "add_canary",
    "audit_learning_rate",
    "canary_direction",
    "canary_scores",
    "claimed_canary_scores",
    "train_canary_runs",
]

CANARY_NORM = 1e3
CANARY_LABEL = 0
# Runs trained per call of the trainer when not given: about this many parameters at once
# (weights, optimizer state and float64 noise draws of every run; ~2 GiB at 2.5e7).
_PARAMETERS_PER_CALL = 25_000_000


def add_canary(features, labels, *, include: bool) -> tuple[np.ndarray, np.ndarray]:
    """The training set of an audit run: the rows with one zero feature appended, then the
    canary row (`include`) or, for its zero-out neighbour, a null record in its place.

    Args:
      features: (N, d) or (N, views, d) data rows.
      labels: (N,) their labels.
      include: whether the canary is in the training set.

    Returns:
      (features (N + 1, [views,] d + 1) float32, labels (N + 1,)).
    """
    features = np.asarray(features)
    labels = check_labels(labels)
    if features.ndim not in (2, 3) or len(features) != len(labels):
        raise ValueError(f"features must be (N, d) or (N, views, d) with one label per row, "
                         f"got {features.shape} and {labels.shape}")
    shape = (len(features) + 1, *features.shape[1:-1], features.shape[-1] + 1)
    out = np.zeros(shape, np.float32)
    out[:-1, ..., :-1] = features
    out[-1, ..., -1] = CANARY_NORM
    # A label outside [0, num_classes) makes the row a null record (it contributes nothing).
    return out, np.append(labels, CANARY_LABEL if include else NULL_LABEL)


def canary_direction(spec: ProbeSpec) -> np.ndarray:
    """u: the unit direction (C,) of the canary's gradient in w[d, :] at the initial
    parameters (zero weights, constant bias): r / ||r|| with r = dloss/dlogits."""
    logits = jnp.full((spec.num_classes,), spec.initial_bias, jnp.float32)
    onehot = jax.nn.one_hot(CANARY_LABEL, spec.num_classes)
    direction = np.asarray(residuals(logits, onehot, spec.loss), np.float64)
    return direction / np.linalg.norm(direction)


def audit_learning_rate(plan, num_examples: int) -> float:
    """A learning rate small enough that the canary's logits move by less than ~1e-6 over the
    whole run (so its residual, and its clipped gradient's direction, stay as at the start).

    One step moves a weight by at most lr (C + |noise|) / N for SGD, about lr for Adam and sign
    updates, and momentum sums up to 1 / (1 - 0.9) of them; the canary's logits move CANARY_NORM
    times that. Noise beyond 8 sigma C has probability ~1e-15 per coordinate.
    """
    per_step = max(1.0, plan.clip_norm * (1.0 + 8.0 * plan.noise_multiplier) / num_examples)
    return 1e-6 / (CANARY_NORM * 10.0 * per_step * plan.steps)


def canary_scores(params, direction: np.ndarray, learning_rates) -> np.ndarray:
    """Scores (P,) of P stacked trained probes: -<w[d, :], u> / lr, d the canary's feature."""
    weights = np.asarray(params["w"], np.float64)[:, -1, :]
    return -(weights @ direction) / np.asarray(learning_rates, np.float64)


def train_canary_runs(features, labels, runs: Sequence[RunSpec], spec: ProbeSpec, *,
                      include: bool, runs_per_call: int | None = None,
                      progress: Callable[[int], None] | None = None) -> np.ndarray:
    """Train one probe per run on the rows plus the canary (or its null record), with
    `probe.train_probe` and fresh secret keys (`dp.make_keys`), and score each.

    Args:
      features, labels: the data rows (without the canary).
      runs: full-batch configs; each is one independent training run.
      spec: the probe (loss, optimizer); its normalization must be "none" (the canary is
        crafted in the trained feature space).
      include: train with the canary, or with a null record in its place.
      runs_per_call: runs per compiled call (a speed and memory knob; default: about
        2.5e7 parameters per call). Calls have equal sizes, so they share one program.
      progress: called after each call with the number of runs done so far.

    Returns:
      (len(runs),) scores, `canary_scores`.
    """
    check_full_batch(runs)
    if spec.normalization != "none":
        raise ValueError("the audit crafts its canary in the trained feature space: use "
                         f"normalization 'none', got {spec.normalization!r}")
    data = add_canary(features, labels, include=include)
    direction = canary_direction(spec)
    if runs_per_call is None:
        per_run = (data[0].shape[-1] + 1) * spec.num_classes
        runs_per_call = max(1, _PARAMETERS_PER_CALL // per_run)
    calls = math.ceil(len(runs) / runs_per_call)
    size = math.ceil(len(runs) / calls)
    scores = []
    for start in range(0, len(runs), size):
        chunk = list(runs[start:start + size])
        chunk += chunk[-1:] * (size - len(chunk))  # equal sizes: one compiled program
        result = train_probe(*data, chunk, make_keys(size), spec)
        scores.append(canary_scores(result.params, direction,
                                    [r.learning_rate for r in chunk]))
        if progress is not None:
            progress(min(start + size, len(runs)))
    return np.concatenate(scores)[:len(runs)]


def claimed_canary_scores(run: RunSpec, spec: ProbeSpec, *, num_examples: int, count: int,
                          include: bool, rng: np.random.Generator) -> np.ndarray:
    """`count` scores that the canary coordinates w[d, :] would give if the mechanism were
    exactly what `run.plan` claims: each step's sum there is C u (with the canary) or 0, plus
    N(0, (sigma C)^2 I), then division by N and `spec`'s optimizer (optax), from zero.

    A simulation of the claim, not of the code: the audit picks its test thresholds on it
    before training (`dp.auditing.choose_thresholds`). Its randomness is a public
    `rng` (no private data enters). LAMB's trust ratio here sees only these coordinates.
    """
    plan, optimizer = run.plan, spec.make_optimizer(run.learning_rate)
    direction = jnp.asarray(canary_direction(spec), jnp.float32)
    signal = plan.clip_norm * direction * (1.0 if include else 0.0)
    noise_std = plan.noise_multiplier * plan.clip_norm
    noise = rng.standard_normal((count, plan.steps, spec.num_classes), np.float32)

    def one(noise_steps):
        def step(carry, z):
            params, state = carry
            grads = (signal + noise_std * z) / num_examples
            updates, state = optimizer.update(grads, state, params)
            return (params + updates, state), None

        params = jnp.zeros(spec.num_classes, jnp.float32)
        (params, _), _ = jax.lax.scan(step, (params, optimizer.init(params)), noise_steps)
        return -(params @ direction) / run.learning_rate

    return np.asarray(jax.jit(jax.vmap(one))(noise), np.float64)
