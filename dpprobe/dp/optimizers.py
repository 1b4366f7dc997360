"""The DP update as an ordinary optax chain: the privatizer, the mean, then any optimizer.

A trainer computes, per step, the sum over its (sampled) examples of per-example gradients
clipped to C (a clipper, `dp.clipping`), then applies

    tx = optax.chain(privatizer(noise_stddev(plan), key),   # + N(0, (sigma C)^2 I)
                     optax.scale(1 / expected_batch_size),   # the noisy mean (N, or q N)
                     optimizer)                              # post-processing: any optax
                                                             # optimizer, its own schedule

(`private_optimizer`). Only the first link touches the private sum; every later link is
post-processing, so the optimizer, its learning rate and its schedule cost no privacy.
`make_optimizer` builds the optimizers the CLI names, learning rate (a float, an array inside
a vmapped sweep, or an optax schedule) included, from optax's own aliases.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from dpprobe.dp.noise import add_noise

__all__ = ["DEFAULT_LEARNING_RATES", "OPTIMIZERS", "PrivatizerState", "make_optimizer",
           "private_optimizer", "privatizer"]

OPTIMIZERS: tuple[str, ...] = ("sgd", "momentum", "adam", "sign", "lamb")

# Sensible starting points: SGD-type updates are clipped-gradient means (norm <= C), Adam-type
# updates have per-coordinate magnitude ~1 (a single step from zero is sign-SGD).
DEFAULT_LEARNING_RATES = {"sgd": 1.0, "momentum": 1.0, "adam": 1e-3, "sign": 1e-3, "lamb": 1e-3}


class PrivatizerState(NamedTuple):
    """The step count: the noise of step t is drawn from `fold_in(key, t)`."""

    count: jax.Array


def privatizer(stddev, key: jax.Array) -> optax.GradientTransformation:
    """An optax transformation that adds N(0, stddev^2 I) to a sum of clipped gradients.

    The interface of `jax_privacy.noise_addition.gaussian_privatizer`, with `dp.noise`'s
    sampler (no hard float32 support) and no default key: `key` must be secret
    (`dp.make_keys`). Step t uses `fold_in(key, t)`, so the noise of a step does not depend on
    how the sum was computed (in memory, streamed, sharded, in physical batches): trainers
    given the same key agree exactly.

    Formal guarantee:
      If the input's L2 sensitivity is C (every example clipped to C, zero-out neighbours)
      and stddev = sigma C, each update is the Gaussian mechanism of noise multiplier sigma,
      with noise independent across steps.
    """

    def init(params):
        del params
        return PrivatizerState(jnp.zeros((), jnp.int32))

    def update(sum_of_clipped_grads, state, params=None):
        del params
        noisy = add_noise(sum_of_clipped_grads, stddev, jax.random.fold_in(key, state.count))
        return noisy, PrivatizerState(state.count + 1)

    return optax.GradientTransformation(init, update)


def private_optimizer(optimizer: optax.GradientTransformation, *, stddev, key: jax.Array,
                      expected_batch_size, observer: optax.GradientTransformation | None = None
                      ) -> optax.GradientTransformation:
    """The whole DP update of one run: `privatizer(stddev, key)`, division by
    `expected_batch_size` (N full batch, q N with Poisson sampling: public), then `optimizer`
    (any optax optimizer, learning rate and schedule included; post-processing). Its updates
    are added to the parameters (`optax.apply_updates`).

    `observer`: a transformation that sees the privatized sum right after the noise and passes
    it on unchanged (an auditor's tap, `dp.canary_tap`)."""
    observe = () if observer is None else (observer,)
    return optax.chain(privatizer(stddev, key), *observe, optax.scale(1.0 / expected_batch_size),
                       optimizer)


def make_optimizer(
    name: str,
    learning_rate,
    *,
    momentum: float = 0.9,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float | None = None,
    weight_decay: float = 0.0,
) -> optax.GradientTransformation:
    """A named optimizer, learning rate included (optax's aliases and their chains).

    Args:
      name: "sgd" (DP-SGD), "momentum" (DP-SGD with heavy-ball momentum v <- rho v + g,
        Panda et al. 2022, https://arxiv.org/abs/2212.06470, Alg. 1), "adam" (DP-Adam),
        "sign" (sign-SGD; a single full-batch Adam step from zero reduces to it, Mehta et al.
        2022, https://arxiv.org/abs/2205.02973, App. E.3), "lamb" (DP-LAMB, Mehta et al.).
      learning_rate: a float, a scalar array (e.g. one run's of a vmapped sweep) or an
        `optax.Schedule`.
      momentum: rho for "momentum".
      b1, b2, eps: Adam/LAMB moments; eps defaults to optax's (1e-8 Adam, 1e-6 LAMB).
      weight_decay: decoupled weight decay for LAMB.
    """
    if name == "sgd":
        return optax.sgd(learning_rate)
    if name == "momentum":
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        return optax.sgd(learning_rate, momentum=momentum)
    if name == "adam":
        return optax.adam(learning_rate, b1=b1, b2=b2, eps=1e-8 if eps is None else eps)
    if name == "sign":
        return optax.chain(optax.scale_by_sign(), optax.scale_by_learning_rate(learning_rate))
    if name == "lamb":
        return optax.lamb(learning_rate, b1=b1, b2=b2, eps=1e-6 if eps is None else eps,
                          weight_decay=weight_decay)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")
