"""Book-keeping clipping (`dp.bookkeeping_clipper`) against per-example gradients
(`dp.per_example_clipper`, `jax_privacy.clipped_grad`) on this project's models, and its bound
on adversarial rows. The probe-shaped contract runs in tests/test_contract.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dpprobe import dp
from dpprobe.finetune.models import TemperedCNN, VisionTransformer, ViTConfig, WideResNet
from dpprobe.finetune.models.scatter import ScatterCNN

CLASSES = 5
SMALL_VIT = ViTConfig(image_size=(16, 16), patch_size=(8, 8), in_channels=3, embed_dim=32,
                      depth=2, num_heads=2, head_dim=16, mlp_dim=64, layer_scale=True)


def _model(name: str):
    rngs = nnx.Rngs(0)
    if name == "cnn":
        return TemperedCNN(CLASSES, image_size=16, in_channels=1, rngs=rngs), (16, 1)
    if name == "wrn":
        return WideResNet(CLASSES, depth=10, width=1, image_size=8, in_channels=1,
                          rngs=rngs), (8, 1)
    if name.startswith("scatter"):  # its ScatterNet overflows on the hostile rows: null records
        return ScatterCNN(CLASSES, image_size=16, in_channels=2, rngs=rngs,
                          linear=name == "scatter_linear"), (16, 2)
    return VisionTransformer(SMALL_VIT, CLASSES, rngs=rngs), (16, 3)


def _loss(logits, label):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), jnp.broadcast_to(label, logits.shape[:1])).mean()


def _clippers(name: str, ghost, dtype=None):
    """(params away from init, the book-keeping clipper, the per-example clipper, image shape)."""
    model, (side, channels) = _model(name)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    keys = iter(jax.random.split(jax.random.key(1), 100))
    params = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(next(keys), p.shape), params)

    def per_example(p, x, y):
        return _loss(nnx.merge(graphdef, p, rest)(x[0]), y[0])

    def bookkeeping(model, extra, x, y):
        return _loss(model(x.astype(dtype or x.dtype)), y)

    ours = jax.jit(dp.bookkeeping_clipper(bookkeeping, graphdef, rest, ghost=ghost,
                                          dtype=dtype))
    return params, ours, jax.jit(dp.per_example_clipper(per_example)), (side, side, channels)


def _flat(grads) -> np.ndarray:
    return np.concatenate([np.asarray(g, np.float64).ravel() for g in jax.tree.leaves(grads)])


@pytest.mark.parametrize("name,ghost", [("cnn", None), ("wrn", None), ("wrn", True),
                                        ("vit", None), ("vit", True), ("scatter", None),
                                        ("scatter_linear", None)])
def test_equals_per_example_clipping_with_views_and_padding(name, ghost):
    """K = 2 views, five padding rows: the clipped sums agree within 1e-5 relative
    unclipped; clipped, the book-keeping norms are upper bounds within 1e-5 (instantiated) or
    1e-3 (ghost: the Gram form's float32 rounding bound, `dp.bookkeeping`) of the exact ones,
    and the sums agree within that much. The batch has the 11 rows of the leave-one-out test
    below (`_adversarial`): its book-keeping programs, of the same shapes, are then loaded
    from the tests' compilation cache, not compiled again."""
    params, ours, reference, shape = _clippers(name, ghost)
    rng = np.random.default_rng(0)
    n = 11
    x = jnp.asarray(rng.normal(size=(n, 2, *shape)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, CLASSES, n))
    mask = jnp.asarray((np.arange(n) < 6).astype(np.float32))
    tol = 1e-5 if ghost is None else 1e-3
    for clip in (jnp.inf, 0.05):
        mine, theirs = ours(params, (x, y), clip, mask), reference(params, (x, y), clip, mask)
        a, b = _flat(mine.grads), _flat(theirs.grads)
        assert np.linalg.norm(a - b) <= (1e-5 if clip == jnp.inf else tol) * np.linalg.norm(b)
        exact, bound = np.asarray(theirs.norms)[:6], np.asarray(mine.norms)[:6]
        assert (bound >= exact * (1 - 1e-6)).all() and (bound <= exact * (1 + tol)).all()


def _adversarial(shape, rng):
    """8 ordinary examples (2 views each), then: huge pixels, pixels near float32's max,
    two nearly antipodal large views (their gradients cancel in the view average)."""
    x = rng.normal(size=(11, 2, *shape)).astype(np.float32)
    x[8] *= 1e6
    x[9] = np.sign(x[9]) * 3e37
    x[10, 1] = -x[10, 0] * (1 + 1e-3)
    x[10] *= 1e4
    return jnp.asarray(x), jnp.asarray(np.arange(11) % CLASSES)


@pytest.mark.parametrize("name,ghost,dtype", [("cnn", None, None), ("wrn", True, None),
                                              ("vit", True, jnp.bfloat16),
                                              ("scatter", None, None),
                                              ("scatter_linear", None, None)])
def test_each_example_moves_the_sum_by_at_most_c(name, ghost, dtype):
    """Removing any one example (its mask to 0) moves the computed float32 sum by at most
    C (1 + 1e-6), measured in float64, on rows built to break clipping, with a float32 or a
    bfloat16 forward."""
    params, ours, _, shape = _clippers(name, ghost, dtype)
    x, y = _adversarial(shape, np.random.default_rng(1))
    clip = 0.5
    full = _flat(ours(params, (x, y), clip, jnp.ones(11)).grads)
    assert np.isfinite(full).all()
    for row in [0, 8, 9, 10]:
        without = _flat(ours(params, (x, y), clip, jnp.ones(11).at[row].set(0.0)).grads)
        assert np.linalg.norm(full - without) <= clip * (1 + 1e-6), row


def test_a_layer_without_a_rule_is_exact_and_named():
    """A dilated `nnx.Conv` has no rule (`dp.flax_rules`): its parameters' per-example
    gradients are formed (exact), and the layer is named in a notice."""

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(1, 300, (16, 16), kernel_dilation=2, rngs=rngs)
            self.head = nnx.Linear(300, CLASSES, rngs=rngs)

        def __call__(self, x):
            return self.head(jnp.tanh(self.conv(x)).mean(axis=(1, 2)))

    graphdef, params, rest = nnx.split(Net(nnx.Rngs(0)), nnx.Param, ...)
    lines = []
    ours = dp.bookkeeping_clipper(lambda m, e, x, y: _loss(m(x), y), graphdef, rest,
                                  notices=lines.append)
    reference = dp.per_example_clipper(
        lambda p, x, y: _loss(nnx.merge(graphdef, p, rest)(x[0]), y[0]))
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(4, 1, 8, 8, 1)).astype(np.float32))
    y = jnp.arange(4) % CLASSES
    a = _flat(ours(params, (x, y), 0.1, jnp.ones(4)).grads)
    b = _flat(reference(params, (x, y), 0.1, jnp.ones(4)).grads)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
    assert lines == ["book-keeping clipping has no rule for the layers conv "
                     "(flax.nnx.nn.linear.Conv): their parameters' per-example gradients are "
                     "formed (exact clipping, slower; `dp.taps.register_rule` declares a faster "
                     "rule)"]


