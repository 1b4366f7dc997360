"""timm's VisionTransformer in Flax NNX, and the converter from a timm (torch) instance.

The forward is timm 1.0.31's `VisionTransformer.forward` in eval mode (Dosovitskiy et al. 2021,
https://arxiv.org/abs/2010.11929), on NHWC input:

    patches (p x p, stride p) -> linear embed -> [class token] + absolute position embedding
    -> [norm_pre] -> depth x Block -> [norm] -> pool ('token': class token; 'avg': mean of
    patch tokens) -> [fc_norm] -> head

with the pre-norm Block  x += ls1 * Attn(LN(x));  x += ls2 * Mlp(LN(x)),  Attn the fused-qkv
multi-head self-attention (qkv features laid out as (3, heads, head_dim), scores scaled by
head_dim^-1/2), Mlp = fc2(GELU(fc1(x))) with the exact (erf) GELU of torch's `nn.GELU()`, and
LayerNorm eps taken from the timm model (1e-6 for timm's ViTs). With `no_embed_class` (DeiT-3)
the position embedding covers the patch tokens only and the class token is prepended after.
Dropout, attention dropout and drop path are not reproduced: the model is a deterministic
function of (params, x), as per-example clipping needs.

Supported: timm's plain `VisionTransformer` (vit_*, deit_* except the distilled ones, deit3_*)
with or without class token, 'token' or 'avg' pooling, layer scale, pre-norm, qkv/proj bias on
or off. Refused with a ValueError: register tokens, attention/latent pooling, qk-norm, scaled
norms, gated attention, other blocks (parallel, ResPost), SwiGLU/GLU MLPs, RMSNorm, norm or
padding in the patch embed, distilled DeiT (two tokens) and any BatchNorm. A timm model built
with `dynamic_img_size` converts to a model for its built image size (the only input size any
converted model accepts).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dpprobe.finetune.models.common import float32_logits, zero_head

__all__ = ["TransformerShape", "ViTConfig", "VisionTransformer", "vit_config_from_timm"]

_POOLS = ("token", "avg")


@dataclasses.dataclass(frozen=True)
class TransformerShape:
    """What every timm vision transformer this package converts has (ViT, BEiT): the patch
    grid, the widths, the biases of the qkv, projection and patch layers."""

    image_size: tuple[int, int]
    patch_size: tuple[int, int]
    in_channels: int
    embed_dim: int
    depth: int
    num_heads: int
    head_dim: int
    mlp_dim: int
    qkv_bias: bool = True
    proj_bias: bool = True
    patch_bias: bool = True

    @property
    def grid_size(self) -> tuple[int, int]:
        """Patches along (height, width)."""
        return (self.image_size[0] // self.patch_size[0], self.image_size[1] // self.patch_size[1])


@dataclasses.dataclass(frozen=True)
class ViTConfig(TransformerShape):
    """The architecture of a VisionTransformer (the fields timm's constructor takes).

    `final_norm` is the LayerNorm on all tokens after the blocks, `fc_norm` the one on the
    pooled vector (timm puts the final norm there for 'avg' pooling). `layer_scale` adds a
    per-channel gain (init `layer_scale_init`) on each residual branch (Touvron et al. 2021).
    """

    class_token: bool = True
    no_embed_class: bool = False
    pre_norm: bool = False
    final_norm: bool = True
    fc_norm: bool = False
    global_pool: str = "token"
    layer_scale: bool = False
    layer_scale_init: float = 1e-5
    norm_eps: float = 1e-6

    @property
    def num_prefix_tokens(self) -> int:
        """1 with a class token, else 0."""
        return int(self.class_token)


def _layer_norm(dim: int, eps: float, rngs: nnx.Rngs) -> nnx.LayerNorm:
    """LayerNorm whose statistics are two-pass float32 (as torch computes them)."""
    return nnx.LayerNorm(dim, epsilon=eps, use_fast_variance=False, rngs=rngs)


def _dense(din: int, dout: int, use_bias: bool, rngs: nnx.Rngs) -> nnx.Linear:
    """Linear with timm's ViT init: truncated normal std 0.02, zero bias."""
    return nnx.Linear(din, dout, use_bias=use_bias, rngs=rngs,
                      kernel_init=nnx.initializers.truncated_normal(0.02))


class PatchEmbed(nnx.Module):
    """Non-overlapping p x p patches, linearly embedded: (N, H, W, C) -> (N, L, D)."""

    def __init__(self, config: ViTConfig, *, rngs: nnx.Rngs):
        ph, pw = config.patch_size
        shape = (ph, pw, config.in_channels, config.embed_dim)
        self.image_size = config.image_size
        self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), shape))
        self.bias = nnx.Param(jnp.zeros((config.embed_dim,))) if config.patch_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        n, h, w, c = x.shape
        if (h, w) != self.image_size:
            raise ValueError(f"input images must be {self.image_size}, got {(h, w)}")
        ph, pw = self.kernel.shape[:2]
        gh, gw = h // ph, w // pw  # a remainder is dropped, as by timm's stride-p convolution
        patches = x[:, :gh * ph, :gw * pw].reshape(n, gh, ph, gw, pw, c)
        tokens = jnp.einsum("nypxqc,pqcd->nyxd", patches, self.kernel[...])
        if self.bias is not None:
            tokens = tokens + self.bias[...]
        return tokens.reshape(n, -1, tokens.shape[-1])


