"""What every fine-tuning model shares: the zero-initialized head and the BatchNorm refusal.

The contract of a model `m` here (every constructor in `finetune.models` meets it):
  * `m(x)` maps float NHWC images (N, H, W, C), already normalized, to float32 logits
    (N, num_classes); `m.features(x)` gives the pre-logits (N, d) that the head reads.
  * `m(x)[i]` depends on `x[i]` and the parameters only: no batch statistics, no dropout, no
    random numbers at call time. So a per-example gradient is well defined and
    `vmap(grad(loss))` over examples equals a loop of single-example gradients.
  * Every trainable weight is an `nnx.Param`; the only other state is a frozen BatchNorm's
    running statistics (`nnx.BatchStat`, pretrained constants the trainer never updates,
    `finetune.models.layers.FrozenBatchNorm`).
  * The computation follows the dtype of the parameters and input (bfloat16 in, bfloat16
    matmuls and convolutions); only normalization statistics and softmax run in at least
    float32, and the logits come out in float32.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["BATCHNORM_MESSAGE", "HeadOnFeatures", "check_no_batchnorm", "float32_logits",
           "unset_params",
           "zero_head"]

BATCHNORM_MESSAGE = (
    "BatchNorm mixes examples in a batch, so a per-example gradient (and its sensitivity) is "
    "undefined; use GroupNorm"
)


def zero_head(in_features: int, num_classes: int, *, head_bias_init: float,
              rngs: nnx.Rngs) -> nnx.Linear:
    """The classifier: kernel = 0 and every bias = `head_bias_init`.

    With a zero kernel the logits at initialization are `head_bias_init` for every input and
    class, and the gradient reaching the body is zero, so the first step updates only the head.
    Mehta et al. 2023 (https://arxiv.org/abs/2205.02973, Sec. 5) found a zero (or very small)
    last layer crucial under DP; their appendix uses biases -10 (Scenic's default).
    """
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    return nnx.Linear(in_features, num_classes, kernel_init=nnx.initializers.zeros_init(),
                      bias_init=nnx.initializers.constant(head_bias_init), rngs=rngs)


def float32_logits(logits: jax.Array) -> jax.Array:
    """Logits in float32 whatever the compute dtype (the loss and its softmax need it)."""
    return logits.astype(jnp.promote_types(logits.dtype, jnp.float32))


class HeadOnFeatures(nnx.Module):
    """A model of the contract above whose logits are its `head` on its pre-logits: a
    subclass defines `features(x)` and sets `head` (an `nnx.Linear`)."""

    def __call__(self, x: jax.Array) -> jax.Array:
        """Float32 logits (N, num_classes).

        Args:
          x: normalized NHWC images (N, H, W, C).

        Returns:
          `float32_logits(self.head(self.features(x)))`.
        """
        return float32_logits(self.head(self.features(x)))


def check_no_batchnorm(module: Any) -> None:
    """Raise ValueError naming the first BatchNorm layer in `module`.

    Accepts an `nnx.Module` (looks for `nnx.BatchNorm`) or a `torch.nn.Module` such as a timm
    model (looks for any `torch.nn.modules.batchnorm._BatchNorm`: BatchNorm1d/2d/3d,
    SyncBatchNorm, timm's BatchNormAct2d). BatchNorm normalizes each example by statistics of
    the whole batch, so one example's gradient depends on the others and per-example clipping
    bounds nothing; GroupNorm and LayerNorm normalize within one example.
    """
    if isinstance(module, nnx.Module):
        for path, sub in nnx.iter_modules(module):
            if isinstance(sub, nnx.BatchNorm):
                name = ".".join(str(p) for p in path) or "<root>"
                raise ValueError(f"{BATCHNORM_MESSAGE} (found {type(sub).__name__} at {name})")
        return
    import torch

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"expected an nnx.Module or a torch.nn.Module, got {type(module)}")
    for name, sub in module.named_modules():
        if isinstance(sub, torch.nn.modules.batchnorm._BatchNorm):
            raise ValueError(f"{BATCHNORM_MESSAGE} (found {type(sub).__name__} at "
                             f"{name or '<root>'})")


def unset_params(model: nnx.Module) -> list:
    """The paths of `model`'s parameters still abstract (`nnx.eval_shape`'s placeholders):
    what a weight loader that sets every parameter must leave empty."""
    return [path for path, node in nnx.iter_graph(model)
            if isinstance(node, nnx.Param) and isinstance(node.get_value(), jax.ShapeDtypeStruct)]