def test_a_layer_called_twice_is_refused():
    """A shared layer would pair one call's input with both calls' output gradients."""

    class Twice(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(4, 4, rngs=rngs)

        def __call__(self, x):
            return self.dense(jnp.tanh(self.dense(x)))

    graphdef, params, rest = nnx.split(Twice(nnx.Rngs(0)), nnx.Param, ...)
    ours = dp.bookkeeping_clipper(lambda m, e, x, y: _loss(m(x), y), graphdef, rest)
    with pytest.raises(ValueError, match="dense is called more than once"):
        ours(params, (jnp.ones((2, 1, 4)), jnp.zeros(2, jnp.int32)), 1.0, jnp.ones(2))


@pytest.mark.parametrize("ghost", [True, None])
def test_a_token_tiny_next_to_the_peak_still_counts(ghost):
    """The ghost norm scales each example by its largest entry: a token far below it flushes
    to zero in the Gram form, yet its gradient (here 1e18 or 1e12 of the example's) must
    still be bounded (found by review: contributions of 1e18 C before the absolute slack)."""
    cases = [(4, 3, [(0, 0, 3e38, None), (1, 1, 1e18, 1.0)], False),
             (1024, 1024, [(0, 0, 2.0**60, 1.0), (1, 0, 2.0**20, 2.0**-20)], True)]
    for d, p, tokens, bias in cases if ghost else cases[1:]:
        model = nnx.Linear(d, p, use_bias=bias, rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        ours = dp.bookkeeping_clipper(lambda m, e, x, w: jnp.sum(m(x) * w), graphdef, rest,
                                      ghost=ghost)
        x, w = np.zeros((2, 2, d), np.float32), np.zeros((2, 2, p), np.float32)
        for token, column, a, b in tokens:
            x[0, token, column] = a
            w[0, token, :] = 0.0 if b is None else b / np.sqrt(p)
        result = ours(params, (jnp.asarray(x), jnp.asarray(w)), 1.0, jnp.array([1.0, 0.0]))
        assert np.linalg.norm(_flat(result.grads)) <= 1.0 + 1e-6


@pytest.mark.parametrize("side,k,stride,pad,views,channels", [
    (28, 8, 2, 3, 1, 1), (28, 8, 2, 3, 3, 1), (12, 3, 1, 1, 2, 1), (9, 4, 3, 0, 1, 1),
    (12, 3, 1, 1, 2, 3), (7, 1, 1, 0, 1, 4), (10, 3, 1, 0, 2, 2), (12, 4, 2, 0, 1, 3),
    (13, 3, 2, 1, 2, 2)])
@pytest.mark.parametrize("form", ["windows", "positions"])
def test_convolution_gradients_without_patches(side, k, stride, pad, views, channels, form,
                                               monkeypatch):
    """The conv rule's `example_grads`, in both of its forms (one batched matmul per kernel
    offset; multiply-adds over the output positions), is every example's A^T B over its
    views, rows in im2col's order, at any stride, padding and channels, each example's from
    its own rows only."""
    from dpprobe.finetune.models import taps
    from dpprobe.finetune.models._conv import Conv, im2col
    from dpprobe.finetune.models.taps import _conv_example_grads

    monkeypatch.setattr(taps, "_POSITIONS_MAX", 0 if form == "windows" else 10**9)
    monkeypatch.setattr(taps, "_MATMULS_MIN", 0)
    monkeypatch.setattr(taps, "_MATMUL_MAX", 10**9)

    n, out = 5, 4
    conv = Conv(channels, out, k, stride, pad, kernel_init=nnx.initializers.lecun_normal(),
                rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (n, views, side, side, channels))
    tokens = views * ((side + 2 * pad - k) // stride + 1) ** 2
    b = jax.random.normal(jax.random.key(2), (n, tokens, out))
    a = jax.vmap(lambda xi: im2col(xi, k, stride, pad))(x).reshape(n, tokens, k * k * channels)
    expected = jnp.einsum("ntd,ntp->ndp", a, b, precision=jax.lax.Precision.HIGHEST)
    atol = 1e-5 * float(jnp.max(jnp.abs(expected)))
    np.testing.assert_allclose(_conv_example_grads(conv, x, b), expected, rtol=1e-5, atol=atol)
    # Examples share nothing: one near float32's max and one with a NaN leave the others'
    # gradients as they were.
    hostile = _conv_example_grads(conv, x.at[1].set(3e38).at[2, 0, 3, 3, 0].set(jnp.nan), b)
    assert not np.all(np.isfinite(hostile[2]))
    np.testing.assert_allclose(hostile[np.array([0, 3, 4])], expected[np.array([0, 3, 4])],
                               rtol=1e-5, atol=atol)


def test_patches_wait_for_the_output_gradient():
    """`after` leaves x as it is where b's first entry is finite and makes the example NaN
    (and only it) where it is not, compiled: XLA keeps x's dependence on b."""
    from dpprobe.dp.bookkeeping import after

    x = jax.random.normal(jax.random.key(0), (3, 2, 4, 4, 2))
    b = jax.random.normal(jax.random.key(1), (3, 8, 5)).at[1, 0, 0].set(jnp.inf)
    y = jax.jit(after)(x, b)
    np.testing.assert_array_equal(y[np.array([0, 2])], x[np.array([0, 2])])
    assert np.all(np.isnan(y[1]))


@pytest.mark.parametrize("n,tokens,d,p,plan", [
    (64, 5, 192, 576, "ghost"),  # ViT-tiny at 32 px: Gram forms 19k << d p = 111k
    (16, 197, 192, 576, "instantiate"),  # ViT-tiny at 224 px: T^2 (d + p) = 30M
    (256, 25, 256, 32, "instantiate"),  # the CNN's conv2: T^2 (d + p) = 180k > d p = 8k
    (256, 1, 512, 32, "ghost"),  # the CNN's fc1: one token
    (4, 1, 512, 32, "instantiate"),  # small gradients (n d p <= 2^20)
    (64, 40, 2048, 2048, "ghost"),  # time favours instantiation, but n d p > 2^26 floats
    (1024, 64, 64, 64, "instantiate"),  # 2 T^2 >= d p: the Grams would outgrow the gradients
    (256, 16, 1152, 128, "ghost"),  # ResNet-18's stage 2 at 32 px: T^2 (d + p) = 2.2 d p
    (64, 16, 672, 112, "ghost"),  # Lite0's 1 x 1 at 64 px: 2.7 d p
    (256, 16, 80, 320, "instantiate"),  # ConvNeXt-atto's stage-2 MLP at 32 px: 4.0 d p
    (256, 16, 64, 128, "instantiate"),  # ResNet-18's 1 x 1 shortcut: 6 d p
])
def test_layer_plan_charges_both_forms_their_whole_cost(n, tokens, d, p, plan):
    """Ghost iff it saves space and either time, T^2 (d + p) < 3 d p (its Gram forms against
    the norm and sum of formed gradients, which both pay T d p but instantiation in n small
    matmuls and n d p floats written and read: the factor is measured), or 2^26 floats of
    gradients."""
    assert dp.bookkeeping.layer_plan(n, tokens, d, p) == plan
