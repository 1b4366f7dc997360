"""Dirac canary rows in both clippers (`dp.canary_rows`): a canary row's gradient is
value e_c on a coordinate of the model's own parameters, in every representation a layer's
per-example gradients take (ghost A and B, instantiated gradients, a rule's map, offsets),
clipped by the same norm and factor as the real rows and summed with them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dpprobe import dp
from dpprobe.dp.canaries import GradientCanaries, allocate
from dpprobe.dp.canary_rows import coordinates_of, leaf_starts
from dpprobe.finetune.models import TemperedCNN, VisionTransformer, ViTConfig, WideResNet

CLASSES = 5
SMALL_VIT = ViTConfig(image_size=(16, 16), patch_size=(8, 8), in_channels=3, embed_dim=32,
                      depth=1, num_heads=2, head_dim=16, mlp_dim=64, layer_scale=True)
NORM = 1000.0


def _model(name: str):
    rngs = nnx.Rngs(0)
    if name == "cnn":
        return TemperedCNN(CLASSES, image_size=16, in_channels=1, rngs=rngs), (16, 16, 1)
    if name == "wrn":  # weight-standardized convolutions: a rule's own map of A^T B
        return WideResNet(CLASSES, depth=10, width=1, image_size=8, in_channels=1,
                          rngs=rngs), (8, 8, 1)
    return VisionTransformer(SMALL_VIT, CLASSES, rngs=rngs), (16, 16, 3)


def _loss(logits, label):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), jnp.broadcast_to(label, logits.shape[:1])).mean()


def _flat(grads) -> np.ndarray:
    return np.concatenate([np.asarray(g, np.float64).ravel() for g in jax.tree.leaves(grads)])


@pytest.mark.parametrize("name,clipping,ghost", [
    ("cnn", "bookkeeping", None), ("wrn", "bookkeeping", True), ("vit", "bookkeeping", True),
    ("cnn", "per_example", None)])
def test_a_canary_row_adds_c_at_its_coordinate_and_nothing_else(name, clipping, ghost):
    """8 real rows and one canary row on each parameter array (the kernels of ghost,
    instantiated and weight-standardized layers, biases, norms, tokens): the clipped sum is
    the real rows' own plus C e_c for each canary (its gradient NORM e_c scaled by C / NORM),
    the canaries' norms are NORM, and with the canaries masked it is the clipper's without
    canaries."""
    model, shape = _model(name)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    starts = leaf_starts(params)
    rng = np.random.default_rng(0)
    coordinates = np.array([rng.integers(a, b)
                            for a, b in zip(starts[:-1], starts[1:], strict=True)])
    n_real, clip = 8, 0.05
    n = n_real + len(coordinates)
    x = jnp.asarray(rng.normal(size=(n, *shape)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, CLASSES, n))
    rows = jnp.arange(n)
    table = jnp.asarray(coordinates, jnp.int32)

    def canaries(batch):
        canary = batch[2] - n_real
        return (jnp.where(canary >= 0, table[jnp.clip(canary, 0, len(coordinates) - 1)], -1),
                jnp.full(canary.shape, NORM, jnp.float32))

    if clipping == "bookkeeping":
        def loss(model, extra, image, label, row):
            return jnp.where(row >= n_real, 0.0, _loss(model(image[None]), label))

        def make(rows_of):
            return dp.bookkeeping_clipper(loss, graphdef, rest, ghost=ghost, canaries=rows_of)
    else:
        def loss(p, image, label, row):
            return jnp.where(row[0] >= n_real, 0.0,
                             _loss(nnx.merge(graphdef, p, rest)(image), label[0]))

        def make(rows_of):
            return dp.per_example_clipper(loss, canaries=rows_of)

    with_canaries = jax.jit(make(canaries))
    real_only = jnp.asarray((np.arange(n) < n_real).astype(np.float32))
    total = with_canaries(params, (x, y, rows), clip, jnp.ones(n, jnp.float32))
    masked = with_canaries(params, (x, y, rows), clip, real_only)
    expected = _flat(masked.grads)
    expected[coordinates] += clip
    np.testing.assert_allclose(_flat(total.grads), expected, rtol=0, atol=1e-5 * clip)
    if name != "wrn":  # (its compilation is the slowest; the rows' code is the same)
        real = jax.jit(make(None))(params, (x, y, rows), clip, real_only)
        np.testing.assert_allclose(_flat(masked.grads), _flat(real.grads), rtol=0, atol=1e-7)
    np.testing.assert_allclose(np.asarray(total.norms)[n_real:], NORM, rtol=1e-5)
    # The auditor's read of the sum: exactly the entries at the coordinates.
    np.testing.assert_array_equal(np.asarray(coordinates_of(total.grads, table)),
                                  _flat(total.grads).astype(np.float32)[coordinates])


def test_canaries_fill_every_array_before_the_largest():
    """Water-filling: each array gets min(size, L); L = 2542 puts 5000 canaries on every
    coordinate of the small arrays and 2542 of the 8192 (the small CNN's shapes)."""
    sizes = (16, 1024, 32, 8192, 32, 1024, 10, 320)
    np.testing.assert_array_equal(allocate(5000, sizes), [16, 1024, 32, 2542, 32, 1024, 10, 320])
    np.testing.assert_array_equal(allocate(5000, (1024, 16384, 3, 3072)), [1024, 1987, 3, 1986])
    np.testing.assert_array_equal(allocate(7, (4, 4, 4)), [3, 2, 2])
    drawn = GradientCanaries.draw(5000, sizes, np.random.default_rng(1))
    assert len(np.unique(drawn.coordinates)) == 5000
    starts = np.cumsum((0, *sizes))
    assert ((drawn.coordinates >= starts[drawn.arrays])
            & (drawn.coordinates < starts[drawn.arrays + 1])).all()
    assert 2300 < drawn.included.sum() < 2700
    with pytest.raises(ValueError, match="one canary a trained coordinate"):
        allocate(sum(sizes) + 1, sizes)
    with pytest.raises(ValueError, match="drawn for parameter arrays"):
        drawn.check_sizes(sizes[:-1])
