"""The trainer: optimizers follow their rules, sweeps equal single runs, plain GD without DP."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpprobe import accounting, dp, probe
from tests.conftest import fixed_keys, random_problem


def _by_hand(name: str, lr: float, grads_seq, params, b1=0.9, b2=0.999):
    """The optimizers' update rules written out (float64), for `dp.make_optimizer`."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    for t, grads in enumerate(grads_seq, start=1):
        g = {k: np.asarray(x, np.float64) for k, x in grads.items()}
        if name == "sgd":
            step = g
        elif name == "momentum":  # heavy ball, Panda et al. Alg. 1
            m = {k: 0.9 * m[k] + g[k] for k in p}
            step = m
        elif name == "sign":
            step = {k: np.sign(g[k]) for k in p}
        else:  # adam, lamb: bias-corrected moments
            m = {k: b1 * m[k] + (1 - b1) * g[k] for k in p}
            v = {k: b2 * v[k] + (1 - b2) * g[k] ** 2 for k in p}
            eps = 1e-8 if name == "adam" else 1e-6
            step = {k: (m[k] / (1 - b1**t)) / (np.sqrt(v[k] / (1 - b2**t)) + eps) for k in p}
            if name == "lamb":  # trust ratio ||p|| / ||step|| per leaf
                step = {k: step[k] * np.linalg.norm(p[k]) / np.linalg.norm(step[k]) for k in p}
        p = {k: p[k] - lr * step[k] for k in p}
    return p


@pytest.mark.parametrize("name", dp.OPTIMIZERS)
@pytest.mark.parametrize("schedule", [False, True], ids=["constant", "schedule"])
def test_named_optimizers_follow_their_update_rules(rng, name, schedule):
    """`dp.make_optimizer` (learning rate included, a float or an optax schedule) against the
    update rules by hand."""
    lr = 0.03
    params = {"w": jnp.asarray(rng.normal(size=(4, 3))), "b": jnp.asarray(rng.normal(size=3))}
    grads_seq = [{"w": rng.normal(size=(4, 3)), "b": rng.normal(size=3)} for _ in range(3)]
    ours = dp.make_optimizer(name, optax.constant_schedule(lr) if schedule else lr)
    state, p_ours = ours.init(params), params
    for grads in grads_seq:
        updates, state = ours.update(jax.tree.map(jnp.asarray, grads), state, p_ours)
        p_ours = optax.apply_updates(p_ours, updates)
    expected = _by_hand(name, lr, grads_seq, params)
    for key in ("w", "b"):
        np.testing.assert_allclose(p_ours[key], expected[key], rtol=2e-5, atol=1e-6)


def _runs(epsilons, steps, lr, clip=1.0):
    runs = []
    for eps in epsilons:
        sigma = accounting.calibrate_noise_multiplier(eps, 1e-5, steps=steps)
        plan = accounting.DpPlan(sigma, steps, clip_norm=clip if sigma > 0 else math.inf)
        runs.append(probe.RunSpec(plan, lr))
    return runs


@pytest.mark.parametrize("optimizer", ["adam", "momentum"])
def test_sweep_equals_each_run_alone(rng, optimizer):
    features, labels, _ = random_problem(rng, n=128, d=16, c=4)
    spec = probe.ProbeSpec(4, optimizer=optimizer)
    runs = _runs([0.5, 2.0, math.inf], steps=3, lr=0.05) + _runs([1.0], steps=1, lr=0.2)
    keys = fixed_keys(len(runs), 11)
    swept = probe.train_probe(features, labels, runs, keys, spec)
    for i, run in enumerate(runs):
        alone = probe.train_probe(features, labels, [run], keys[i:i + 1], spec)
        np.testing.assert_allclose(swept.params["w"][i], alone.params["w"][0], rtol=1e-4,
                                   atol=1e-6)
        np.testing.assert_allclose(swept.params["b"][i], alone.params["b"][0], rtol=1e-4,
                                   atol=1e-6)
        np.testing.assert_allclose(swept.clipped_fraction[i], alone.clipped_fraction[0])


