"""Poisson-sampled masked DP-SGD: batch sizes, no recompilation, q = 1 is full batch."""

import logging
import math

import jax
import numpy as np
import pytest

from dpprobe import dp, probe
from tests.conftest import calibrated_runs, fixed_keys, random_problem


def test_poisson_masked_step_never_recompiles_and_samples_q_n(rng, caplog):
    features, labels, _ = random_problem(rng, n=500, d=8, c=3)
    q, steps = 0.1, 60
    runs = calibrated_runs([2.0, 4.0], steps=steps, lr=0.1, q=q)
    spec = probe.ProbeSpec(3, optimizer="sgd")
    # Warm up: compile once.
    probe.train_probe_poisson(features, labels, runs, dp.make_keys(2), spec,
                              flags=probe.PerformanceFlags(physical_batch_size=16))
    caplog.clear()
    with caplog.at_level(logging.WARNING), jax.log_compiles(True):
        result = probe.train_probe_poisson(features, labels, runs, dp.make_keys(2), spec,
                                           flags=probe.PerformanceFlags(physical_batch_size=16))
    compiles = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
    assert compiles == [], compiles
    sizes = result.batch_sizes
    assert sizes.shape == (steps, 2)
    assert len(np.unique(sizes)) > 5  # the logical batch size really varied
    # Binomial(N, q): mean q N = 50, std of the mean sqrt(N q (1-q) / (steps * runs)).
    tolerance = 5 * math.sqrt(500 * q * (1 - q) / sizes.size)
    assert abs(sizes.mean() - q * 500) < tolerance


def test_poisson_with_q_one_is_full_batch(rng):
    features, labels, _ = random_problem(rng, n=90, d=6, c=3)
    spec = probe.ProbeSpec(3, optimizer="momentum")
    runs = calibrated_runs([1.0, math.inf], steps=3, lr=0.3)
    keys = fixed_keys(2, 9)
    poisson = probe.train_probe_poisson(features, labels, runs, keys, spec,
                                        flags=probe.PerformanceFlags(physical_batch_size=32))
    full = probe.train_probe(features, labels, runs, keys, spec)
    assert (poisson.batch_sizes == 90).all()
    np.testing.assert_allclose(poisson.params["w"], full.params["w"], rtol=1e-4, atol=1e-6)


def test_poisson_accounting_is_the_poisson_sampled_gaussian():
    run = calibrated_runs([1.0], steps=50, lr=0.1, q=0.05)[0]
    event = run.plan.dp_event()
    assert "PoissonSampledDpEvent" in repr(event)
    assert run.plan.epsilon(1e-5) == pytest.approx(1.0, abs=1e-3)
