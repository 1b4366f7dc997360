"""The weight map between timm's (torch) `Beit` and ours (`finetune.models.beit`), both ways.

Our modules carry timm's names, so a timm state-dict key is the parameter's module path
joined by dots, with the patch embed's kernel under `patch_embed.proj` and the leaves renamed
(kernel -> weight: HWIO -> OIHW for the patch embed, (in, out) -> (out, in) for a Linear;
a LayerNorm's scale -> weight). `beit_from_timm` reads every parameter of a timm model through
this map (what fine-tuning starts from); `load_beit_into_timm` writes a fine-tuned model back
into a timm model of the same architecture with `load_state_dict(strict=True)` (what
`dpprobe export --format timm` releases). timm's non-persistent buffers (the zero key bias,
the relative position index) are not in its state dict: both are constants here.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dpprobe.finetune.models.beit import Beit, beit_config_from_timm
from dpprobe.finetune.models.common import check_no_batchnorm, unset_params
from dpprobe.finetune.models.layers import arrays_into_timm
from dpprobe.finetune.models.timm_weights import abstract_with_head

__all__ = ["beit_from_timm", "beit_timm_arrays", "load_beit_into_timm"]


def _timm_key(path: tuple) -> str:
    """timm's state-dict key of our parameter at `path`."""
    *modules, leaf = (str(p) for p in path)
    if modules == ["patch_embed"]:
        modules = ["patch_embed", "proj"]
    leaf = {"kernel": "weight", "scale": "weight"}.get(leaf, leaf)
    return ".".join([*modules, leaf])


def _to_timm(path: tuple, array: np.ndarray) -> np.ndarray:
    """Our layout -> timm's: a kernel HWIO -> OIHW (patch embed) or (in, out) -> (out, in)."""
    if str(path[-1]) != "kernel":
        return array
    return array.transpose(3, 2, 0, 1) if array.ndim == 4 else array.T


def _from_timm(path: tuple, array: np.ndarray) -> np.ndarray:
    if str(path[-1]) != "kernel":
        return array
    return array.transpose(2, 3, 1, 0) if array.ndim == 4 else array.T


def beit_timm_arrays(model: Beit) -> dict[str, np.ndarray]:
    """timm's state-dict key -> float32 array in timm's layout, for every parameter of
    `model`."""
    if not isinstance(model, Beit):
        raise ValueError(f"beit_timm_arrays converts a Beit, got {type(model).__name__}")
    return {_timm_key(path): _to_timm(path, np.asarray(value[...], np.float32))
            for path, value in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def load_beit_into_timm(model: Beit, timm_model: Any) -> None:
    """Write `model`'s parameters into `timm_model` (same architecture and classes) with
    `load_state_dict(strict=True)`; ValueError if the architectures differ."""
    if beit_config_from_timm(timm_model) != model.config:
        raise ValueError("the timm model's architecture differs from the NNX model's")
    arrays_into_timm(beit_timm_arrays(model), timm_model)


def beit_from_timm(timm_model: Any, num_classes: int | None, *, rngs: nnx.Rngs,
                   head_bias_init: float = 0.0) -> Beit:
    """Our NNX `Beit` with the weights of a timm (torch) `Beit`.

    The caller builds the timm model (`timm.create_model(name, pretrained=..., img_size=...,
    in_chans=...)`), so timm loads the weights and resizes the position embedding and the
    relative position tables to the image size; this copies the tensors. For an NCHW batch
    `b`, `model(b.transpose(0, 2, 3, 1))` equals `timm_model.eval()(b)` up to float rounding.

    Args:
      timm_model: a timm `Beit` instance (see `beit_config_from_timm` for which).
      num_classes: None keeps timm's head; an int replaces it with a new zero-initialized
        head of that many classes with bias `head_bias_init`.
      rngs: for the head's construction (its values are constants).
      head_bias_init: bias of a new head.

    Returns:
      A `Beit`.

    Raises:
      ValueError: for an architecture `finetune.models.beit` does not reproduce, or a timm
        tensor without a counterpart (or the other way round).
    """
    check_no_batchnorm(timm_model)
    config = beit_config_from_timm(timm_model)
    model, keep_head = abstract_with_head(
        lambda classes: Beit(config, classes, rngs=nnx.Rngs(0)), timm_model, config.embed_dim,
        num_classes, rngs=rngs, head_bias_init=head_bias_init)
    state = {k: v.detach().cpu().float().numpy() for k, v in timm_model.state_dict().items()
             if keep_head or not k.startswith("head.")}
    used = set()
    for path, param in nnx.iter_graph(model):
        if not isinstance(param, nnx.Param) or (not keep_head and path[0] == "head"):
            continue
        key = _timm_key(path)
        if key not in state:
            raise ValueError(f"the timm model has no tensor {key} for our {path}")
        value = _from_timm(path, state[key])
        if value.shape != param.shape:
            raise ValueError(f"shape mismatch copying timm's {key}: {value.shape} into "
                             f"{param.shape}")
        param.set_value(jnp.asarray(value))
        used.add(key)
    if set(state) - used:
        raise ValueError(f"timm tensors without a counterpart: {sorted(set(state) - used)[:3]}")
    unset = unset_params(model)
    if unset:
        raise ValueError(f"timm weights left these parameters unset: {unset}")
    return model
