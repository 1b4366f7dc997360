"""The ghost norm through weight standardization (`finetune.models.ws_ghost`) against per-example
gradients from `jax.vmap(jax.grad)`, for WRN's `WSConv` (filters whose variance is floored, a
zero and a large gain) and BiT's `StdConv` (no gain, eps 1e-8 added to the variance: a zero
filter, filters whose variance is eps and eps / 10, so f = var / (var + eps) is far from 1),
and the leave-one-out bound on rows built to break it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dpprobe import dp
from dpprobe.dp.accumulate import x64_jit
from dpprobe.finetune.models import WSConv
from dpprobe.finetune.models.bit import StdConv
from dpprobe.finetune.models.ws_ghost import WS_GHOST


def _layer(stride=1, size=3, kind="ws"):
    if kind == "std":
        return _std_layer(stride, size)
    conv = WSConv(6, 8, size, stride, rngs=nnx.Rngs(0))
    kernel = np.asarray(conv.kernel[...]).copy()
    kernel[..., 0] = 0.25  # a constant filter: variance 0, floored at eps
    kernel[..., 1] *= 1e-3  # m var = 1e-6 m < eps: floored too
    conv.kernel.set_value(jnp.asarray(kernel))
    conv.gain.set_value(jnp.asarray([1.0, 2.0, 0.0, 30.0, 0.5, 1.0, -1.5, 1.0]))
    conv.bias.set_value(jnp.linspace(-1.0, 1.0, 8))
    return conv


def _std_layer(stride, size):
    """A `StdConv` (BiT's eps 1e-8) whose filters span f = var / (var + eps) from 0 to 1."""
    rng = np.random.default_rng(3)
    kernel = rng.normal(size=(size, size, 6, 8)).astype(np.float32) * 0.1
    kernel[..., 0] = 0.25  # a constant filter: u = 0, f = 0
    for j, var in ((1, 1e-8), (2, 1e-9)):  # f = 1/2 and 1/11
        u = kernel[..., j] - kernel[..., j].mean()
        kernel[..., j] = u * np.sqrt(var / np.mean(u**2))
    kernel[..., 3] *= 10.0  # variance ~1: f rounds to 1 in float32
    return StdConv(jnp.asarray(kernel), stride=stride, padding=(size - 1) // 2, eps=1e-8)


KINDS = ["ws", "std"]


def _loss(model, x, w):
    return jnp.sum(jnp.tanh(model(x)) * w)


def _per_example(conv, x, w):
    """Each example's gradients (kernel, gain, bias) by vmap(grad), flattened: (n, P)."""
    graphdef, params = nnx.split(conv, nnx.Param)

    def one(p, xi, wi):
        return _loss(nnx.merge(graphdef, p), xi[None], wi[None])

    grads = jax.vmap(jax.grad(one), in_axes=(None, 0, 0))(params, x, w)
    return np.concatenate([np.asarray(g, np.float64).reshape(x.shape[0], -1)
                           for g in jax.tree.leaves(grads)], axis=1), graphdef, params


def _data(n, side, rng):
    x = rng.normal(size=(n, side, side, 6)).astype(np.float32)
    w = rng.normal(size=(n, side, side, 8)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(w)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stride,size", [(1, 3), (2, 3), (2, 1)])
def test_norms_and_clipped_sum_equal_per_example_gradients(stride, size, kind):
    """The bound is >= each example's exact norm and within 1e-3 of it; the clipped sum equals
    sum_i min(1, C / |g_i|) g_i of vmap(grad)'s gradients (within 1e-5 unclipped)."""
    conv = _layer(stride, size, kind)
    rng = np.random.default_rng(0)
    x, w = _data(6, 7, rng)
    side = conv(x).shape[1]
    w = w[:, :side, :side]
    grads, graphdef, params = _per_example(conv, x, w)
    exact = np.linalg.norm(grads, axis=1)
    ours = jax.jit(dp.bookkeeping_clipper(lambda m, e, xi, wi: _loss(m, xi[None], wi[None]),
                                          graphdef, nnx.State({}), ghost=True))
    mask = jnp.asarray([1.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    for clip, tol in ((np.inf, 1e-5), (float(np.median(exact)), 1e-3)):
        result = ours(params, (x, w), clip, mask)
        bound = np.asarray(result.norms)[:5]
        assert (bound >= exact[:5] * (1 - 1e-6)).all() and (bound <= exact[:5] * 1.001).all()
        factors = np.minimum(1.0, clip / bound) * np.asarray(mask)[:5]
        expected = (factors[:, None] * grads[:5]).sum(axis=0)
        got = np.concatenate([np.asarray(g, np.float64).ravel()
                              for g in jax.tree.leaves(result.grads)])
        assert np.linalg.norm(got - expected) <= tol * np.linalg.norm(expected)


@pytest.mark.parametrize("kind", KINDS)
def test_the_rule_is_used_and_matches_instantiation(kind):
    """ghost=True goes through `WS_GHOST` (its sums are called) and agrees with the
    instantiated chain rule (ghost=False) within 1e-5 unclipped."""
    conv = _layer(kind=kind)
    x, w = _data(4, 5, np.random.default_rng(1))
    graphdef, params = nnx.split(conv, nnx.Param)
    calls = []
    original = WS_GHOST.sums

    def spy(*args):
        calls.append(1)
        return original(*args)

    WS_GHOST.sums = spy
    try:
        sums = [dp.bookkeeping_clipper(lambda m, e, xi, wi: _loss(m, xi[None], wi[None]),
                                       graphdef, nnx.State({}), ghost=ghost)(
            params, (x, w), np.inf, jnp.ones(4)).grads for ghost in (True, False)]
    finally:
        del WS_GHOST.sums
    assert calls == [1]
    a, b = (np.concatenate([np.asarray(g).ravel() for g in jax.tree.leaves(s)]) for s in sums)
    assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("jit", [jax.jit, x64_jit], ids=["float32", "float64"])
def test_each_example_moves_the_sum_by_at_most_c(jit, kind):
    """Removing any one example moves the computed sum (reduced over the batch in float32, or
    in float64 as the trainer does) by at most C (1 + 1e-6) (float64 measure) on rows built
    to break the bound: huge inputs, inputs near float32's max, patches constant over their
    features (their gradient lies in the direction the standardization removes), output
    gradients along the standardized filters."""
    conv = _layer(kind=kind)
    rng = np.random.default_rng(2)
    x, w = (np.array(v) for v in _data(8, 5, rng))
    x[1] *= 1e6
    x[2] = np.sign(x[2]) * 3e37
    x[3] = 1e4  # constant patches: P g = 0, |g| huge
    x[4] = 1e-30 * x[4]
    w[5] *= 1e20
    graphdef, params = nnx.split(conv, nnx.Param)
    ours = jit(dp.bookkeeping_clipper(lambda m, e, xi, wi: _loss(m, xi[None], wi[None]),
                                      graphdef, nnx.State({}), ghost=True))
    batch, clip = (jnp.asarray(x), jnp.asarray(w)), 0.5

    def flat(mask):
        return np.concatenate([np.asarray(g, np.float64).ravel()
                               for g in jax.tree.leaves(ours(params, batch, clip, mask).grads)])

    full = flat(jnp.ones(8))
    assert np.isfinite(full).all()
    for row in range(8):
        assert np.linalg.norm(full - flat(jnp.ones(8).at[row].set(0.0))) <= clip * (1 + 1e-6)


def test_a_stdconv_row_parallel_to_its_filter_is_bounded_and_the_slack_is_public():
    """A StdConv's correction |c f sc q| is unbounded by the example's kernel gradient when
    its W_hat gradient lies along a filter with f ~ 1 (|dV| = sc (1 - f) |q|): the bound is
    raised to f sc |q| / STD_TOP there, and the reduction's slack (which lowers the clip norm
    of every example) is the same for any batch, never a statistic of it."""
    from dpprobe.finetune.models.ws_ghost import STD_TOP, _ws_map

    conv = _std_layer(1, 3)
    w0, sc, f, _ = _ws_map(conv, 0.0)
    j = 4  # a random filter of variance ~1e-2: f = 1 - 1e-6
    a = jnp.asarray(np.asarray(w0[:, j])[None, None, :]).repeat(2, axis=0)  # (2, 1, m)
    b = np.zeros((2, 1, 8), np.float32)
    b[0, 0, j], b[1, 0, (j + 1) % 8] = 3.0, 1e-3
    norm, data = WS_GHOST.norm(conv, a, jnp.asarray(b))
    q = np.asarray(data[2])
    reach = float(f[j] * sc[j]) * abs(q[0, j]) / STD_TOP
    exact = float(sc[j]) * (1.0 - float(f[j])) * abs(q[0, j])  # |dV_j| of row 0
    assert reach > 10 * exact  # the case the raise exists for
    assert float(norm[0]) >= reach
    other, data2 = WS_GHOST.norm(conv, a * 7.0, jnp.asarray(b[::-1].copy()))
    assert float(WS_GHOST.slack(2, data)) == float(WS_GHOST.slack(2, data2))
    ws = _layer(1, 3, "ws")
    assert float(WS_GHOST.slack(2, WS_GHOST.norm(ws, a, jnp.asarray(b))[1])) == float(
        WS_GHOST.slack(2, WS_GHOST.norm(ws, a * 7.0, jnp.asarray(b[::-1].copy()))[1]))
