"""Which parameters a finetuning run trains (`FinetuneSpec.train`), as Flax NNX filters.

  * "all": every `nnx.Param` (full finetuning);
  * "head": the classifier only, the model's `head` (an `nnx.Linear`): DP linear probing of
    the model's own features, trained end to end;
  * "bias": every bias and normalization offset (params named `bias`: Linear, Conv, WSConv,
    PatchEmbed, LayerNorm, GroupNorm; BEiT's `q_bias` and `v_bias`) and the head: DP-BiTFiT
    (Bu et al. 2022, "Differentially Private Bias-Term only Fine-tuning of Foundation Models",
    https://arxiv.org/abs/2210.00036);
  * "lora": low-rank adapters W + A B (A (d_in, r), B (r, d_out), B = 0 at the start: the
    model starts as it was) on a ViT's (or BEiT's) attention and MLP dense layers (qkv, proj,
    fc1, fc2) through Flax's `nnx.LoRA` (its `LoRAParam`s), and the head (Hu et al. 2021, "LoRA",
    https://arxiv.org/abs/2106.09685; under DP: Yu et al. 2021,
    https://arxiv.org/abs/2110.06500).

The head is trained in every mode: it is new and zero-initialized (`finetune.models.zero_head`),
so with its kernel frozen at zero the logits would not depend on the input and no gradient
would reach a bias or an adapter.

The trainer splits the model with `nnx.split(model, trained_filter(mode), ...)`: the trained
parameters are the only ones sampled examples' gradients are taken of, clipped, summed and
noised (the noise has their dimension), and the optimizer's and the EMA's state; every other
parameter is a constant of the run, bitwise unchanged. None of this changes epsilon: whichever
parameters are trained, each example's gradient with respect to them is clipped to C.

Book-keeping clipping (`dp.bookkeeping`) taps each `nnx.LoRA` as one layer (`dp.taps` rule
below): y = x A B + x W, so from its input rows x and output gradient rows b = dloss/dy, one
example's adapter gradients are dloss/dA = x^T (b B^T) and dloss/dB = (x A)^T b, formed per
example at their own small size (d_in x r, r x d_out): never x^T b (d_in x d_out), nor
per-example copies of the adapters.

A LoRA model is released merged (`merge_lora`: each adapted layer becomes the plain
`nnx.Linear` with kernel W + A B), so its model file, predictions and exports are those of the
architecture it adapted.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dpprobe.dp.taps import Rule, register_rule

__all__ = ["LORA_LAYERS", "TRAIN_MODES", "add_lora", "count_params", "merge_lora",
           "trained_filter"]

TRAIN_MODES: tuple[str, ...] = ("all", "head", "bias", "lora")
# The dense layers of a ViT block that `add_lora` adapts: (submodule, layer).
LORA_LAYERS: tuple[tuple[str, str], ...] = (("attn", "qkv"), ("attn", "proj"), ("mlp", "fc1"),
                                            ("mlp", "fc2"))


def _in_head(path: tuple, _value) -> bool:
    return bool(path) and path[0] == "head"


def _bias(path: tuple, _value) -> bool:
    # `bias`, and BEiT's attention biases `q_bias` / `v_bias`
    return bool(path) and str(path[-1]) in ("bias", "q_bias", "v_bias")


def trained_filter(mode: str):
    """The `nnx` filter of the parameters `mode` trains (module docstring)."""
    if mode == "all":
        return nnx.Param
    if mode == "head":
        return nnx.All(nnx.Param, _in_head)
    if mode == "bias":
        return nnx.All(nnx.Param, nnx.Any(_in_head, _bias))
    if mode == "lora":
        return nnx.Any(nnx.LoRAParam, nnx.All(nnx.Param, _in_head))
    raise ValueError(f"train must be one of {TRAIN_MODES}, got {mode!r}")


def count_params(tree: Any) -> int:
    """The number of scalar parameters in a pytree of arrays (or an `nnx.State`)."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def add_lora(model: nnx.Module, rank: int, *, rngs: nnx.Rngs) -> nnx.Module:
    """`model` with each ViT (or BEiT) block's qkv, proj, fc1 and fc2 wrapped in
    `nnx.LoRA(d_in, rank, d_out, base_module=layer)` (A he-uniform from `rngs`, B = 0: the
    same function as before); modified in place and returned. Raises ValueError (one line)
    for a model without ViT or BEiT blocks: LoRA here adapts pretrained attention and MLP
    layers, which the CNNs trained from scratch lack."""
    from dpprobe.finetune.models import Beit, VisionTransformer

    if not isinstance(model, VisionTransformer | Beit):
        raise ValueError(f"`train='lora'` adapts a ViT's attention and MLP layers; "
                         f"{type(model).__name__} has none: train all, head or bias")
    if not (isinstance(rank, int) and rank >= 1):
        raise ValueError(f"lora_rank must be an integer >= 1, got {rank!r}")
    for block in model.blocks:
        for parent_name, name in LORA_LAYERS:
            parent = getattr(block, parent_name)
            layer = getattr(parent, name)
            if isinstance(layer, nnx.LoRA):
                raise ValueError("the model already holds LoRA adapters")
            setattr(parent, name, nnx.LoRA(layer.in_features, rank, layer.out_features,
                                           base_module=layer, rngs=rngs))
    return model


def merge_lora(model: nnx.Module) -> nnx.Module:
    """A copy of `model` with every `nnx.LoRA` wrapper replaced by its base `nnx.Linear`, kernel
    W + A B (float32, full-precision matmul); `model` itself is unchanged. A model without
    adapters comes back as it is (the same object)."""
    if not any(isinstance(m, nnx.LoRA) for _, m in nnx.iter_modules(model)):
        return model
    model = nnx.clone(model)
    for path, module in list(nnx.iter_modules(model)):
        if not isinstance(module, nnx.LoRA):
            continue
        base = module.base_module
        product = jnp.matmul(module.lora_a[...], module.lora_b[...],
                             precision=jax.lax.Precision.HIGHEST)
        base.kernel[...] = base.kernel[...] + product.astype(base.kernel.dtype)
        parent = model
        for key in path[:-1]:
            parent = parent[key] if isinstance(key, int) else getattr(parent, key)
        setattr(parent, path[-1], base)
    return model


def _lora_row_grads(module: nnx.LoRA, x: jax.Array, b: jax.Array) -> dict[str, jax.Array]:
    """Every example's adapter gradients from its input rows x (n, T, d_in) and output
    gradient rows b (n, T, d_out)."""
    down = module.lora_a[...].astype(x.dtype)
    up = module.lora_b[...].astype(x.dtype)
    highest = jax.lax.Precision.HIGHEST
    hidden = jnp.einsum("ntd,dr->ntr", x, down, precision=highest)
    back = jnp.einsum("ntp,rp->ntr", b, up, precision=highest)
    return {"lora_a": jnp.einsum("ntd,ntr->ndr", x, back, precision=highest),
            "lora_b": jnp.einsum("ntr,ntp->nrp", hidden, b, precision=highest)}


register_rule(nnx.LoRA, Rule(inputs=lambda module, x: x, params=("lora_a", "lora_b"),
                             row_grads=_lora_row_grads))
