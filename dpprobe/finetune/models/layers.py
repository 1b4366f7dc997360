"""The layers of timm's convolutional families (ResNet, EfficientNet) in Flax NNX, each built
from the timm (torch) layer it reproduces: convolution (grouped and depthwise included, torch's
symmetric padding or TF's "same" padding), BatchNorm with frozen running statistics, the
activations.

BatchNorm is frozen as at inference (timm's `model.eval()`): y = (x - mean) / sqrt(var + eps)
* scale + bias with `mean` and `var` the pretrained running statistics, held as
`nnx.BatchStat` (never trained, never updated: the trainer splits off `nnx.Param` only), and
`scale`, `bias` trained. In training mode BatchNorm would normalize each example by statistics
of its whole batch, so one example's gradient would depend on the others and clipping it would
bound nothing; frozen, each example's logits depend on that example and the parameters only
(the contract of `finetune.models.common`), so its gradient is well defined and per-example
clipping bounds its contribution. The running statistics are public: part of the pretrained
weights, never computed from the private data.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dpprobe.finetune.models._conv import padded_windows, smaller_than_kernel
from dpprobe.finetune.models.common import zero_head

__all__ = ["ACTIVATIONS", "Conv2d", "FrozenBatchNorm", "GroupedConv2d", "activation_name",
           "arrays_into_timm", "batchnorm_from_torch", "conv_from_torch", "conv_pads",
           "conv_patches", "depthwise", "is_identity", "linear_from_torch", "same_padding",
           "timm_builder", "timm_head", "torch_array"]

ACTIVATIONS = {
    "identity": lambda x: x,
    "relu": jax.nn.relu,
    "relu6": jax.nn.relu6,
    "silu": jax.nn.silu,
    "sigmoid": jax.nn.sigmoid,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}
# torch / timm activation classes by name -> ours (timm's Swish and nn.SiLU compute the same).
_TORCH_ACTIVATIONS = {"Identity": "identity", "ReLU": "relu", "ReLU6": "relu6", "SiLU": "silu",
                      "Swish": "silu", "Sigmoid": "sigmoid", "GELU": "gelu"}


def activation_name(module: Any) -> str:
    """Our name of a torch activation module; ValueError for one we do not reproduce."""
    name = type(module).__name__
    # torch's GELU says its approximation; timm's own GELU (ConvNeXt's) is always exact.
    if name not in _TORCH_ACTIVATIONS or getattr(module, "approximate", "none") != "none":
        raise ValueError(f"unsupported activation {module}")
    return _TORCH_ACTIVATIONS[name]


def is_identity(module: Any) -> bool:
    """Whether a timm model's optional layer does nothing: absent (None) or `nn.Identity`."""
    return module is None or type(module).__name__ == "Identity"


def torch_array(tensor: Any) -> jax.Array:
    """A torch tensor's values as a float32 JAX array."""
    return jnp.asarray(tensor.detach().cpu().float().numpy())


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TF's "same" padding of one side (timm's `pad_same`): the total that makes the output
    ceil(size / stride), the extra pixel at the end."""
    total = max((math.ceil(size / stride) - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def conv_pads(padding, shape, kernel: tuple[int, int], stride: int):
    """((top, bottom), (left, right)) of an NHWC input `shape`."""
    if padding == "same":
        return tuple(same_padding(shape[-3 + i], kernel[i], stride) for i in range(2))
    return tuple(padding)


def conv_patches(module: Conv2d, x: jax.Array) -> jax.Array:
    """The im2col patches of `x` (..., H, W, C) under `module`'s kernel and padding:
    (..., OH, OW, kh kw C), features ordered (kh, kw, c) as an HWIO kernel flattens."""
    kernel = module.kernel.shape[:2]
    pads = conv_pads(module.padding, x.shape, kernel, module.stride)
    return jnp.concatenate(padded_windows(x, kernel, module.stride, pads), axis=-1)


class Conv2d(nnx.Module):
    """An NHWC convolution of one group: HWIO `kernel`, optional `bias`, `stride`, `padding`
    ((top, bottom), (left, right)) or "same" (TF's, from the input's size: timm's
    `Conv2dSame`). Book-keeping rule: patches times the kernel (`finetune.models.taps`).
    An output smaller than the kernel is computed as those patches times the kernel (faster
    on XLA:CPU, `finetune.models._conv`)."""

    groups = 1

    def __init__(self, kernel: jax.Array, bias: jax.Array | None, *, stride: int, padding):
        self.kernel = nnx.Param(kernel)
        self.bias = None if bias is None else nnx.Param(bias)
        self.stride = stride
        self.padding = padding

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel[...]
        x, kernel = nnx.nn.dtypes.promote_dtype((x, kernel))
        pads = conv_pads(self.padding, x.shape, kernel.shape[:2], self.stride)
        if self.groups == 1 and smaller_than_kernel(x.shape, kernel.shape[:2], self.stride, pads):
            y = conv_patches(self, x) @ kernel.reshape(-1, kernel.shape[-1])
        else:
            y = jax.lax.conv_general_dilated(
                x, kernel, (self.stride, self.stride), pads,
                dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=self.groups)
        return y if self.bias is None else y + self.bias[...].astype(y.dtype)


class GroupedConv2d(Conv2d):
    """A grouped convolution (`groups` > 1; depthwise when groups = input channels): HWIO
    kernel (kh, kw, c_in / groups, c_out), output channel o in group o // (c_out / groups).
    Book-keeping rule: each group's patches times its block of the kernel.

    A depthwise one (one input channel per group) is computed as kh kw shifted windows of the
    input times the kernel's taps (`depthwise`): XLA's CPU convolution runs a grouped
    convolution slowly (one 3 x 3 layer of Lite0's at 64 px, 64 x 32 x 32 x 96: forward 0.61
    s vs 0.014 s, gradient 2.2 vs 0.33 s, measured in one process), and the shifted sums are
    plain elementwise work XLA fuses. The same function of the input (float32 rounding aside);
    the book-keeping rule reads the layer's input and output gradient, not how it computed."""

    def __init__(self, kernel: jax.Array, bias: jax.Array | None, *, stride: int, padding,
                 groups: int):
        super().__init__(kernel, bias, stride=stride, padding=padding)
        self.groups = groups

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel[...]
        if kernel.shape[2] != 1:  # several input channels per group: XLA's convolution
            return super().__call__(x)
        x, kernel = nnx.nn.dtypes.promote_dtype((x, kernel))
        pads = conv_pads(self.padding, x.shape, kernel.shape[:2], self.stride)
        y = depthwise(x, kernel, self.stride, pads)
        return y if self.bias is None else y + self.bias[...].astype(y.dtype)


