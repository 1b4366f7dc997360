"""The white-box gradient-canary audit of finetuning (issue 28): what the tap records, the
bound and the estimate on the exact mechanism, and broken mechanisms refuted through the real
trainer (noise halved, canaries not clipped, q misreported to the accountant), while correct
runs never are."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dpprobe.dp.noise  # noqa: F401 (loads the submodule)
import dpprobe.finetune.batch_sums as finetune_batch_sums
from dpprobe import accounting, dp, finetune
from dpprobe.dp.canaries import GradientCanaries, audit_gradient_canaries
from tests.conftest import fixed_keys

DELTA = 1e-5
CANARIES = 5000
REAL = 16


class Tiny(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.dense(x.reshape(x.shape[0], -1))


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(REAL, 4, 4, 1)).astype(np.float32), np.arange(REAL) % 3


def _plan(epsilon: float, steps: int = 300, batch: int = 100, q_claimed: float | None = None):
    """The run's plan (q = batch / (N + m)), sigma calibrated for `epsilon` at `q_claimed`."""
    q = batch / (REAL + CANARIES)
    sigma = accounting.calibrate_noise_multiplier(epsilon, DELTA, steps=steps,
                                                  sampling_probability=q_claimed or q)
    return accounting.DpPlan(sigma, steps, q, 1.0)


def _audited(plan, claim=None):
    images, labels = _data()
    canaries = GradientCanaries.draw(CANARIES, np.random.default_rng())
    spec = finetune.FinetuneSpec(3, learning_rate=0.1, ema_decay=None)
    batch = 128 if plan.sampling_probability * (REAL + CANARIES) < 128 else 256
    result = finetune.train_finetune(Tiny(nnx.Rngs(0)), images, labels, plan, spec,
                                     canaries=canaries,
                                     flags=finetune.FinetuneFlags(physical_batch_size=batch))
    return result, audit_gradient_canaries(result.canary_projections, canaries, claim or plan,
                                           delta=DELTA)


def test_the_tap_records_each_steps_clipped_canaries_exactly():
    """Without noise, step t's projection of canary j is 1 (C) when it is in and sampled, else
    exactly 0; the model never sees the block (its gradient is norm e_j, clipped to C). The
    book-keeping clipper clips to an upper bound of the float32 norm (`dp.bookkeeping`), so 1
    holds to a relative 5e-6."""
    images, labels = _data()
    canaries = GradientCanaries.draw(40, np.random.default_rng(3))
    plan = accounting.DpPlan(0.0, 5, 0.5, 0.25)
    spec = finetune.FinetuneSpec(3, learning_rate=0.1, ema_decay=None)
    sampled = []

    def rng_copy():
        return np.random.default_rng(11)

    result = finetune.train_finetune(Tiny(nnx.Rngs(0)), images, labels, plan, spec,
                                     canaries=canaries, rng=rng_copy(), keys=fixed_keys(2, 0))
    rng = rng_copy()
    for _ in range(5):  # as the trainer draws them: one step at a time from its sampler
        batch = next(dp.poisson_batches(REAL + 40, [0.5], [1], 64, rng))
        rows = batch.index[:, 0][batch.mask[:, 0] > 0]
        chosen = np.zeros(40, bool)
        chosen[rows[rows >= REAL] - REAL] = True
        sampled.append(chosen & canaries.included)
    expected = np.array(sampled, np.float32)
    np.testing.assert_allclose(result.canary_projections, expected, rtol=5e-6, atol=0)
    assert (result.canary_projections[expected == 0] == 0).all()


def test_bound_and_estimate_on_the_exact_mechanism():
    """Projections drawn as the claim says: the estimate lies within [0.6, 1.4] of the claim
    and the bound below it; with the noise halved, the bound refutes it."""
    rng = np.random.default_rng(5)
    plan = _plan(2.0, steps=300)
    canaries = GradientCanaries.draw(CANARIES, rng)
    for noise, refuted in ((1.0, False), (0.5, True)):
        sampled = (rng.random((plan.steps, CANARIES)) < plan.sampling_probability)
        z = sampled * canaries.included + noise * plan.noise_multiplier * rng.standard_normal(
            (plan.steps, CANARIES))
        audit = audit_gradient_canaries(z, canaries, plan, delta=DELTA)
        assert audit.refuted is refuted, audit
        if not refuted:
            assert 0.1 * audit.claimed_epsilon <= audit.epsilon_lower <= audit.claimed_epsilon
            assert 0.6 <= audit.epsilon_estimate / audit.claimed_epsilon <= 1.4, audit
        else:
            assert audit.epsilon_estimate > 2 * audit.claimed_epsilon


