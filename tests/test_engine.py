"""The probe engine's drivers agree: streamed, sharded, Poisson, sign-SGD vs Adam."""

import logging
import math
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import accounting
import probe
from tests.conftest import fixed_keys, random_problem


def _runs(epsilons, steps, lr, q=1.0, delta=1e-5):
    out = []
    for eps in epsilons:
        sigma = accounting.calibrate_noise_multiplier(eps, delta, steps=steps,
                                                      sampling_probability=q)
        plan = accounting.DpPlan(sigma, steps, q, clip_norm=1.0 if sigma > 0 else math.inf)
        out.append(probe.RunSpec(plan, lr))
    return out


@pytest.mark.parametrize("views", [None, 3])
def test_streamed_chunks_equal_in_memory(rng, views):
    features, labels, _ = random_problem(rng, n=203, d=10, c=4, views=views)
    spec = probe.ProbeSpec(4, optimizer="adam", normalization="l2")
    runs = _runs([0.5, 4.0, math.inf], steps=4, lr=0.05) + _runs([1.0], steps=2, lr=0.1)
    keys = fixed_keys(len(runs), 5)
    memory = probe.train_probe(features, labels, runs, keys, spec)

    def chunks():
        for start in range(0, len(labels), 64):  # 4 chunks, the last one short (11 rows)
            yield features[start:start + 64], labels[start:start + 64]

    streamed = probe.train_probe_streaming(chunks, runs, keys, spec, num_examples=len(labels),
                                           dim=10)
    for key in ("w", "b"):
        np.testing.assert_allclose(streamed.params[key], memory.params[key], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(streamed.clipped_fraction, memory.clipped_fraction, rtol=1e-6)


def test_streaming_from_a_zarr_store_equals_in_memory(tmp_path, rng):
    import extract

    features, labels, _ = random_problem(rng, n=150, d=6, c=3)
    writer = extract.SplitWriter(
        str(tmp_path / "s.zarr"), "train", num_rows=150, feature_shape=(6,), dtype="float32",
        provenance={"backbone": {"name": "x"}, "dataset": {"name": "y", "num_classes": 3}},
        rows_per_chunk=64,
    )
    for chunk in writer.pending_chunks():
        a, b = writer.chunk_rows(chunk)
        writer.write_chunk(chunk, features[a:b], labels[a:b])
    writer.finalize()
    spec = probe.ProbeSpec(3, optimizer="momentum")
    runs = _runs([2.0], steps=3, lr=0.5)
    keys = fixed_keys(1, 2)
    streamed = probe.train_probe_streaming(
        lambda: extract.iter_split_chunks(str(tmp_path / "s.zarr"), "train"), runs, keys, spec,
        num_examples=150, dim=6,
    )
    memory = probe.train_probe(features, labels, runs, keys, spec)
    np.testing.assert_allclose(streamed.params["w"], memory.params["w"], rtol=1e-4, atol=1e-6)


def test_streaming_checks_the_row_count(rng):
    features, labels, _ = random_problem(rng, n=40, d=4, c=3)
    with pytest.raises(ValueError, match="held 40 rows, expected 41"):
        probe.train_probe_streaming(lambda: [(features, labels)], _runs([1.0], 1, 0.1),
                                    probe.make_keys(1), probe.ProbeSpec(3), num_examples=41,
                                    dim=4)


SHARDED_SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import math, numpy as np, jax
    import accounting, probe
    assert jax.device_count() == 4, jax.devices()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(103, 9)).astype(np.float32)   # not a multiple of 4: padded + masked
    y = rng.integers(0, 5, size=103)
    runs = []
    for eps in (1.0, 8.0, math.inf):
        s = accounting.calibrate_noise_multiplier(eps, 1e-5, steps=3)
        runs.append(probe.RunSpec(accounting.DpPlan(s, 3, clip_norm=1.0 if s else math.inf), 0.1))
    spec = probe.ProbeSpec(5, optimizer="adam")
    keys = jax.random.split(jax.random.key(4), 3)
    mesh = jax.make_mesh((4,), ("data",))
    sharded = probe.train_probe(x, y, runs, keys, spec, mesh=mesh)
    single = probe.train_probe(x, y, runs, keys, spec)
    np.testing.assert_allclose(sharded.params["w"], single.params["w"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(sharded.params["b"], single.params["b"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(sharded.clipped_fraction, single.clipped_fraction)
    print("SHARDED_OK", float(np.abs(sharded.params["w"]).max()))
""")


def test_four_device_sharded_step_equals_one_device():
    result = subprocess.run([sys.executable, "-c", SHARDED_SCRIPT], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "SHARDED_OK" in result.stdout


def test_poisson_masked_step_never_recompiles_and_samples_q_n(rng, caplog):
    features, labels, _ = random_problem(rng, n=500, d=8, c=3)
    q, steps = 0.1, 60
    runs = _runs([2.0, 4.0], steps=steps, lr=0.1, q=q)
    spec = probe.ProbeSpec(3, optimizer="sgd")
    # Warm up: compile once.
    probe.train_probe_poisson(features, labels, runs, probe.make_keys(2), spec,
                              physical_batch_size=16)
    caplog.clear()
    with caplog.at_level(logging.WARNING), jax.log_compiles(True):
        result = probe.train_probe_poisson(features, labels, runs, probe.make_keys(2), spec,
                                           physical_batch_size=16)
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
    runs = _runs([1.0, math.inf], steps=3, lr=0.3)
    keys = fixed_keys(2, 9)
    poisson = probe.train_probe_poisson(features, labels, runs, keys, spec,
                                        physical_batch_size=32)
    full = probe.train_probe(features, labels, runs, keys, spec)
    assert (poisson.batch_sizes == 90).all()
    np.testing.assert_allclose(poisson.params["w"], full.params["w"], rtol=1e-4, atol=1e-6)


def test_poisson_accounting_is_the_poisson_sampled_gaussian():
    run = _runs([1.0], steps=50, lr=0.1, q=0.05)[0]
    event = run.plan.dp_event()
    assert "PoissonSampledDpEvent" in repr(event)
    assert run.plan.epsilon(1e-5) == pytest.approx(1.0, abs=1e-3)


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
