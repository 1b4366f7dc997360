"""The one-run privacy audits of the finetuning trainer (Steinke, Nasr & Jagielski 2023,
https://arxiv.org/abs/2305.08846): m canaries, each in the training set with probability 1/2,
one model trained by the production `train_finetune`, one score per canary, and
`dp.one_run_epsilon_bound` on the scores.

Two kinds of canaries:
  * gradient canaries (`audit_finetune_gradients`, the default of `dpprobe finetune
    --audit-canaries`): white-box, tight (`dp.canaries`: Dirac canary gradients of norm far
    above C on coordinates of the model's own parameters, through the trainer's own sampling,
    clipping and noise, scored on every step's privatized sum at those coordinates), with a
    rigorous lower bound and an estimate of epsilon;
  * image canaries (`audit_finetune`, below): black-box, loose by nature.

Image canaries.
Canaries: images of uniform random noise in the data's shape and dtype, each with a uniformly
random label. The generator is seeded: the canaries and their in/out coins are the auditor's
public randomness, independent of the mechanism's (noise keys and batch sampling still come from
OS entropy). Noise images rather than mislabelled copies of training images: a noise image lies
far from the data, so no data gradient pulls its score either way (an out canary scores like a
fresh draw, near chance, whatever the data), and the only thing that can raise an included
canary's score is its own clipped gradient; a mislabelled training image is fought by the
gradients of its correctly labelled neighbours, and the in/out gap it leaves is smaller at the
same clip norm. (Random crops and flips of a noise image are unlike each other, which weakens
memorization under augmentation; the audit measures the recipe as run.)

Neighbours: the training set always holds N + m rows; an excluded canary is a null record (its
label outside the class set, so it contributes exactly zero), so in and out differ by exactly
the zero-out relation the accountant's claim is for, and N + m is public.

Score: the log-probability of the canary's label under the final (non-EMA) model on the
canary image itself (higher: more likely included), a function of the released model alone.

What it shows: for an (epsilon, delta)-DP run, the number of correct "in" guesses is dominated
by a binomial (Steinke et al. Thm. 3.1). With m canaries at confidence 1 - beta, even perfect
guesses refute at most about log(m / 2 / log(1/beta)) (~5 for m = 1000 at 95%, less with the
threshold chosen on half of them): weak by construction, a lower bound for this canary and this
threat model (an adversary who inserts training images and sees the final weights), never a
proof of privacy. The canaries are extra training records: the model is an audit model, and
its accuracy is not that of the model trained without them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dpprobe.accounting import DpPlan
from dpprobe.dp.auditing import OneRunAudit, empirical_auroc, one_run_epsilon_bound
from dpprobe.dp.canaries import GradientCanaries, GradientCanaryAudit, audit_gradient_canaries
from dpprobe.dp.clipping import NULL_LABEL
from dpprobe.finetune.graph_key import graph_key, graph_of
from dpprobe.finetune.specs import FinetuneResult, FinetuneSpec
from dpprobe.finetune.train import model_inputs, split_trained, train_finetune, trained_sizes

__all__ = [
    "NOTE",
    "CanaryAudit",
    "audit_finetune",
    "audit_finetune_gradients",
    "canary_scores",
    "insert_canaries",
    "make_canaries",
]

NOTE = ("A one-run lower bound (Steinke, Nasr & Jagielski 2023), weak by construction (at most "
        "about log(m / 2 / log(1/beta)), ~5 with 1000 canaries at 95%), for this canary and this "
        "threat model (an adversary who inserts training images and sees the final weights): it "
        "can refute the claim, never prove it. The canaries are extra training records, so the "
        "model trained with them is an audit model: its accuracy is not the production "
        "model's; the run's privacy claim covers the real records with the canaries present.")


@dataclasses.dataclass(frozen=True)
class CanaryAudit(OneRunAudit):
    """What one black-box audited run shows: `OneRunAudit`'s bound (claimed epsilon with PLD),
    and

    Attributes:
      ratio: epsilon_lower / claimed_epsilon.
      auroc: of the scores (in vs out; `dp.auditing.empirical_auroc`, a point estimate, no
        confidence).
    """

    ratio: float
    auroc: float

    DESCRIPTION = {
        "canary": "uniform noise images in the data's shape, uniformly random labels "
                  "(seeded: the auditor's public randomness); each in with probability "
                  "1/2, an excluded one is a null record (zero-out neighbours)",
        "score": "log-probability of the canary's label under the final (non-EMA) model",
        "threshold": "chosen on half the canaries, bounded on the other (MultiSplit, "
                     "median of 100 splits)",
        "note": NOTE,
    }


def make_canaries(shape: tuple[int, ...], dtype, num_classes: int, count: int,
                  rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(images (count, *shape), labels (count,), included (count,) bools): uniform noise
    images (uint8 in [0, 255], floats in [0, 1]), uniform labels, fair in/out coins."""
    if count < 2:
        raise ValueError(f"count must be >= 2, got {count}")
    dtype = np.dtype(dtype)
    if dtype == np.uint8:
        images = rng.integers(0, 256, (count, *shape), dtype=np.uint8)
    else:
        images = rng.random((count, *shape)).astype(dtype)
    labels = rng.integers(0, num_classes, count).astype(np.int32)
    return images, labels, rng.random(count) < 0.5


