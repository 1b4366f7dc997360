"""finetune.models: golden logits against torch references (timm's ViT; WRN-GN-WS and the tanh
CNNs written here in torch), the zero head, the BatchNorm refusal, per-example gradients with no
cross-example mixing, bfloat16."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

import dpprobe.finetune.models as fm
from dpprobe.finetune.models._conv import conv2d, im2col_convolutions
from tests.torch_models import TorchCifarCNN, TorchTemperedCNN, TorchWRN

# Golden tolerance: float32 reductions in a different order (torch vs XLA).
ATOL = RTOL = 1e-4


def _nhwc(batch: torch.Tensor) -> jax.Array:
    return jnp.asarray(batch.permute(0, 2, 3, 1).numpy())


@nnx.jit
def _forward(model, x):
    """(pre-logits, logits) in one pass (every model's `__call__` is `head(features(x))`)."""
    features = model.features(x)
    return features, model.head(features).astype(jnp.float32)


def _perturb(module: torch.nn.Module, scale: float, seed: int) -> None:
    """Add N(0, scale^2) to every torch parameter (so unit gains, zero biases are tested too)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator))


def _randomize_head(model: nnx.Module, seed: int, scale: float = 0.3) -> None:
    """A non-zero head, so that the body gets a gradient and the logits depend on it."""
    key = jax.random.key(seed)
    model.head.kernel[...] = scale * jax.random.normal(key, model.head.kernel.shape)


# ----------------------------------------------------------------------------------------------
# A state-dict converter for the torch references (tests/torch_models.py), named like ours.


_TORCH_NAMES = {"kernel": "weight", "scale": "weight", "bias": "bias", "gain": "gain"}


def load_torch_state_dict(model: nnx.Module, state_dict: dict, chw_linear: dict) -> None:
    """Copy a torch state dict whose names mirror our module paths into `model`.

    Conv weights OIHW -> HWIO, Linear (out, in) -> (in, out). `chw_linear` maps a linear layer
    that reads a flattened (C, H, W) map to that map's (C, H, W): its input features are
    reordered to our NHWC flattening.
    """
    copied = set()
    for path, param in nnx.iter_graph(model):
        if not isinstance(param, nnx.Param):
            continue
        module = ".".join(str(p) for p in path[:-1])
        name = f"{module}.{_TORCH_NAMES[path[-1]]}"
        value = state_dict[name].detach()
        if value.ndim == 4:
            value = value.permute(2, 3, 1, 0)
        elif value.ndim == 2:
            if module in chw_linear:
                value = value.reshape(-1, *chw_linear[module]).permute(0, 2, 3, 1).flatten(1)
            value = value.T
        param[...] = jnp.asarray(value.numpy())
        copied.add(name)
    assert copied == set(state_dict), set(state_dict) ^ copied


# ----------------------------------------------------------------------------------------------
# Golden outputs.


@pytest.mark.parametrize("k,stride,pad,side", [(3, 2, 1, 7), (3, 1, 1, 6), (1, 2, 0, 7)])
@pytest.mark.parametrize("form", ["lax", "im2col"])
def test_conv2d_equals_lax_convolution(k, stride, pad, side, form):
    """Both forms of `conv2d` (XLA's convolution; im2col inside `im2col_convolutions()`, as
    the per-example clipper traces it) give lax's values and vmapped per-example gradients."""
    x = jax.random.normal(jax.random.key(0), (2, side, side, 3))
    kernel = jax.random.normal(jax.random.key(1), (k, k, 3, 5))

    def reference(x, kernel):
        return jax.lax.conv_general_dilated(x, kernel, (stride, stride), ((pad, pad),) * 2,
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def per_example_grads(conv):
        def loss(kernel, xi):
            return jnp.sum(jnp.sin(conv(xi[None], kernel)))
        return jax.vmap(jax.grad(loss), in_axes=(None, 0))(kernel, x)

    ours = functools.partial(conv2d, stride=stride, padding=pad)
    context = im2col_convolutions() if form == "im2col" else contextlib.nullcontext()
    with context:
        got, got_grads = conv2d(x, kernel, stride, pad), per_example_grads(ours)
        traced = str(jax.make_jaxpr(ours)(x, kernel))
    assert ("conv_general_dilated" in traced) == (form == "lax")
    np.testing.assert_allclose(got, reference(x, kernel), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_grads, per_example_grads(reference), rtol=1e-5, atol=1e-5)
    assert got_grads.shape == (2, *kernel.shape)


def _timm_vit(name=None, seed=0, **kwargs):
    """A random-init timm ViT with every parameter perturbed (head too), in eval mode."""
    import timm
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(seed)
    if name is None:
        model = VisionTransformer(**kwargs)
    else:
        model = timm.create_model(name, pretrained=False, **kwargs)
    _perturb(model, 0.05, seed)
    return model.eval()


_SMALL_VIT = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3, num_classes=5)
VIT_CASES = {
    "vit_tiny": ("vit_tiny_patch16_224", dict(img_size=32)),
    "deit_tiny": ("deit_tiny_patch16_224", dict(img_size=32, in_chans=1)),
    # avg pooling with fc_norm, no class token, layer scale, no qkv bias, 2 channels, and timm's
    # dynamic image size (used at the built size)
    "avg_layerscale": (None, _SMALL_VIT | dict(global_pool="avg", class_token=False,
                                               init_values=0.5, qkv_bias=False, in_chans=2,
                                               dynamic_img_size=True)),
    # DeiT-3 / CLIP style: class token outside the position embedding, pre-norm, no final norm
    "no_embed_class_prenorm": (None, _SMALL_VIT | dict(no_embed_class=True, pre_norm=True,
                                                       final_norm=False, mlp_ratio=2.0)),
}


@pytest.mark.parametrize("case", VIT_CASES)
def test_vit_from_timm_matches_timm_logits_and_features(case):
    name, kwargs = VIT_CASES[case]
    timm_model = _timm_vit(name, **kwargs)
    channels = timm_model.patch_embed.proj.in_channels
    batch = torch.randn(2, channels, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        features = timm_model.forward_head(timm_model.forward_features(batch), pre_logits=True)
        logits = timm_model(batch)
    model = fm.vit_from_timm(timm_model, None, rngs=nnx.Rngs(0))
    ours_features, ours_logits = _forward(model, _nhwc(batch))
    np.testing.assert_allclose(ours_features, features.numpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(ours_logits, logits.numpy(), rtol=RTOL, atol=ATOL)
    assert np.abs(logits.numpy()).max() > 0.1  # the comparison is not between near-zeros


def test_vit_from_timm_with_num_classes_keeps_the_body_and_zeroes_the_head():
    timm_model = _timm_vit(**_SMALL_VIT)
    batch = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        features = timm_model.forward_head(timm_model.forward_features(batch), pre_logits=True)
    model = fm.vit_from_timm(timm_model, 7, rngs=nnx.Rngs(0), head_bias_init=-2.0)
    ours_features, ours_logits = _forward(model, _nhwc(batch))
    np.testing.assert_allclose(ours_features, features.numpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(ours_logits, np.full((2, 7), -2.0, np.float32))


@pytest.mark.parametrize("kwargs,match", [
    (dict(reg_tokens=2), "register tokens"),
    (dict(global_pool="map"), "global_pool"),
    (dict(qk_norm=True), "qk-norm"),
    (dict(init_values=None, act_layer="gelu_tanh"), "exact GELU"),
    (dict(pool_include_prefix=True, global_pool="avg"), "pool_include_prefix"),
    (dict(dynamic_img_size=True, dynamic_img_pad=True), "patch embed"),
])
def test_vit_from_timm_refuses_what_it_does_not_reproduce(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fm.vit_from_timm(_timm_vit(**_SMALL_VIT | kwargs), None, rngs=nnx.Rngs(0))


def test_vit_from_timm_refuses_distilled_deit():
    import timm

    distilled = timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False,
                                  img_size=32)
    with pytest.raises(ValueError, match="VisionTransformerDistilled"):
        fm.vit_from_timm(distilled, 10, rngs=nnx.Rngs(0))


def test_wrn16_4_matches_torch_reference():
    side, channels = 28, 1  # Fashion-MNIST
    torch.manual_seed(0)
    reference = TorchWRN(10, depth=16, width=4, in_channels=channels)
    _perturb(reference, 0.1, seed=1)
    model = fm.create_model("wrn16_4", 10, image_size=side, in_channels=channels,
                            rngs=nnx.Rngs(0))
    load_torch_state_dict(model, reference.state_dict(), chw_linear={})
    batch = torch.randn(2, channels, side, side)
    with torch.no_grad():
        features, logits = reference.features(batch), reference(batch)
    ours_features, ours_logits = _forward(model, _nhwc(batch))
    np.testing.assert_allclose(ours_features, features.numpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(ours_logits, logits.numpy(), rtol=RTOL, atol=ATOL)
    assert np.abs(logits.numpy()).max() > 0.1


@pytest.mark.parametrize("name,reference_cls,side,channels,flat_side", [
    ("cnn", TorchTemperedCNN, 28, 1, 4),
    ("cnn_cifar", TorchCifarCNN, 32, 3, 4),
])
def test_cnn_matches_torch_reference(name, reference_cls, side, channels, flat_side):
    torch.manual_seed(0)
    reference = reference_cls(10, channels, flat_side)
    _perturb(reference, 0.1, seed=1)
    model = fm.create_model(name, 10, image_size=side, in_channels=channels, rngs=nnx.Rngs(0))
    width = reference.fc1.in_features // flat_side**2
    load_torch_state_dict(model, reference.state_dict(),
                          chw_linear={"fc1": (width, flat_side, flat_side)})
    batch = torch.randn(2, channels, side, side)
    with torch.no_grad():
        features, logits = reference.features(batch), reference(batch)
    ours_features, ours_logits = _forward(model, _nhwc(batch))
    np.testing.assert_allclose(ours_features, features.numpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(ours_logits, logits.numpy(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("side,stride", [(13, 1), (12, 1), (32, 2), (9, 2)])
def test_max_pool_equals_torch_values_and_gradient(side, stride):
    """The CNNs' 2 x 2 max pool (four shifted slices) gives torch's max_pool2d values and, with
    no ties (random normal input), its gradient: 1 at each window's argmax, summed over windows."""
    from dpprobe.finetune.models.cnn import _max_pool

    x = np.random.default_rng(side).standard_normal((2, side, side, 3)).astype(np.float32)
    weights = np.random.default_rng(1).standard_normal(
        _max_pool(jnp.asarray(x), stride).shape).astype(np.float32)
    grad = jax.grad(lambda v: jnp.sum(_max_pool(v, stride) * weights))(jnp.asarray(x))
    tx = torch.from_numpy(x).permute(0, 3, 1, 2).requires_grad_(True)
    pooled = torch.nn.functional.max_pool2d(tx, 2, stride)
    (pooled * torch.from_numpy(weights).permute(0, 3, 1, 2)).sum().backward()
    np.testing.assert_array_equal(  # a maximum selects one input: equal, bit for bit
        _max_pool(jnp.asarray(x), stride), pooled.detach().permute(0, 2, 3, 1).numpy())
    np.testing.assert_allclose(grad, tx.grad.permute(0, 2, 3, 1).numpy(), rtol=1e-6, atol=1e-6)


def test_weight_standardization_closed_form():
    kernel = 3.0 + 2.0 * jax.random.normal(jax.random.key(0), (3, 3, 4, 6))
    gain = jnp.arange(1.0, 7.0)
    w = fm.standardize_weight(kernel, gain)
    fan_in = 3 * 3 * 4
    # Each output filter: mean 0, squared norm gain^2 (variance gain^2 / fan_in).
    np.testing.assert_allclose(w.mean(axis=(0, 1, 2)), 0.0, atol=1e-5)
    np.testing.assert_allclose((w**2).sum(axis=(0, 1, 2)), gain**2, rtol=1e-5)
    np.testing.assert_allclose(w.var(axis=(0, 1, 2)) * fan_in, gain**2, rtol=1e-5)
    # A constant filter has variance 0: the floor keeps it finite (and zero after centering).
    flat = fm.standardize_weight(jnp.ones((3, 3, 4, 2)), jnp.ones(2))
    np.testing.assert_array_equal(flat, 0.0)


# ----------------------------------------------------------------------------------------------
# The model contract, for every model.

# Small instances of the architectures, on kernel shapes of the models above (so that their
# random init is not compiled again). `cnn_cifar` is left out to keep the file fast: it is built
# from `cnn`'s layer types (Conv, tanh, max-pool, Linear), and its golden test covers its forward.
_TINY_VIT = dict(img_size=16, patch_size=8, embed_dim=24, depth=1, num_heads=2, num_classes=4)
SMALL_MODELS = {
    "cnn": lambda rngs: fm.create_model("cnn", 4, image_size=16, in_channels=1, rngs=rngs),
    "wrn": lambda rngs: fm.WideResNet(4, depth=10, width=4, image_size=8, in_channels=1,
                                      rngs=rngs),
    "vit": lambda rngs: fm.vit_from_timm(_timm_vit(**_TINY_VIT), 4, rngs=rngs),
    "scatter": lambda rngs: fm.create_model("scatternet_cnn_linear", 4, image_size=16,
                                            in_channels=2, rngs=rngs),  # scatternet_cnn + head
    "convnext": lambda rngs: fm.model_from_timm(_timm_convnext(), 4, rngs=rngs),
}
_SIDE = {"cnn": 16, "wrn": 8, "vit": 16, "scatter": 16, "convnext": 32}
_CHANNELS = {"cnn": 1, "wrn": 1, "vit": 3, "scatter": 2, "convnext": 3}


def _timm_convnext():
    """A ConvNeXt of one block per stage, 8 channels wide, its layer scales near 1, its
    depthwise kernels 3 x 3: the same shifted-window code as timm's 7 x 7, whose 49 windows
    per layer made this fixture's compilation 3x slower (24.5 vs 7.1 s here)."""
    from timm.models.convnext import ConvNeXt

    torch.manual_seed(0)
    model = ConvNeXt(num_classes=4, depths=(1, 1, 1, 1), dims=(8, 8, 8, 8), ls_init_value=1.0,
                     kernel_sizes=3)
    return model.eval()


def _batch(kind, n, seed=0):
    return jax.random.normal(jax.random.key(seed), (n, _SIDE[kind], _SIDE[kind], _CHANNELS[kind]))


# The golden tests' shapes, so that the forward is not compiled again.
@pytest.mark.parametrize("name,num_classes,side,channels", [
    ("cnn", 10, 28, 1), ("cnn_cifar", 10, 32, 3), ("wrn16_4", 10, 28, 1),
    ("vit_tiny_patch16_224", 1000, 32, 3)])
def test_create_model_head_is_zero_with_the_given_bias(name, num_classes, side, channels):
    model = fm.create_model(name, num_classes, image_size=side, in_channels=channels,
                            rngs=nnx.Rngs(0), head_bias_init=-3.5)
    x = 5.0 * jax.random.normal(jax.random.key(1), (2, side, side, channels))
    features, logits = _forward(model, x)
    np.testing.assert_array_equal(logits, np.full((2, num_classes), -3.5, np.float32))
    np.testing.assert_array_equal(model.head.kernel[...], 0.0)
    assert np.abs(np.asarray(features)).max() > 0  # the body is not zero


def test_create_model_names_and_errors():
    assert set(fm.MODEL_NAMES) >= {"cnn", "wrn16_4"}
    with pytest.raises(ValueError, match=r"unknown model 'nope'.*'cnn'.*'wrn16_4'"):
        fm.create_model("nope", 10, image_size=32, in_channels=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="deep-stem ResNets .* are not supported"):
        fm.create_model("resnet10t", 10, image_size=32, in_channels=3, rngs=nnx.Rngs(0))


def test_create_model_vit_is_reproducible_from_rngs():
    def make(seed):
        model = fm.create_model("test_vit", 3, image_size=32, in_channels=3, rngs=nnx.Rngs(seed))
        return np.asarray(model.pos_embed[...])

    np.testing.assert_array_equal(make(0), make(0))
    assert not np.allclose(make(0), make(1))


def test_check_no_batchnorm_refuses_nnx_and_timm_batchnorm():
    class WithBatchNorm(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(3, 4, (3, 3), rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)

    with pytest.raises(ValueError, match=r"BatchNorm mixes examples.*use GroupNorm.*at bn"):
        fm.check_no_batchnorm(WithBatchNorm(nnx.Rngs(0)))
    import timm

    resnet = timm.create_model("resnet10t", pretrained=False)
    with pytest.raises(ValueError, match=r"BatchNorm mixes examples.*BatchNorm2d at conv1\.1"):
        fm.check_no_batchnorm(resnet)
    with pytest.raises(ValueError, match="BatchNorm mixes examples"):
        fm.vit_from_timm(resnet, 10, rngs=nnx.Rngs(0))
    fm.check_no_batchnorm(torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.GroupNorm(2, 4)))
    fm.check_no_batchnorm(nnx.GroupNorm(4, num_groups=2, rngs=nnx.Rngs(0)))


@pytest.fixture(scope="module", params=list(SMALL_MODELS))
def contract(request):
    """One small model (non-zero head) and, from one compiled program: vmapped per-example
    gradients, a sequential loop (`lax.map`) of single-example gradients, the logits of a batch
    and of the same batch with its other examples changed (two batches through one vmapped
    forward), and the logits in bfloat16."""
    kind = request.param
    model = SMALL_MODELS[kind](nnx.Rngs(0))
    _randomize_head(model, seed=3)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def logits_of(params, x):
        return nnx.merge(graphdef, params, rest)(x)

    def loss(params, x, y):  # the trainer's pure loss of one example (a batch of one)
        return optax.softmax_cross_entropy_with_integer_labels(logits_of(params, x), y).sum()

    @jax.jit
    def outputs(params, x, other, y):
        bf16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
        return {
            "vmapped": jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(
                params, x[:, None], y[:, None]),
            "looped": jax.lax.map(lambda xy: jax.grad(loss)(params, xy[0][None], xy[1][None]),
                                  (x, y)),
            "batches": jax.vmap(logits_of, in_axes=(None, 0))(params, jnp.stack([x, other])),
            "bf16": logits_of(bf16, x.astype(jnp.bfloat16)),
        }

    x = _batch(kind, 3)
    other = x.at[1:].set(_batch(kind, 3, seed=9)[1:])
    out = outputs(params, x, other, jnp.array([0, 3, 1]))
    return rest, jax.tree.map(np.asarray, out)


def test_every_weight_is_a_param_and_examples_do_not_mix(contract):
    rest, out = contract
    assert jax.tree.leaves(rest) == []  # nothing but Params: no batch stats, no RNG state
    # Changing the other examples of the batch leaves example 0's logits unchanged.
    batched, other = out["batches"]
    np.testing.assert_allclose(other[0], batched[0], rtol=1e-5, atol=1e-6)
    assert not np.allclose(other[1:], batched[1:])


def test_vmapped_per_example_grads_equal_single_example_grads(contract):
    _, out = contract
    vmapped, looped = jax.tree.leaves(out["vmapped"]), jax.tree.leaves(out["looped"])
    assert len(vmapped) == len(looped) > 0
    for a, b in zip(vmapped, looped, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # The examples' gradients differ, and the body's (all but the head) is not zero.
    norms = np.sqrt(sum((g.reshape(3, -1) ** 2).sum(axis=1) for g in vmapped))
    assert len(set(np.round(norms, 4))) == 3
    body = jax.tree.leaves({k: v for k, v in out["vmapped"].items() if k != "head"})
    assert max(np.abs(g).max() for g in body) > 0


def test_bfloat16_forward_is_close_to_float32(contract):
    _, out = contract
    reference = out["batches"][0]
    assert out["bf16"].dtype == np.float32
    scale = np.abs(reference).max()
    assert scale > 0.01
    np.testing.assert_allclose(out["bf16"], reference, atol=0.05 * scale)
    assert not np.array_equal(out["bf16"], reference)  # it did compute in bfloat16