class Attention(nnx.Module):
    """Multi-head self-attention with fused qkv; softmax in (at least) float32."""

    def __init__(self, config: ViTConfig, *, rngs: nnx.Rngs):
        inner = config.num_heads * config.head_dim
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.qkv = _dense(config.embed_dim, 3 * inner, config.qkv_bias, rngs)
        self.proj = _dense(inner, config.embed_dim, config.proj_bias, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return attend(self.qkv(x), self.num_heads, self.proj)


def attend(qkv: jax.Array, num_heads: int, proj: nnx.Linear,
           bias: jax.Array | None = None) -> jax.Array:
    """Self-attention from fused (N, L, 3 H d) q, k, v: softmax(q k^T / sqrt(d) [+ bias]) v
    with the softmax in (at least) float32, heads merged, through `proj` (ViT and BEiT).

    Args:
      qkv: the qkv layer's output (its biases added).
      num_heads: H.
      proj: the output projection.
      bias: added to the (N, H, L, L) scores (BEiT's relative position bias), or None.

    Returns:
      (N, L, D).
    """
    n, length, width = qkv.shape
    qkv = qkv.reshape(n, length, 3, num_heads, width // (3 * num_heads))
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scores = jnp.einsum("nqhd,nkhd->nhqk", q * q.shape[-1]**-0.5, k)
    if bias is not None:
        scores = scores + bias.astype(scores.dtype)
    probs = jax.nn.softmax(scores.astype(jnp.promote_types(scores.dtype, jnp.float32)))
    out = jnp.einsum("nhqk,nkhd->nqhd", probs.astype(v.dtype), v)
    return proj(out.reshape(n, length, -1))


def layer_scales(config: TransformerShape, enabled: bool, init: float) -> tuple:
    """A block's two layer scales (per-channel gains on its residual branches), or Nones."""
    gamma = jnp.full((config.embed_dim,), init)
    return (nnx.Param(gamma), nnx.Param(gamma)) if enabled else (None, None)


def pre_norm_layers(block: nnx.Module, config: TransformerShape, attention: nnx.Module,
                    rngs: nnx.Rngs) -> None:
    """A pre-norm block's layers, by timm's names: norm1, attn (`attention`), norm2, mlp."""
    block.norm1 = _layer_norm(config.embed_dim, config.norm_eps, rngs)
    block.attn = attention
    block.norm2 = _layer_norm(config.embed_dim, config.norm_eps, rngs)
    block.mlp = Mlp(config, rngs=rngs)


def residual_block(x: jax.Array, block: nnx.Module, attn, scales: tuple) -> jax.Array:
    """x + s1 attn(norm1(x)), then + s2 mlp(norm2(.)) (s: a layer scale, or 1 for None):
    the pre-norm block of the ViT and the BEiT; `attn` is the block's attention, called."""
    first, second = scales
    branch = attn(block.norm1(x))
    x = x + (branch if first is None else branch * first[...])
    branch = block.mlp(block.norm2(x))
    return x + (branch if second is None else branch * second[...])


class Mlp(nnx.Module):
    """fc2(GELU(fc1(x))), the exact erf GELU."""

    def __init__(self, config: ViTConfig, *, rngs: nnx.Rngs):
        self.fc1 = _dense(config.embed_dim, config.mlp_dim, config.proj_bias, rngs)
        self.fc2 = _dense(config.mlp_dim, config.embed_dim, config.proj_bias, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=False))


class Block(nnx.Module):
    """Pre-norm transformer block, optional layer scale on both residual branches."""

    def __init__(self, config: ViTConfig, *, rngs: nnx.Rngs):
        pre_norm_layers(self, config, Attention(config, rngs=rngs), rngs)
        self.ls1, self.ls2 = layer_scales(config, config.layer_scale, config.layer_scale_init)

    def __call__(self, x: jax.Array) -> jax.Array:
        return residual_block(x, self, self.attn, (self.ls1, self.ls2))


class VisionTransformer(nnx.Module):
    """A ViT classifier with a zero-initialized head (see `finetune.models.common`).

    The constructor's init is timm's (truncated normal 0.02 for linear layers and the position
    embedding, N(0, 1e-6) class token); `vit_from_timm` overwrites every weight but the head.
    """

    def __init__(self, config: ViTConfig, num_classes: int, *, rngs: nnx.Rngs,
                 head_bias_init: float = 0.0):
        if config.global_pool not in _POOLS:
            raise ValueError(f"global_pool must be one of {_POOLS}, got {config.global_pool!r}")
        if config.global_pool == "token" and not config.class_token:
            raise ValueError("global_pool='token' needs the class token")
        dim = config.embed_dim
        num_patches = config.grid_size[0] * config.grid_size[1]
        pos_len = num_patches + (0 if config.no_embed_class else config.num_prefix_tokens)
        self.config = config
        self.patch_embed = PatchEmbed(config, rngs=rngs)
        self.cls_token = (nnx.Param(1e-6 * jax.random.normal(rngs.params(), (1, 1, dim)))
                          if config.class_token else None)
        self.pos_embed = nnx.Param(
            nnx.initializers.truncated_normal(0.02)(rngs.params(), (1, pos_len, dim)))
        self.norm_pre = _layer_norm(dim, config.norm_eps, rngs) if config.pre_norm else None
        self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(config.depth)])
        self.norm = _layer_norm(dim, config.norm_eps, rngs) if config.final_norm else None
        self.fc_norm = _layer_norm(dim, config.norm_eps, rngs) if config.fc_norm else None
        self.head = zero_head(dim, num_classes, head_bias_init=head_bias_init, rngs=rngs)

    def _tokens(self, x: jax.Array) -> jax.Array:
        """Patch tokens with the class token and position embedding: (N, L', D)."""
        x = self.patch_embed(x)
        pos = self.pos_embed[...]
        if self.cls_token is None:
            return x + pos
        cls = jnp.broadcast_to(self.cls_token[...], (x.shape[0], 1, x.shape[-1]))
        if self.config.no_embed_class:
            return jnp.concatenate([cls, x + pos], axis=1)
        return jnp.concatenate([cls, x], axis=1) + pos

    def features(self, x: jax.Array) -> jax.Array:
        """Pre-logits (timm's `forward_head(..., pre_logits=True)`): (N, H, W, C) -> (N, D)."""
        x = self._tokens(x)
        if self.norm_pre is not None:
            x = self.norm_pre(x)
        for block in self.blocks:
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.config.global_pool == "token":
            x = x[:, 0]
        else:
            x = x[:, self.config.num_prefix_tokens:].mean(axis=1)
        return x if self.fc_norm is None else self.fc_norm(x)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Float32 logits (N, num_classes)."""
        return float32_logits(self.head(self.features(x)))


def check_timm_mlp(mlp: Any, refuse) -> None:
    """`refuse(reason)` (a ValueError) unless `mlp` is timm's plain Mlp with exact GELU: the
    MLP `Mlp` reproduces (ViT and BEiT)."""
    import torch.nn as tnn
    from timm.layers import Mlp as TimmMlp

    if type(mlp) is not TimmMlp or not isinstance(mlp.norm, tnn.Identity):
        raise refuse(f"the MLP must be timm's plain Mlp, got {type(mlp).__name__}")
    if type(mlp.act) is not tnn.GELU or mlp.act.approximate != "none":
        raise refuse(f"the MLP activation must be exact GELU, got {mlp.act}")


def layer_norm_eps(norms, refuse) -> set:
    """The eps of `norms` (timm modules; Identity skipped), refused unless each is an affine
    LayerNorm with a bias (what `_layer_norm` reproduces)."""
    import torch.nn as tnn

    eps = set()
    for norm in norms:
        if isinstance(norm, tnn.Identity):
            continue
        if not isinstance(norm, tnn.LayerNorm) or not norm.elementwise_affine or norm.bias is None:
            raise refuse(f"norms must be affine LayerNorm with bias, got {norm}")
        eps.add(norm.eps)
    return eps


def vit_config_from_timm(timm_model: Any) -> ViTConfig:
    """The `ViTConfig` of a timm `VisionTransformer`; ValueError for what this module lacks."""
    import torch.nn as tnn
    from timm.layers import Attention as TimmAttention
    from timm.layers import LayerScale
    from timm.layers import PatchEmbed as TimmPatchEmbed
    from timm.models.vision_transformer import Block as TimmBlock
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    def refuse(what: str) -> ValueError:
        return ValueError(f"vit_from_timm supports timm's plain VisionTransformer; {what}")

    m = timm_model
    if type(m) is not TimmViT:
        raise refuse(f"got {type(m).__name__} (distilled DeiT and other subclasses are refused)")
    if m.num_reg_tokens:
        raise refuse(f"register tokens are not supported (got {m.num_reg_tokens})")
    if m.global_pool not in _POOLS or m.attn_pool is not None:
        raise refuse(f"global_pool must be one of {_POOLS}, got {m.global_pool!r}")
    if m.pool_include_prefix:
        raise refuse("pool_include_prefix is not supported")
    if m.pos_embed is None:
        raise refuse("a learned position embedding is required")

    pe = m.patch_embed
    conv = getattr(pe, "proj", None)
    # With dynamic_img_size timm flattens the NHWC patches after the patch embed and resamples
    # the position embedding to the input's grid: the identity at the built size, the only
    # size our model accepts.
    if (type(pe) is not TimmPatchEmbed or not isinstance(pe.norm, tnn.Identity)
            or (not pe.flatten and not m.dynamic_img_size) or pe.dynamic_img_pad
            or not isinstance(conv, tnn.Conv2d)
            or conv.stride != conv.kernel_size or conv.padding != (0, 0)
            or conv.dilation != (1, 1) or conv.groups != 1):
        raise refuse("the patch embed must be a plain p x p, stride p convolution (no norm)")

    norms = [m.norm_pre, m.norm, m.fc_norm]
    for block in m.blocks:
        if type(block) is not TimmBlock:
            raise refuse(f"blocks must be timm's Block, got {type(block).__name__}")
        attn, mlp = block.attn, block.mlp
        if type(attn) is not TimmAttention:
            raise refuse(f"attention must be timm's Attention, got {type(attn).__name__}")
        if not all(isinstance(a, tnn.Identity) for a in (attn.q_norm, attn.k_norm, attn.norm)):
            raise refuse("qk-norm and scaled attention norms are not supported")
        if getattr(attn, "gate", None) is not None:
            raise refuse("gated attention is not supported")
        check_timm_mlp(mlp, refuse)
        for ls in (block.ls1, block.ls2):
            if not isinstance(ls, tnn.Identity | LayerScale):
                raise refuse(f"layer scale must be timm's LayerScale, got {type(ls).__name__}")
        norms += [block.norm1, block.norm2]
    eps = layer_norm_eps(norms, refuse)
    if len(eps) != 1:
        raise refuse(f"all LayerNorms must share one eps, got {sorted(eps)}")

    first = m.blocks[0]
    qkv_bias = {b.attn.qkv.bias is not None for b in m.blocks}
    proj_bias = {layer.bias is not None for b in m.blocks
                 for layer in (b.attn.proj, b.mlp.fc1, b.mlp.fc2)}
    if len(qkv_bias) != 1 or len(proj_bias) != 1:
        raise refuse("qkv biases, and projection/MLP biases, must be on or off in every block")
    layer_scale = {isinstance(ls, LayerScale) for b in m.blocks for ls in (b.ls1, b.ls2)}
    if len(layer_scale) != 1:
        raise refuse("layer scale must be on or off in every block")
    return ViTConfig(
        image_size=tuple(pe.img_size),
        patch_size=tuple(pe.patch_size),
        in_channels=conv.in_channels,
        embed_dim=m.embed_dim,
        depth=len(m.blocks),
        num_heads=first.attn.num_heads,
        head_dim=first.attn.head_dim,
        mlp_dim=first.mlp.fc1.out_features,
        qkv_bias=qkv_bias.pop(),
        proj_bias=proj_bias.pop(),
        patch_bias=conv.bias is not None,
        class_token=m.cls_token is not None,
        no_embed_class=bool(m.no_embed_class),
        pre_norm=not isinstance(m.norm_pre, tnn.Identity),
        final_norm=not isinstance(m.norm, tnn.Identity),
        fc_norm=not isinstance(m.fc_norm, tnn.Identity),
        global_pool=m.global_pool,
        layer_scale=layer_scale.pop(),
        norm_eps=float(eps.pop()),
    )