def depthwise(x: jax.Array, kernel: jax.Array, stride: int, pads) -> jax.Array:
    """A depthwise convolution of NHWC `x` by HWIO `kernel` (kh, kw, 1, c_out), c_out a
    multiple m of x's channels (output channel o reads input channel o // m, as XLA's grouped
    convolution), padded by `pads` ((top, bottom), (left, right)): the sum over the kernel's
    offsets of the input window at that offset times that tap, in float32 or wider."""
    kh, kw, _, out = kernel.shape
    if out != x.shape[-1]:
        x = jnp.repeat(x, out // x.shape[-1], axis=-1)
    windows = padded_windows(x, (kh, kw), stride, pads)
    y = windows[0] * kernel[0, 0, 0]
    for index, window in enumerate(windows[1:], start=1):
        y = y + window * kernel[index // kw, index % kw, 0]
    return y


def conv_from_torch(conv: Any) -> Conv2d:
    """Our convolution with the weights of a torch `nn.Conv2d` (or timm's `Conv2dSame`);
    ValueError for dilation, non-square strides or padding modes other than zeros."""
    if conv.dilation != (1, 1) or conv.stride[0] != conv.stride[1]:
        raise ValueError(f"unsupported convolution (dilation or unequal strides): {conv}")
    if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        raise ValueError(f"unsupported convolution padding: {conv}")
    same = type(conv).__name__ == "Conv2dSame"  # timm pads it at call time, as TF's "same"
    padding = "same" if same else tuple((p, p) for p in conv.padding)
    kernel = torch_array(conv.weight.permute(2, 3, 1, 0))  # OIHW -> HWIO
    bias = None if conv.bias is None else torch_array(conv.bias)
    if conv.groups == 1:
        return Conv2d(kernel, bias, stride=conv.stride[0], padding=padding)
    return GroupedConv2d(kernel, bias, stride=conv.stride[0], padding=padding,
                         groups=conv.groups)


class FrozenBatchNorm(nnx.Module):
    """BatchNorm at inference, then an activation: `mean` and `var` frozen (`nnx.BatchStat`),
    `scale` and `bias` trained (module docstring). Statistics in at least float32."""

    def __init__(self, scale: jax.Array, bias: jax.Array, mean: jax.Array, var: jax.Array, *,
                 eps: float, activation: str = "identity"):
        self.scale = nnx.Param(scale)
        self.bias = nnx.Param(bias)
        self.mean = nnx.BatchStat(mean)
        self.var = nnx.BatchStat(var)
        self.eps = eps
        self.activation = activation

    def __call__(self, x: jax.Array) -> jax.Array:
        wide = jnp.promote_types(x.dtype, jnp.float32)
        inverse = jax.lax.rsqrt(self.var[...].astype(wide) + self.eps)
        y = (x.astype(wide) - self.mean[...]) * (self.scale[...] * inverse) + self.bias[...]
        return ACTIVATIONS[self.activation](y).astype(x.dtype)


def batchnorm_from_torch(bn: Any, activation: str | None = None) -> FrozenBatchNorm:
    """Our `FrozenBatchNorm` from a torch `BatchNorm2d` or timm's `BatchNormAct2d` (its fused
    activation included); ValueError without affine parameters or running statistics."""
    if not bn.affine or bn.running_mean is None:
        raise ValueError(f"BatchNorm needs affine parameters and running statistics: {bn}")
    if activation is None:
        activation = "identity"
        if hasattr(bn, "act"):  # timm's BatchNormAct2d: norm, drop (eval: identity), act
            if type(bn.drop).__name__ not in ("Identity", "Dropout"):
                raise ValueError(f"unsupported BatchNormAct2d drop layer: {bn.drop}")
            activation = activation_name(bn.act)
    return FrozenBatchNorm(torch_array(bn.weight), torch_array(bn.bias),
                           torch_array(bn.running_mean), torch_array(bn.running_var),
                           eps=float(bn.eps), activation=activation)


def linear_from_torch(linear: Any) -> nnx.Linear:
    """An `nnx.Linear` with a torch `nn.Linear`'s weights (kernel = weight^T)."""
    out_features, in_features = linear.weight.shape
    layer = nnx.eval_shape(lambda: nnx.Linear(in_features, out_features,
                                              use_bias=linear.bias is not None,
                                              rngs=nnx.Rngs(0)))
    layer.kernel.set_value(torch_array(linear.weight.T))
    if linear.bias is not None:
        layer.bias.set_value(torch_array(linear.bias))
    return layer


def timm_head(classifier: Any, features: int, num_classes: int | None, rngs: nnx.Rngs,
          head_bias_init: float) -> nnx.Linear:
    """timm's classifier as an `nnx.Linear` (num_classes None) or a new zero head."""
    if num_classes is None:
        if type(classifier).__name__ != "Linear":
            raise ValueError("num_classes=None keeps timm's head, but this model has none "
                             "(num_classes=0); pass the number of classes")
        return linear_from_torch(classifier)
    return zero_head(features, num_classes, head_bias_init=head_bias_init, rngs=rngs)


def timm_builder(model_class: Any, classifier: str, check: Callable[[Any], None],
                 make_head: Callable = timm_head) -> Callable:
    """The `*_from_timm` function of an NNX class converted from timm with its weights.

    Args:
      model_class: the NNX class, called as `model_class(timm_model, head)`.
      classifier: the dotted path of timm's classifier (`"fc"`, `"classifier"`, `"head.fc"`).
      check: raises ValueError for a timm instance the class does not reproduce.
      make_head: `timm_head` or a function of the same arguments for another classifier
        layer (BiT's 1 x 1 convolution).

    Returns:
      `build(timm_model, num_classes, *, rngs, head_bias_init=0.0)`: our NNX model with the
      weights of `timm_model` (a BatchNorm frozen), meeting the contract of
      `finetune.models.common`; for an NCHW batch `b`, `model(b.transpose(0, 2, 3, 1))`
      equals `timm_model.eval()(b)` up to float rounding. `num_classes` None keeps timm's
      classifier, an int replaces it with a new zero-initialized head of that many classes
      with bias `head_bias_init` (`rngs`: for its construction; its values are constants).
    """
    name = model_class.__name__

    def build(timm_model: Any, num_classes: int | None, *, rngs: nnx.Rngs,
              head_bias_init: float = 0.0):
        check(timm_model)
        fc = functools.reduce(getattr, classifier.split("."), timm_model)
        return model_class(timm_model, make_head(fc, timm_model.num_features, num_classes, rngs,
                                                 head_bias_init))

    build.__name__ = build.__qualname__ = f"{name.lower()}_from_timm"
    build.__module__ = model_class.__module__
    build.__doc__ = (f"Our NNX `{name}` with the weights of a timm `{name}` instance (see "
                     f"`{model_class.__module__}` for which): `layers.timm_builder`.")
    return build


def arrays_into_timm(arrays: dict, timm_model: Any, *, unwritten_ok: Callable = lambda k: False
                     ) -> None:
    """Write `arrays` (timm's state-dict keys -> NumPy arrays) into `timm_model` with
    `load_state_dict(strict=True)`: ValueError (naming up to 3 keys) when a key is missing on
    either side (timm keys for which `unwritten_ok` is true may stay unwritten, e.g.
    BatchNorm's `num_batches_tracked`) or a tensor has another shape."""
    import numpy as np
    import torch

    state = timm_model.state_dict()
    unknown = sorted(set(arrays) - set(state))
    unwritten = sorted(k for k in set(state) - set(arrays) if not unwritten_ok(k))
    if unknown or unwritten:
        raise ValueError(f"the timm model's architecture differs from the NNX model's "
                         f"(ours only: {unknown[:3]}, timm's only: {unwritten[:3]})")
    for key, array in arrays.items():
        if tuple(array.shape) != tuple(state[key].shape):
            raise ValueError(f"shape mismatch copying {key} into timm: {array.shape} into "
                             f"{tuple(state[key].shape)}")
        state[key] = torch.from_numpy(np.array(array))  # a writable copy
    timm_model.load_state_dict(state, strict=True)
