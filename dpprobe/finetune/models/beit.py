"""timm's BEiT (`timm.models.beit.Beit`) in Flax NNX, and its configuration from a timm model.

The forward is timm 1.0.31's `Beit.forward` in eval mode (Bao et al. 2022,
https://arxiv.org/abs/2106.08254), on NHWC input:

    patches (p x p, stride p) -> linear embed -> [class token] -> [+ absolute position
    embedding] -> depth x Block -> [norm] -> pool ('avg': mean of the patch tokens; 'token':
    the class token) -> [fc_norm] -> head

with the pre-norm Block  x += gamma_1 * Attn(LN(x));  x += gamma_2 * Mlp(LN(x)) (gamma the layer
scale, when `init_values` is set), Attn multi-head self-attention whose fused qkv projection
has no bias of its own but the bias (q_bias, 0, v_bias) (no key bias), and whose scores
(scaled by head_dim^-1/2) get a relative position bias: a learned table of
(2 Gh - 1)(2 Gw - 1) + 3 rows (every offset between two patches of the G = Gh x Gw grid, and
the class token's three cases), one column per head, gathered into an (L + 1) x (L + 1)
matrix by a fixed index (timm's `gen_relative_position_index`, rebuilt here from the grid:
a constant, not a parameter). The table is per block (`use_rel_pos_bias`, the BEiT models of
timm's registry) or one shared by all blocks (`use_shared_rel_pos_bias`, `rel_pos_bias`
here). Mlp is fc2(GELU(fc1(x))), LayerNorm eps taken from the timm model.

Clipping: the layers with a kernel (patch embed, qkv, proj, fc1, fc2, head) are the ViT's
(`dp.taps` rules); every other parameter (q_bias, v_bias, the relative position tables,
gamma_1/gamma_2, norms, class token, position embedding) gets its exact per-example gradient
from a per-example offset in the same backward pass (`dp.bookkeeping`): a table row's
gradient is the sum of the score gradients at the positions the index maps to it, which the
offset's gradient through the gather is. Dropout and drop path are not reproduced.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dpprobe.finetune.models.common import float32_logits, zero_head
from dpprobe.finetune.models.vit import (
    PatchEmbed,
    TransformerShape,
    _dense,
    _layer_norm,
    attend,
    check_timm_mlp,
    layer_norm_eps,
    layer_scales,
    pre_norm_layers,
    residual_block,
)

__all__ = ["Beit", "BeitConfig", "beit_config_from_timm", "relative_position_index"]

_POOLS = ("avg", "token")


@dataclasses.dataclass(frozen=True)
class BeitConfig(TransformerShape):
    """The architecture of a BEiT (the fields timm's `Beit` constructor takes; the shape, and
    the patch embed's and MLP's biases, BEiT's always, as the ViT's: `TransformerShape`).

    `rel_pos_bias`: a relative position table in every block; `shared_rel_pos_bias`: one
    table for all blocks; `fc_norm`: the LayerNorm on the pooled vector instead of on all
    tokens (timm's `use_fc_norm`, its default for 'avg' pooling); `layer_scale`: gamma_1 and
    gamma_2 (timm's `init_values`).
    """

    abs_pos_embed: bool = False
    rel_pos_bias: bool = True
    shared_rel_pos_bias: bool = False
    fc_norm: bool = True
    global_pool: str = "avg"
    layer_scale: bool = True
    layer_scale_init: float = 0.1
    norm_eps: float = 1e-6

    @property
    def num_relative_distance(self) -> int:
        """Rows of a relative position table."""
        gh, gw = self.grid_size
        return (2 * gh - 1) * (2 * gw - 1) + 3


def relative_position_index(grid: tuple[int, int]) -> np.ndarray:
    """timm's `gen_relative_position_index(grid)`: for each (query, key) pair of the L + 1
    tokens (class token first), the row of the relative position table, (L + 1, L + 1)."""
    gh, gw = grid
    distance = (2 * gh - 1) * (2 * gw - 1) + 3
    coords = np.stack(np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")).reshape(2, -1)
    rel = (coords[:, :, None] - coords[:, None, :]).transpose(1, 2, 0)
    rel[:, :, 0] += gh - 1
    rel[:, :, 1] += gw - 1
    rel[:, :, 0] *= 2 * gw - 1
    index = np.zeros((gh * gw + 1,) * 2, np.int32)
    index[1:, 1:] = rel.sum(-1)
    index[0, :] = distance - 3
    index[:, 0] = distance - 2
    index[0, 0] = distance - 1
    return index


def _relative_bias(table: jax.Array, grid: tuple[int, int]) -> jax.Array:
    """The table gathered into (heads, L + 1, L + 1)."""
    index = relative_position_index(grid)
    return table[index.reshape(-1)].reshape(*index.shape, -1).transpose(2, 0, 1)


class RelativePositionBias(nnx.Module):
    """The relative position table shared by all blocks (`use_shared_rel_pos_bias`)."""

    def __init__(self, config: BeitConfig):
        self.grid = config.grid_size
        self.relative_position_bias_table = nnx.Param(
            jnp.zeros((config.num_relative_distance, config.num_heads)))

    def __call__(self) -> jax.Array:
        return _relative_bias(self.relative_position_bias_table[...], self.grid)


class Attention(nnx.Module):
    """BEiT attention: qkv without its own bias plus (q_bias, 0, v_bias), relative position
    bias added to the scaled scores, softmax in (at least) float32."""

    def __init__(self, config: BeitConfig, *, rngs: nnx.Rngs):
        inner = config.num_heads * config.head_dim
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.grid = config.grid_size
        self.qkv = _dense(config.embed_dim, 3 * inner, False, rngs)
        self.q_bias = nnx.Param(jnp.zeros((inner,))) if config.qkv_bias else None
        self.v_bias = nnx.Param(jnp.zeros((inner,))) if config.qkv_bias else None
        self.relative_position_bias_table = (
            nnx.Param(jnp.zeros((config.num_relative_distance, config.num_heads)))
            if config.rel_pos_bias else None)
        self.proj = _dense(inner, config.embed_dim, True, rngs)

    def __call__(self, x: jax.Array, shared_bias: jax.Array | None) -> jax.Array:
        qkv = self.qkv(x)
        if self.q_bias is not None:
            q_bias = self.q_bias[...]
            qkv = qkv + jnp.concatenate([q_bias, jnp.zeros_like(q_bias), self.v_bias[...]])
        bias = shared_bias
        if self.relative_position_bias_table is not None:
            table = _relative_bias(self.relative_position_bias_table[...], self.grid)
            bias = table if bias is None else table + bias
        return attend(qkv, self.num_heads, self.proj, bias)


class Block(nnx.Module):
    """Pre-norm BEiT block, layer scale gamma_1 / gamma_2 on the residual branches."""

    def __init__(self, config: BeitConfig, *, rngs: nnx.Rngs):
        pre_norm_layers(self, config, Attention(config, rngs=rngs), rngs)
        self.gamma_1, self.gamma_2 = layer_scales(config, config.layer_scale,
                                                  config.layer_scale_init)

    def __call__(self, x: jax.Array, shared_bias: jax.Array | None) -> jax.Array:
        return residual_block(x, self, lambda y: self.attn(y, shared_bias),
                              (self.gamma_1, self.gamma_2))


class Beit(nnx.Module):
    """A BEiT classifier with a zero-initialized head (see `finetune.models.common`).

    The constructor's values are placeholders (`beit_from_timm` overwrites every weight but a
    new head); module and parameter names are timm's, so the weight map is a renaming
    (`finetune.models.beit_weights`).
    """

    def __init__(self, config: BeitConfig, num_classes: int, *, rngs: nnx.Rngs,
                 head_bias_init: float = 0.0):
        if config.global_pool not in _POOLS:
            raise ValueError(f"global_pool must be one of {_POOLS}, got {config.global_pool!r}")
        dim = config.embed_dim
        num_patches = config.grid_size[0] * config.grid_size[1]
        self.config = config
        self.patch_embed = PatchEmbed(config, rngs=rngs)
        self.cls_token = nnx.Param(
            nnx.initializers.truncated_normal(0.02)(rngs.params(), (1, 1, dim)))
        self.pos_embed = (nnx.Param(nnx.initializers.truncated_normal(0.02)(
            rngs.params(), (1, num_patches + 1, dim))) if config.abs_pos_embed else None)
        self.rel_pos_bias = RelativePositionBias(config) if config.shared_rel_pos_bias else None
        self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(config.depth)])
        self.norm = None if config.fc_norm else _layer_norm(dim, config.norm_eps, rngs)
        self.fc_norm = _layer_norm(dim, config.norm_eps, rngs) if config.fc_norm else None
        self.head = zero_head(dim, num_classes, head_bias_init=head_bias_init, rngs=rngs)

    def features(self, x: jax.Array) -> jax.Array:
        """Pre-logits (timm's `forward_head(..., pre_logits=True)`): (N, H, W, C) -> (N, D)."""
        x = self.patch_embed(x)
        cls = jnp.broadcast_to(self.cls_token[...], (x.shape[0], 1, x.shape[-1]))
        x = jnp.concatenate([cls.astype(x.dtype), x], axis=1)
        if self.pos_embed is not None:
            x = x + self.pos_embed[...]
        shared = None if self.rel_pos_bias is None else self.rel_pos_bias()
        for block in self.blocks:
            x = block(x, shared)
        if self.norm is not None:
            x = self.norm(x)
        x = x[:, 1:].mean(axis=1) if self.config.global_pool == "avg" else x[:, 0]
        return x if self.fc_norm is None else self.fc_norm(x)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Float32 logits (N, num_classes)."""
        return float32_logits(self.head(self.features(x)))


def beit_config_from_timm(timm_model: Any) -> BeitConfig:
    """The `BeitConfig` of a timm `Beit`; ValueError for what this module lacks (SwiGLU or
    normed MLPs, a head dim other than dim / heads is supported; separate qkv bias adds, no
    pooling, a patch embed with norm are refused)."""
    import torch.nn as tnn
    from timm.layers import PatchEmbed as TimmPatchEmbed
    from timm.models.beit import Attention as TimmAttention
    from timm.models.beit import Beit as TimmBeit
    from timm.models.beit import Block as TimmBlock

    def refuse(what: str) -> ValueError:
        return ValueError(f"beit_from_timm supports timm's Beit; {what}")

    m = timm_model
    if type(m) is not TimmBeit:
        raise refuse(f"got {type(m).__name__}")
    if m.global_pool not in _POOLS:
        raise refuse(f"global_pool must be one of {_POOLS}, got {m.global_pool!r}")
    pe, conv = m.patch_embed, getattr(m.patch_embed, "proj", None)
    if (type(pe) is not TimmPatchEmbed or not isinstance(pe.norm, tnn.Identity) or not pe.flatten
            or pe.dynamic_img_pad or not isinstance(conv, tnn.Conv2d) or conv.bias is None
            or conv.stride != conv.kernel_size or conv.padding != (0, 0)
            or conv.dilation != (1, 1) or conv.groups != 1):
        raise refuse("the patch embed must be a plain p x p, stride p convolution (no norm)")
    norms = [m.norm, m.fc_norm]
    for block in m.blocks:
        attn, mlp = block.attn, block.mlp
        if type(block) is not TimmBlock or type(attn) is not TimmAttention:
            raise refuse(f"blocks must be timm's BEiT Block, got {type(block).__name__}")
        if attn.qkv_bias_separate or attn.qkv.bias is not None or attn.proj.bias is None:
            raise refuse("the qkv projection must take (q_bias, 0, v_bias) as its bias")
        check_timm_mlp(mlp, refuse)
        if mlp.fc1.bias is None or mlp.fc2.bias is None:
            raise refuse("the MLP must have biases")
        norms += [block.norm1, block.norm2]
    eps = layer_norm_eps(norms, refuse)
    per_block = {(b.attn.q_bias is not None, b.attn.relative_position_bias_table is not None,
                  b.gamma_1 is not None, b.attn.num_heads, b.attn.qkv.out_features,
                  b.mlp.fc1.out_features) for b in m.blocks}
    if len(per_block) != 1 or len(eps) != 1:
        raise refuse("every block must have the same shape, biases, tables and layer scale, "
                     "and every LayerNorm one eps")
    qkv_bias, rel_pos_bias, layer_scale, heads, qkv_out, mlp_dim = per_block.pop()
    if (isinstance(m.fc_norm, tnn.Identity)) == (isinstance(m.norm, tnn.Identity)):
        raise refuse("exactly one of norm and fc_norm must be a LayerNorm")
    init = m.blocks[0].init_values
    return BeitConfig(
        image_size=tuple(pe.img_size),
        patch_size=tuple(pe.patch_size),
        in_channels=conv.in_channels,
        embed_dim=m.embed_dim,
        depth=len(m.blocks),
        num_heads=heads,
        head_dim=qkv_out // (3 * heads),
        mlp_dim=mlp_dim,
        qkv_bias=qkv_bias,
        abs_pos_embed=m.pos_embed is not None,
        rel_pos_bias=rel_pos_bias,
        shared_rel_pos_bias=m.rel_pos_bias is not None,
        fc_norm=not isinstance(m.fc_norm, tnn.Identity),
        global_pool=m.global_pool,
        layer_scale=layer_scale,
        layer_scale_init=float(init) if layer_scale else 0.1,
        norm_eps=float(eps.pop()),
    )
