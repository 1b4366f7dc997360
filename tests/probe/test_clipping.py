"""Closed-form clipping equals per-example gradients from jax.vmap(jax.grad). Both sides are
compiled, as a training step runs them (op by op, the file took 42 s, compiled 28 s)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpprobe import probe
from tests.conftest import random_problem

clipped_grad_sum = jax.jit(probe.clipped_grad_sum, static_argnames="loss")
per_example_grad_norms = jax.jit(probe.per_example_grad_norms, static_argnames="loss")


@functools.partial(jax.jit, static_argnames="loss")
def _reference_grads(params, features, labels, loss):
    """Per-example gradients of the single model params[0], by vmap(grad)."""
    single = jax.tree.map(lambda p: p[0], params)
    onehot = jax.nn.one_hot(labels, params["w"].shape[-1])

    def example_loss(p, x, y):
        logits = x @ p["w"] + p["b"]
        return probe.example_losses(logits, y, loss)

    return jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0))(single, features, onehot)


def _flat_norms(grads):
    return jnp.sqrt(jnp.sum(grads["w"] ** 2, axis=(1, 2)) + jnp.sum(grads["b"] ** 2, axis=1))


def _gamma(dim, classes, views=1):
    """The rounding allowance of `probe.clipping` (its module docstring)."""
    return 2.0 * (dim + classes + views * views + 8) * 2.0**-24


@pytest.mark.parametrize("loss", ["softmax", "sigmoid"])
def test_closed_form_norms_equal_vmap_grad(rng, loss):
    features, labels, params = random_problem(rng)
    onehot = jax.nn.one_hot(labels, 5)
    ours = np.asarray(per_example_grad_norms(params, features, onehot, loss=loss)[:, 0])
    ref = np.asarray(_flat_norms(_reference_grads(params, features, labels, loss)), np.float64)
    # An upper bound, a relative sqrt(1 + gamma) above the exact norm (float32 noise aside).
    np.testing.assert_allclose(ours, ref * np.sqrt(1 + _gamma(12, 5)), rtol=2e-6)


@pytest.mark.parametrize("loss", ["softmax", "sigmoid"])
@pytest.mark.parametrize("clip_norm", [0.05, 1.0, 3.0])
def test_clipped_sum_equals_vmap_grad_then_clip(rng, loss, clip_norm):
    features, labels, params = random_problem(rng)
    grads = _reference_grads(params, features, labels, loss)
    norms = _flat_norms(grads) * np.sqrt(1 + _gamma(12, 5))  # what the clipping uses
    scale = jnp.minimum(1.0, clip_norm / norms)
    expected_w = jnp.einsum("n,ndc->dc", scale, grads["w"])
    expected_b = jnp.einsum("n,nc->c", scale, grads["b"])
    sums, num_clipped = clipped_grad_sum(
        params, features, jax.nn.one_hot(labels, 5), jnp.array([clip_norm]), loss=loss
    )
    np.testing.assert_allclose(sums["w"][0], expected_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sums["b"][0], expected_b, rtol=1e-5, atol=1e-6)
    assert int(num_clipped[0]) == int(jnp.sum(norms > clip_norm))
    # The clip norm mattered in at least one of the parametrizations.
    if clip_norm == 0.05:
        assert int(num_clipped[0]) == len(labels)


@pytest.mark.parametrize("loss", ["softmax", "sigmoid"])
def test_no_clipping_is_the_plain_full_batch_gradient(rng, loss):
    features, labels, params = random_problem(rng)
    onehot = jax.nn.one_hot(labels, 5)

    def total_loss(p):
        return jnp.sum(probe.example_losses(probe.linear_logits(p, features)[:, 0], onehot, loss))

    expected = jax.grad(total_loss)(params)
    sums, num_clipped = clipped_grad_sum(
        params, features, onehot, jnp.array([jnp.inf]), loss=loss
    )
    np.testing.assert_allclose(sums["w"], expected["w"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sums["b"], expected["b"], rtol=1e-5, atol=1e-5)
    assert int(num_clipped[0]) == 0


def test_stacked_configs_equal_each_alone(rng):
    features, labels, _ = random_problem(rng)
    onehot = jax.nn.one_hot(labels, 5)
    params = {"w": rng.normal(size=(3, 12, 5)).astype(np.float32),
              "b": rng.normal(size=(3, 5)).astype(np.float32)}
    clips = jnp.array([0.1, 1.0, jnp.inf])
    sums, _ = clipped_grad_sum(params, features, onehot, clips, loss="softmax")
    for p in range(3):
        alone = jax.tree.map(lambda a, p=p: a[p:p + 1], params)
        one, _ = clipped_grad_sum(alone, features, onehot, clips[p:p + 1], loss="softmax")
        np.testing.assert_allclose(sums["w"][p], one["w"][0], rtol=1e-5, atol=1e-6)


def test_mask_drops_rows(rng):
    features, labels, params = random_problem(rng)
    onehot = jax.nn.one_hot(labels, 5)
    mask = (rng.random(len(labels)) < 0.5).astype(np.float32)
    clip = jnp.array([0.5])
    masked, count = clipped_grad_sum(params, features, onehot, clip, loss="softmax",
                                           mask=jnp.asarray(mask))
    keep = mask > 0
    subset, count_subset = clipped_grad_sum(
        params, features[keep], onehot[keep], clip, loss="softmax"
    )
    np.testing.assert_allclose(masked["w"], subset["w"], rtol=1e-5, atol=1e-6)
    assert int(count[0]) == int(count_subset[0])


@pytest.mark.parametrize("loss", ["softmax", "sigmoid"])
def test_augmentation_multiplicity_averages_views_before_clipping(rng, loss):
    """De et al. eq. 4: clip( (1/K) sum_k grad(view k) ), by hand from vmap(grad)."""
    views = 4
    features, labels, params = random_problem(rng, n=32, views=views)
    flat = features.reshape(-1, features.shape[-1])
    per_view = _reference_grads(params, flat, np.repeat(labels, views), loss)
    mean_w = per_view["w"].reshape(32, views, 12, 5).mean(axis=1)
    mean_b = per_view["b"].reshape(32, views, 5).mean(axis=1)
    norms = jnp.sqrt(jnp.sum(mean_w**2, axis=(1, 2)) + jnp.sum(mean_b**2, axis=1))
    clip_norm = float(np.median(norms))
    ours = per_example_grad_norms(params, features, jax.nn.one_hot(labels, 5), loss=loss)
    # Upper bounds: exact + gamma * triangle bound, never below the exact norm.
    triangle = jnp.mean(jnp.sqrt(jnp.sum(per_view["w"].reshape(32, views, -1) ** 2, -1)
                                 + jnp.sum(per_view["b"].reshape(32, views, -1) ** 2, -1)), 1)
    bound = jnp.sqrt(jnp.maximum(norms**2 + _gamma(12, 5, views) * triangle**2,
                                 (triangle / 4) ** 2))
    np.testing.assert_allclose(ours[:, 0], bound, rtol=2e-6)
    assert (np.asarray(ours[:, 0]) >= np.asarray(norms) * (1 - 1e-6)).all()
    scale = jnp.minimum(1.0, clip_norm / ours[:, 0])
    sums, _ = clipped_grad_sum(
        params, features, jax.nn.one_hot(labels, 5), jnp.array([clip_norm]), loss=loss
    )
    np.testing.assert_allclose(sums["w"][0], jnp.einsum("n,ndc->dc", scale, mean_w),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sums["b"][0], jnp.einsum("n,nc->c", scale, mean_b),
                               rtol=1e-5, atol=1e-6)


def test_bad_feature_rank_is_rejected(rng):
    with pytest.raises(ValueError, match="features must be"):
        probe.clipped_grad_sum(
            {"w": jnp.zeros((1, 3, 2)), "b": jnp.zeros((1, 2))},
            jnp.zeros((2, 2, 2, 3)), jnp.zeros((2, 2)), jnp.ones(1), loss="softmax",
        )
