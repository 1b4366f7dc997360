"""Rows sharded over devices give the one-device result."""

import subprocess
import sys
import textwrap

SHARDED_SCRIPT = textwrap.dedent("""
    import os
    flags = os.environ.get("XLA_FLAGS", "")  # the tests' own (tests/conftest.py), then:
    os.environ["XLA_FLAGS"] = flags + " --xla_force_host_platform_device_count=4"
    import math, numpy as np, jax
    from dpprobe import accounting, probe
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
    sharded = probe.train_probe(x, y, runs, keys, spec,
                                flags=probe.PerformanceFlags(mesh=mesh))
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
