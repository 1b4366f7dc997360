"""The layers of timm's convolutional families (`finetune.models.layers`) in a small model:
a grouped convolution with several channels per group (ResNeXt's), a depthwise one with TF
"same" padding and a frozen BatchNorm; book-keeping clipping equals per-example clipping of
`jax.vmap(jax.grad)`'s gradients, and each layer equals its torch counterpart."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

from dpprobe import dp
from dpprobe.finetune.models.layers import (
    Conv2d,
    FrozenBatchNorm,
    GroupedConv2d,
    batchnorm_from_torch,
    conv_from_torch,
    is_identity,
)


def _torch_conv(cin, cout, k, stride, groups, same=False, seed=0):
    torch.manual_seed(seed)
    if same:
        from timm.layers import Conv2dSame

        return Conv2dSame(cin, cout, k, stride=stride, groups=groups, bias=True)
    return torch.nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, groups=groups)


@pytest.mark.parametrize("cin,cout,k,stride,groups,same", [
    (4, 6, 3, 1, 2, False), (4, 6, 3, 2, 2, True), (6, 6, 5, 2, 6, True), (6, 12, 3, 1, 6, False),
    (3, 5, 1, 1, 1, False)])
def test_convolution_and_batchnorm_match_torch(cin, cout, k, stride, groups, same):
    conv = _torch_conv(cin, cout, k, stride, groups, same)
    bn = torch.nn.BatchNorm2d(cout).eval()
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(0.5, 2)
        bn.bias.uniform_(-1, 1)
    x = torch.randn(2, cin, 11, 11)
    with torch.no_grad():
        expected = bn(conv(x)).numpy().transpose(0, 2, 3, 1)
    ours = batchnorm_from_torch(bn)(conv_from_torch(conv)(jnp.asarray(
        x.numpy().transpose(0, 2, 3, 1))))
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=1e-5, atol=1e-5)


def _assert_equal_outputs_and_gradients(ours, xla, x, kernel, rng):
    """`ours(x, kernel)` equals `xla(x, kernel)`, and so do both gradients (`jax.vjp` of a
    random output gradient)."""
    ours, ours_vjp = jax.vjp(ours, x, kernel)
    theirs, theirs_vjp = jax.vjp(xla, x, kernel)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    g = jnp.asarray(rng.normal(size=theirs.shape), jnp.float32)
    for a, b in zip(ours_vjp(g), theirs_vjp(g), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("side,k,stride,same,small", [
    (1, 3, 1, False, True), (2, 3, 1, False, True), (2, 3, 2, False, True),
    (2, 3, 2, True, True), (4, 5, 1, True, True), (4, 3, 2, False, True), (5, 3, 2, True, False),
    (3, 3, 1, False, False), (8, 3, 2, False, False)])
def test_an_output_smaller_than_the_kernel_is_computed_as_torch_does(side, k, stride, same,
                                                                      small):
    """Outputs smaller than the kernel (1 x 1 and 2 x 2 under 3 x 3, 4 x 4 under 5 x 5) take
    patches @ kernel (`_conv.smaller_than_kernel`), larger ones XLA's convolution: both give
    torch's output, and `_conv.conv2d` gives `jax.lax.conv_general_dilated`'s output and
    gradients."""
    from dpprobe.finetune.models._conv import conv2d, smaller_than_kernel

    pad = k // 2
    assert smaller_than_kernel((2, side, side, 8), (k, k), stride, [(pad, pad)] * 2) == small
    conv = _torch_conv(8, 16, k, stride, 1, same)
    x = torch.randn(3, 8, side, side)
    with torch.no_grad():
        expected = conv(x).numpy().transpose(0, 2, 3, 1)
    ours = conv_from_torch(conv)(jnp.asarray(x.numpy().transpose(0, 2, 3, 1)))
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=1e-5, atol=1e-5)

    rng = np.random.default_rng(side)
    x = jnp.asarray(rng.normal(size=(3, side, side, 8)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(k, k, 8, 16)), jnp.float32)

    def xla(x, kernel):
        return jax.lax.conv_general_dilated(x, kernel, (stride, stride), [(pad, pad)] * 2,
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                            precision=jax.lax.Precision.HIGHEST)

    _assert_equal_outputs_and_gradients(lambda a, b: conv2d(a, b, stride, pad), xla, x, kernel,
                                        rng)


@pytest.mark.parametrize("channels,multiplier,k,stride,pads", [
    (5, 1, 3, 1, ((1, 1), (1, 1))), (5, 1, 5, 2, ((1, 2), (1, 2))), (4, 2, 3, 2, ((0, 1), (0, 1))),
    (3, 1, 7, 1, ((3, 3), (3, 3)))])
def test_depthwise_by_shifted_windows_equals_xla_grouped_convolution(channels, multiplier, k,
                                                                     stride, pads):
    """`layers.depthwise` (the depthwise layers' forward) against XLA's grouped convolution:
    the outputs and both gradients (input and kernel) through `jax.vjp`."""
    from dpprobe.finetune.models.layers import depthwise

    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(2, 9, 10, channels)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(k, k, 1, channels * multiplier)), jnp.float32)

    def xla(x, kernel):
        return jax.lax.conv_general_dilated(x, kernel, (stride, stride), pads,
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                            feature_group_count=channels,
                                            precision=jax.lax.Precision.HIGHEST)

    _assert_equal_outputs_and_gradients(lambda a, b: depthwise(a, b, stride, pads), xla, x,
                                        kernel, rng)


class _Small(nnx.Module):
    def __init__(self):
        convs = [_torch_conv(3, 4, 3, 1, 1, seed=1), _torch_conv(4, 6, 3, 2, 2, seed=2),
                 _torch_conv(6, 6, 3, 2, 6, same=True, seed=3)]
        self.conv1, self.conv2, self.conv3 = (conv_from_torch(c) for c in convs)
        rng = np.random.default_rng(0)
        self.bn = FrozenBatchNorm(*(jnp.asarray(rng.uniform(0.5, 2, 6), jnp.float32)
                                    for _ in range(4)), eps=1e-3, activation="relu6")
        self.head = nnx.Linear(6, 3, rngs=nnx.Rngs(0))

    def __call__(self, x):
        x = jax.nn.relu(self.conv2(jax.nn.relu(self.conv1(x))))
        return self.head(self.bn(self.conv3(x)).mean(axis=(-3, -2)))


def test_grouped_and_depthwise_clipping_equals_per_example_clipping():
    model = _Small()
    assert type(model.conv1) is Conv2d and type(model.conv2) is GroupedConv2d
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(logits, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y[None])[0]

    clipper = dp.x64_jit(dp.bookkeeping_clipper(lambda m, e, x, y: loss(m(x[None]), y),
                                                graphdef, rest, ghost=False))
    rng = np.random.default_rng(1)
    n = 6
    x = jnp.asarray(rng.normal(size=(n, 9, 9, 3)).astype(np.float32))
    y = jnp.asarray(np.arange(n) % 3)
    grads = jax.vmap(jax.grad(lambda p, xi, yi: loss(nnx.merge(graphdef, p, rest)(xi[None]),
                                                     yi)), in_axes=(None, 0, 0))(params, x, y)
    rows = np.concatenate([np.asarray(g, np.float64).reshape(n, -1)
                           for g in jax.tree.leaves(grads)], axis=1)
    norms = np.linalg.norm(rows, axis=1)
    clip = float(np.median(norms))
    expected = (np.minimum(1.0, clip / norms)[:, None] * rows).sum(0)
    result = clipper(params, (x, y), jnp.float32(clip), jnp.ones(n, jnp.float32))
    ours = np.concatenate([np.asarray(g, np.float64).ravel()
                           for g in jax.tree.leaves(result.grads)])
    np.testing.assert_allclose(np.asarray(result.norms), norms, rtol=1e-5)
    assert np.linalg.norm(ours - expected) <= 1e-5 * np.linalg.norm(expected)
    # The running statistics are not trained: they are not in the clipped sum's parameters.
    assert not any("mean" in str(path) or "var" in str(path)
                   for path, _ in nnx.to_flat_state(params))


def test_is_identity_is_an_absent_or_identity_layer_only():
    assert is_identity(None) and is_identity(torch.nn.Identity())
    for layer in (torch.nn.Dropout(0.0), torch.nn.ReLU(), torch.nn.Conv2d(1, 1, 1)):
        assert not is_identity(layer)
