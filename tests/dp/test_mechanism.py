"""The noise on the clipped sum has std sigma * C (divided by N), statistically tested."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dpprobe import accounting, dp, probe
from tests.conftest import fixed_keys


def _ks_pvalue(samples, std):
    return stats.kstest(samples, stats.norm(scale=std).cdf).pvalue


def test_privatizer_adds_noise_of_std_sigma_times_c_to_any_pytree():
    """`gaussian_privatizer` (an optax transformation) on a pytree of several leaves: std
    sigma * C per coordinate, a fresh draw each step (`fold_in(key, step)`)."""
    sigma, clip = 2.5, 0.7
    plan = accounting.DpPlan(sigma, 8, clip_norm=clip)
    sums = {"w": jnp.zeros((50, 10)), "b": jnp.zeros((10,)), "extra": {"s": jnp.zeros((3, 7))}}
    privatizer = dp.privatizer(dp.noise_stddev(plan), fixed_keys(1, 1)[0])
    state = privatizer.init(sums)
    update = jax.jit(privatizer.update)  # compiled, as in a training step (op by op: 2x slower)
    draws = []
    for _ in range(8):
        noisy, state = update(sums, state)
        draws.append(np.concatenate([np.ravel(x) for x in jax.tree.leaves(noisy)]))
    samples = np.concatenate(draws)
    expected = sigma * clip
    assert samples.size == 8 * 531 and int(state.count) == 8
    assert len({d[:4].tobytes() for d in draws}) == 8  # every step its own noise
    assert _ks_pvalue(samples, expected) > 1e-3
    # The same test rejects a noise scale off by x0.67 or x1.5.
    assert _ks_pvalue(samples, expected * 0.67) < 1e-6
    assert _ks_pvalue(samples, expected * 1.5) < 1e-6
    assert abs(samples.std() / expected - 1) < 0.05


def test_non_private_plan_has_exactly_zero_noise():
    plan = accounting.DpPlan(0.0, 1, clip_norm=math.inf)
    assert dp.noise_stddev(plan) == 0.0
    tree = {"w": jnp.ones((4, 3))}
    out = dp.add_noise(tree, dp.noise_stddev(plan), dp.make_keys(1)[0])
    np.testing.assert_array_equal(out["w"], tree["w"])


def test_trained_probe_carries_exactly_the_calibrated_noise(rng):
    """One DP-SGD step with lr 1 from zero: params = -(clipped sum + noise) / N.

    Subtracting the exact clipped sum leaves the noise the whole pipeline added, whose std
    must be sigma * C / N with sigma calibrated for (epsilon, delta).
    """
    n, d, c = 200, 300, 10
    features = rng.normal(size=(n, d)).astype(np.float32)
    labels = rng.integers(0, c, size=n)
    sigma = accounting.calibrate_noise_multiplier(1.0, 1e-5)
    clip = 0.5
    plan = accounting.DpPlan(sigma, 1, clip_norm=clip)
    spec = probe.ProbeSpec(c, optimizer="sgd")
    result = probe.train_probe(features, labels, [probe.RunSpec(plan, 1.0)],
                               fixed_keys(1, 3), spec)
    sums, _ = jax.jit(probe.clipped_grad_sum, static_argnames="loss")(
        probe.init_params(1, d, spec), jnp.asarray(features),
        jax.nn.one_hot(labels, c), jnp.array([clip]), loss="softmax",
    )
    noise = -result.params["w"][0] * n - np.asarray(sums["w"][0])
    expected = sigma * clip
    assert _ks_pvalue(noise.ravel(), expected) > 1e-3
    assert _ks_pvalue(noise.ravel(), expected * 0.67) < 1e-6
    assert _ks_pvalue(noise.ravel(), expected * 1.5) < 1e-6


def test_keys_come_from_os_entropy_and_differ():
    a, b = dp.make_keys(4), dp.make_keys(4)
    assert not np.array_equal(jax.random.key_data(a), jax.random.key_data(b))
    # Distinct runs of one sweep get distinct keys.
    data = jax.random.key_data(dp.make_keys(16))
    assert len({tuple(row) for row in np.asarray(data)}) == 16
    with pytest.raises(TypeError):
        dp.make_keys(4, seed=7)  # no seeded noise in the product


def test_non_private_runs_get_no_noise(rng):
    features = rng.normal(size=(32, 5)).astype(np.float32)
    labels = rng.integers(0, 3, size=32)
    plan = accounting.DpPlan(0.0, 1, clip_norm=math.inf)
    spec = probe.ProbeSpec(3, optimizer="sgd")
    a = probe.train_probe(features, labels, [probe.RunSpec(plan, 1.0)], dp.make_keys(1), spec)
    b = probe.train_probe(features, labels, [probe.RunSpec(plan, 1.0)], dp.make_keys(1), spec)
    np.testing.assert_array_equal(a.params["w"], b.params["w"])
    assert np.isfinite(a.params["w"]).all()