@pytest.mark.parametrize("loss", ["softmax", "sigmoid"])
def test_non_private_run_is_plain_gradient_descent(rng, loss):
    features, labels, _ = random_problem(rng, n=96, d=8, c=3)
    spec = probe.ProbeSpec(3, optimizer="sgd", loss=loss)
    steps, lr = 5, 0.5
    result = probe.train_probe(features, labels, _runs([math.inf], steps, lr), dp.make_keys(1),
                               spec)
    params = jax.tree.map(lambda p: p[0], probe.init_params(1, 8, spec))
    onehot = jax.nn.one_hot(labels, 3)

    def mean_loss(p):
        return jnp.mean(probe.example_losses(features @ p["w"] + p["b"], onehot, loss))

    for _ in range(steps):
        params = jax.tree.map(lambda p, g: p - lr * g, params, jax.grad(mean_loss)(params))
    np.testing.assert_allclose(result.params["w"][0], params["w"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(result.params["b"][0], params["b"], rtol=1e-4, atol=1e-6)


def test_sigmoid_default_bias_is_minus_ten():
    assert probe.ProbeSpec(3, loss="sigmoid").initial_bias == -10.0
    assert probe.ProbeSpec(3).initial_bias == 0.0
    assert probe.ProbeSpec(3, bias_init=2.0, loss="sigmoid").initial_bias == 2.0


def test_runs_with_fewer_steps_stop_updating(rng):
    features, labels, _ = random_problem(rng, n=64, d=8, c=3)
    spec = probe.ProbeSpec(3, optimizer="sgd")
    runs = _runs([math.inf], 2, 0.1) + _runs([math.inf], 6, 0.1)
    out = probe.train_probe(features, labels, runs, dp.make_keys(2), spec)
    alone = probe.train_probe(features, labels, runs[:1], dp.make_keys(1), spec)
    np.testing.assert_allclose(out.params["w"][0], alone.params["w"][0], rtol=1e-5, atol=1e-7)
    assert not np.allclose(out.params["w"][0], out.params["w"][1])


def test_bad_inputs_are_rejected_with_clear_errors(rng):
    """Only public metadata (shapes, dtypes, counts) is checked: see test_privacy for rows with
    NaN features or labels out of range, which become null rows instead of errors."""
    features, labels, _ = random_problem(rng, n=16, d=4, c=3)
    spec = probe.ProbeSpec(3)
    runs = _runs([1.0], 1, 0.1)
    with pytest.raises(ValueError, match="labels must be a 1-D integer array"):
        probe.train_probe(features, labels.astype(float), runs, dp.make_keys(1), spec)
    with pytest.raises(ValueError, match="16 feature rows but 15 labels"):
        probe.train_probe(features, labels[:-1], runs, dp.make_keys(1), spec)
    with pytest.raises(ValueError, match="one key per run"):
        probe.train_probe(features, labels, runs, dp.make_keys(2), spec)
    with pytest.raises(ValueError, match="learning_rate"):
        probe.RunSpec(runs[0].plan, -1.0)
    with pytest.raises(ValueError, match="optimizer must be"):
        probe.ProbeSpec(3, optimizer="adagrad")


def test_evaluate_counts_top1_top5_and_per_class():
    params = {"w": jnp.eye(6)[None], "b": jnp.zeros((1, 6))}
    features = np.eye(6)[[0, 1, 2, 3]]
    features[2] = [0.1, 0.2, 0.9, 0.3, 0.4, 0.5]  # predicts 2; label 5 is second: top-5 hit
    features[3] = [0.9, 0.1, 0.2, 0.3, 0.4, 0.0]  # predicts 0; label 3 is 3rd: top-5 hit
    labels = np.array([0, 1, 5, 3])
    out = probe.evaluate(params, features, labels)
    assert out["top1"][0] == pytest.approx(0.5)
    assert out["top5"][0] == pytest.approx(1.0)
    np.testing.assert_allclose(out["per_class"][0], [1, 1, np.nan, 0, np.nan, 0])


@pytest.mark.parametrize("loss", ["softmax", "sigmoid"])
def test_sign_sgd_equals_one_dp_adam_step_from_zero(rng, loss):
    """Mehta et al. App. E.3: Adam's first step from zero is g / (|g| + eps) ~ sign(g)."""
    features, labels, _ = random_problem(rng, n=300, d=20, c=4)
    runs = _runs([1.0, 4.0, 16.0], steps=1, lr=1e-3)
    keys = fixed_keys(3, 1)

    def train(optimizer, lr=1e-3):
        spec = probe.ProbeSpec(4, optimizer=optimizer, loss=loss)
        plans = [probe.RunSpec(r.plan, lr) for r in runs]
        return probe.train_probe(features, labels, plans, keys, spec).params

    adam, sign, sgd = train("adam"), train("sign"), train("sgd", lr=1.0)
    bias = probe.ProbeSpec(4, loss=loss).initial_bias
    grads = {"w": -sgd["w"], "b": bias - sgd["b"]}  # one SGD step with lr 1: -g, same noise
    for key, start in (("w", 0.0), ("b", bias)):
        g = grads[key]
        ulp = 2 * float(np.spacing(np.float32(abs(start) + 1e-3)))  # float32 resolution at b
        # Exactly Adam's first step from zero ...
        np.testing.assert_allclose(adam[key] - start, -1e-3 * g / (np.abs(g) + 1e-8),
                                   rtol=1e-4, atol=ulp)
        # ... which is sign-SGD wherever the noisy gradient is not within ~1e-5 of zero.
        clear = np.abs(g) > 1e-5
        assert clear.mean() > 0.99
        np.testing.assert_allclose(adam[key][clear], sign[key][clear], rtol=1e-3, atol=ulp)
        np.testing.assert_allclose(np.abs(sign[key] - start), 1e-3, atol=ulp)


def test_the_first_step_widens_the_sum_a_block_at_a_time():
    """The clipped sum's float64 operands are one block of `dp.accumulate.SUM_BLOCK_ROWS` rows
    at a time, not a float64 copy of every feature (which XLA:CPU also copied once more for
    the loop over blocks): the first step's compiled program holds less scratch memory than
    N x d float64 values. (Its float32 features, N x d x 4 bytes, are the one full copy.)"""
    from dpprobe.probe import step, train

    n, d, classes = 8192, 256, 3
    rng = np.random.default_rng(0)
    spec = probe.ProbeSpec(classes)
    feats, onehot, mask = train.prepare_inputs(rng.normal(size=(n, d)).astype(np.float16),
                                               rng.integers(0, classes, n), spec)
    plan = accounting.DpPlan(1.0, 1, clip_norm=1.0)
    arrays = step.run_arrays([probe.RunSpec(plan, 0.1)] * 4, fixed_keys(4, 0), n)
    compiled = train._first_step.lower(feats, onehot, mask, arrays, spec=spec).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < n * d * 8
