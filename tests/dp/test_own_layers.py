"""A user's own Flax NNX model through book-keeping clipping: Flax's own `nnx.Conv` (plain,
strided, grouped, depthwise) has rules (`dp.flax_rules`); a layer no rule knows (a dilated
convolution, a custom layer) is clipped exactly through per-example gradients and named in one
notice. The model-family contract (tests/family_contract.py) runs on it."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dpprobe import dp
from dpprobe.dp.taps import tappable_layers
from tests.contract import NUM_CLASSES
from tests.family_contract import ModelFamilyContract


class Gain(nnx.Module):
    """A layer the clipper does not know: a learned per-channel gain and shift."""

    def __init__(self, channels: int):
        self.log_gain = nnx.Param(0.1 * jnp.arange(channels, dtype=jnp.float32))
        self.shift = nnx.Param(jnp.full((channels,), 0.05))

    def __call__(self, x):
        return x * jnp.exp(self.log_gain[...]) + self.shift[...]


class OwnNet(nnx.Module):
    def __init__(self, classes: int, rngs: nnx.Rngs):
        self.stem = nnx.Conv(3, 8, (3, 3), strides=2, padding="SAME", rngs=rngs)
        self.norm = nnx.GroupNorm(8, num_groups=2, rngs=rngs)
        self.depthwise = nnx.Conv(8, 8, (3, 3), feature_group_count=8, padding=1, rngs=rngs)
        self.grouped = nnx.Conv(8, 16, (2, 3), strides=(1, 2), feature_group_count=2,
                                padding="VALID", rngs=rngs)
        self.dilated = nnx.Conv(16, 16, (3, 3), kernel_dilation=2, rngs=rngs)
        self.bn = nnx.BatchNorm(16, use_running_average=True, rngs=rngs)
        self.gain = Gain(16)
        self.ln = nnx.LayerNorm(16, rngs=rngs)
        self.head = nnx.Linear(16, classes, rngs=rngs)

    def __call__(self, x):
        x = self.norm(nnx.gelu(self.stem(x)))
        x = nnx.gelu(self.grouped(nnx.gelu(self.depthwise(x))))
        x = self.gain(self.bn(self.dilated(x)))
        return self.head(self.ln(x.mean(axis=(-3, -2))))


def own_net(classes: int = NUM_CLASSES) -> OwnNet:
    model = OwnNet(classes, nnx.Rngs(0))
    rng = np.random.default_rng(3)  # statistics and scales away from init's 0 and 1
    model.bn.mean.set_value(jnp.asarray(0.1 * rng.normal(size=16), jnp.float32))
    model.bn.var.set_value(jnp.asarray(0.5 + rng.random(16), jnp.float32))
    model.bn.scale.set_value(jnp.asarray(0.5 + rng.random(16), jnp.float32))
    return model


class TestOwnModel(ModelFamilyContract):
    """The family contract on `OwnNet` (no timm counterpart: the logits test is dropped)."""

    image_size = 12

    @pytest.fixture(scope="class")
    @classmethod
    def family(cls):
        rng = np.random.default_rng(2)
        images = rng.normal(size=(cls.examples, 3, cls.image_size, cls.image_size))
        return None, own_net(), images.astype(np.float32)

    test_logits_match_timm = None  # no timm model to compare with


def test_flax_convolutions_are_tapped_and_the_others_named():
    """Plain, strided, grouped and depthwise `nnx.Conv`s have rules; the dilated one and the
    custom layer do not, and one notice line names exactly them."""
    model = own_net()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    trained = {tuple(path) for path, _ in nnx.to_flat_state(params)}
    assert set(tappable_layers(model, trained)) == {("stem",), ("depthwise",), ("grouped",),
                                                    ("head",)}
    lines = []
    clipper = dp.bookkeeping_clipper(lambda m, e, x, y: jnp.sum(m(x[None])[0] * 0 + y),
                                     graphdef, rest, notices=lines.append)
    clipper(params, (jnp.zeros((2, 12, 12, 3)), jnp.zeros(2)), 1.0, jnp.ones(2))
    assert lines == ["book-keeping clipping has no rule for the layers dilated "
                     "(flax.nnx.nn.linear.Conv), gain (tests.dp.test_own_layers.Gain): their "
                     "parameters' per-example gradients are formed (exact clipping, slower; "
                     "`dp.taps.register_rule` declares a faster rule)"]