@pytest.mark.slow
def test_correct_runs_are_never_refuted():
    """30 audited runs of the real trainer at epsilon 2 (100 steps at q = 0.05, to be quick):
    no bound above the claim, and the estimate near it."""
    plan = _plan(2.0, steps=100, batch=256)
    bounds = [_audited(plan)[1] for _ in range(30)]
    assert max(a.epsilon_lower for a in bounds) <= plan.epsilon(DELTA)
    estimates = np.array([a.epsilon_estimate for a in bounds]) / plan.epsilon(DELTA)
    assert 0.6 <= np.median(estimates) <= 1.4, estimates


@pytest.fixture
def recompiled():
    """A fault patched into traced code needs fresh programs (and leaves none behind)."""
    jax.clear_caches()
    yield
    jax.clear_caches()


@pytest.mark.slow
@pytest.mark.usefixtures("recompiled")
def test_halved_noise_is_refuted(monkeypatch):
    original = dp.noise.gaussian_noise
    monkeypatch.setattr(dp.noise, "gaussian_noise",
                        lambda key, size, *dtype: 0.5 * original(key, size, *dtype))
    audit = _audited(_plan(2.0))[1]
    assert audit.refuted, audit


@pytest.mark.slow
@pytest.mark.usefixtures("recompiled")
def test_unclipped_canaries_are_refuted(monkeypatch):
    """A clipper that clips real rows but lets canary rows through unclipped."""
    original = finetune_batch_sums.bookkeeping_clipper

    def broken(*args, **kwargs):
        clipper = original(*args, **kwargs)

        def clip(params, batch, clip_norm, mask):
            canary = (batch[2] >= REAL).astype(mask.dtype)
            real = clipper(params, batch, clip_norm, mask * (1 - canary))
            loose = clipper(params, batch, jnp.inf * clip_norm, mask * canary)
            return dp.ClippedSum(jax.tree.map(jnp.add, real.grads, loose.grads), real.norms)

        return clip

    monkeypatch.setattr(finetune_batch_sums, "bookkeeping_clipper", broken)
    audit = _audited(_plan(2.0))[1]
    assert audit.refuted and audit.fitted["signal"] > 100, audit


@pytest.mark.slow
def test_a_misreported_sampling_rate_is_refuted():
    """sigma calibrated (and epsilon claimed) for q / 10 while the sampler draws at q."""
    plan = _plan(1.0, q_claimed=(100 / (REAL + CANARIES)) / 10)
    claim = accounting.DpPlan(plan.noise_multiplier, plan.steps, plan.sampling_probability / 10,
                              plan.clip_norm)
    audit = _audited(plan, claim)[1]
    assert audit.refuted, audit
    assert audit.fitted["sampling_probability"] > 5 * claim.sampling_probability


@pytest.mark.parametrize("clipping", ["bookkeeping", "per_example"])
def test_the_canaries_do_not_read_a_real_records_image(clipping):
    """A canary row's image is a public zero image: the last real record's image being NaN (a
    null record either way) leaves every step's canary sums as they are (it once nulled them
    all: their rows borrowed that image)."""
    images, labels = _data()
    canaries = GradientCanaries.draw(12, np.random.default_rng(3))
    plan = accounting.DpPlan(0.0, 4, 0.5, 0.25)
    spec = finetune.FinetuneSpec(3, learning_rate=0.1, ema_decay=None)
    flags = finetune.FinetuneFlags(physical_batch_size=32, clipping=clipping)
    projections = []
    for last in (np.zeros_like(images[-1]), np.full_like(images[-1], np.nan)):
        images[-1] = last
        result = finetune.train_finetune(Tiny(nnx.Rngs(0)), images, labels.copy(), plan, spec,
                                         canaries=canaries, rng=np.random.default_rng(11),
                                         keys=fixed_keys(2, 0), flags=flags)
        projections.append(result.canary_projections)
    assert projections[0].sum() >= 4  # canaries were sampled and counted
    np.testing.assert_array_equal(projections[0], projections[1])
