"""Optimizers applied to the privatized gradient: post-processing, so they cost no privacy.

Each factory returns an optax `GradientTransformation` *without* the learning rate; the trainer
applies `params - learning_rate * update`, which is exactly what the optax aliases do
(`scale_by_learning_rate` is the last link of their chains) and lets the learning rate be a
per-config array in a vectorized sweep.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import optax

__all__ = ["OPTIMIZERS", "DEFAULT_LEARNING_RATES", "make_optimizer"]

OPTIMIZERS: tuple[str, ...] = ("sgd", "momentum", "adam", "sign", "lamb")

# Sensible starting points: SGD-type updates are clipped-gradient means (norm <= C), Adam-type
# updates have per-coordinate magnitude ~1 (a single step from zero is sign-SGD).
DEFAULT_LEARNING_RATES = {"sgd": 1.0, "momentum": 1.0, "adam": 1e-3, "sign": 1e-3, "lamb": 1e-3}


def make_optimizer(
    name: str,
    *,
    momentum: float = 0.9,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float | None = None,
    weight_decay: float = 0.0,
) -> optax.GradientTransformation:
    """The update direction of a named optimizer, learning rate excluded.

    Args:
      name: "sgd" (DP-SGD), "momentum" (DP-SGD with heavy-ball momentum v <- rho v + g,
        Panda et al. 2022, https://arxiv.org/abs/2212.06470, Alg. 1), "adam" (DP-Adam),
        "sign" (sign-SGD; a single full-batch Adam step from zero reduces to it, Mehta et al.
        2022, https://arxiv.org/abs/2205.02973, App. E.3), "lamb" (DP-LAMB, Mehta et al.).
      momentum: rho for "momentum".
      b1, b2, eps: Adam/LAMB moments; eps defaults to optax's (1e-8 Adam, 1e-6 LAMB).
      weight_decay: decoupled weight decay for LAMB.
    """
    import optax

    if name == "sgd":
        return optax.identity()
    if name == "momentum":
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        return optax.trace(decay=momentum, nesterov=False)
    if name == "adam":
        return optax.scale_by_adam(b1=b1, b2=b2, eps=1e-8 if eps is None else eps)
    if name == "sign":
        return optax.scale_by_sign()
    if name == "lamb":
        return optax.chain(
            optax.scale_by_adam(b1=b1, b2=b2, eps=1e-6 if eps is None else eps),
            optax.add_decayed_weights(weight_decay),
            optax.scale_by_trust_ratio(),
        )
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")