def insert_canaries(images, labels, canary_images, canary_labels, included
                    ) -> tuple[np.ndarray, np.ndarray]:
    """The training set of an audited run: the N rows, then the m canaries, each excluded one
    a null record (label `NULL_LABEL`): N + m rows whatever the coins."""
    images = np.concatenate([np.asarray(images), canary_images.astype(np.asarray(images).dtype)])
    labels = np.concatenate([np.asarray(labels, np.int32),
                             np.where(included, canary_labels, NULL_LABEL).astype(np.int32)])
    return images, labels


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def _log_probabilities(graphdef, params, rest, images, labels, *, spec: FinetuneSpec):
    logits = nnx.merge(graph_of(graphdef), params, rest)(model_inputs(images, spec))
    logits = logits.astype(jnp.float32)
    return -optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def canary_scores(model: nnx.Module, images, labels, spec: FinetuneSpec, *,
                  batch_size: int = 256) -> np.ndarray:
    """log p(label | image) under `model`, per canary (float64)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    graphdef = graph_key(graphdef)  # hashed once, not per batch
    out = []
    for start in range(0, len(labels), batch_size):
        out.append(np.asarray(_log_probabilities(
            graphdef, params, rest, jnp.asarray(images[start:start + batch_size]),
            jnp.asarray(labels[start:start + batch_size], jnp.int32), spec=spec)))
    return np.concatenate(out).astype(np.float64)


def audit_finetune(model: nnx.Module, images, labels, plan: DpPlan, spec: FinetuneSpec, *,
                   canaries: int = 1000, delta: float = 1e-5, confidence: float = 0.95,
                   seed: int = 0, accountant: str = "pld", **train_options
                   ) -> tuple[FinetuneResult, CanaryAudit]:
    """Train one model with `canaries` canaries inserted (module docstring) and bound epsilon.

    Args:
      model, images, labels, spec: as for `train_finetune` (the N real rows).
      plan: the run's mechanism on the N + m rows (its q is of N + m rows; its epsilon at
        `delta` is the claim audited).
      canaries: m.
      delta, confidence: of the claim and of the lower bound.
      seed: the canaries' and their coins' public generator.
      accountant: of the claim.
      **train_options: passed to `train_finetune` (flags, checkpointer, progress; keys and rng
        only in tests: the production mechanism draws them from OS entropy).

    Returns:
      (the trained audit model's `FinetuneResult`, the `CanaryAudit`).
    """
    images, labels = np.asarray(images), np.asarray(labels)
    canary_images, canary_labels, included = make_canaries(
        images.shape[1:], images.dtype, spec.num_classes, canaries,
        np.random.default_rng(seed))
    if included.all() or not included.any():
        raise ValueError("every canary fell on the same side: use more canaries")
    train_images, train_labels = insert_canaries(images, labels, canary_images, canary_labels,
                                                 included)
    result = train_finetune(model, train_images, train_labels, plan, spec, **train_options)
    scores = canary_scores(result.model, canary_images, canary_labels, spec)
    bound = one_run_epsilon_bound(scores, included, delta, 1.0 - confidence)
    auroc = empirical_auroc(scores[included], scores[~included])
    claimed = plan.epsilon(delta, accountant) if plan.is_private else float("inf")
    audit = CanaryAudit(epsilon_lower=bound, confidence=confidence, delta=delta,
                        canaries=canaries, included=int(included.sum()), claimed_epsilon=claimed,
                        ratio=bound / claimed, auroc=auroc, refuted=bound > claimed)
    return result, audit


def audit_finetune_gradients(model: nnx.Module, images, labels, plan: DpPlan,
                             spec: FinetuneSpec, *, canaries: int = 5000, delta: float = 1e-5,
                             confidence: float = 0.95, seed: int = 0, accountant: str = "pld",
                             **train_options) -> tuple[FinetuneResult, GradientCanaryAudit]:
    """Train one model with `canaries` white-box gradient canaries (`dp.canaries`: Dirac
    gradients on coordinates of the model's trained parameters) and bound and estimate
    epsilon from every step's privatized sum at those coordinates.

    Args:
      model, images, labels, plan, spec, canaries, delta, confidence, accountant,
        **train_options: as for `audit_finetune`; `canaries` at most the number of trained
        parameters (one coordinate each).
      seed: the canaries' coordinates and in/out coins (the auditor's public randomness; the
        mechanism's noise and sampling still come from OS entropy).

    Returns:
      (the trained audit model's `FinetuneResult`: an audit artefact, its trained parameters
      moved by the included canaries; the `GradientCanaryAudit`).
    """
    sizes = trained_sizes(split_trained(model, spec)[1])
    drawn = GradientCanaries.draw(canaries, sizes, np.random.default_rng(seed))
    result = train_finetune(model, images, labels, plan, spec, canaries=drawn, **train_options)
    audit = audit_gradient_canaries(result.canary_projections, drawn, plan, delta=delta,
                                    confidence=confidence, accountant=accountant)
    return result, audit
