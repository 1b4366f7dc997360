"""Stored probe programs (`probe.programs`): the executable loaded from disk computes exactly
what the traced program computes, and is used only where it is turned on."""

import math
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from dpprobe import accounting, probe
from dpprobe.probe import programs
from tests.conftest import fixed_keys, random_problem


def _sweep(rng):
    features, labels, _ = random_problem(rng, n=96, d=8, c=3)
    runs = []
    for epsilon in (0.5, 2.0, math.inf):
        sigma = accounting.calibrate_noise_multiplier(epsilon, 1e-5, steps=3)
        runs.append(probe.RunSpec(accounting.DpPlan(sigma, 3, clip_norm=1.0), 0.05))
    return features, labels, runs, fixed_keys(len(runs), 5), probe.ProbeSpec(3, optimizer="adam")


def _train_and_evaluate(features, labels, runs, keys, spec):
    result = probe.train_probe(features, labels, runs, keys, spec)
    metrics = probe.evaluate_chunks(result.params, [(features[:40], labels[:40])], top_k=2,
                                    block_rows=16)
    return result, metrics


def _assert_bitwise_equal(one, other):
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(other), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a.view(f"u{a.dtype.itemsize}"),
                                      b.view(f"u{b.dtype.itemsize}"))


@pytest.fixture
def store(tmp_path, monkeypatch):
    """Stored programs turned on, in a folder of their own; none loaded in this process."""
    monkeypatch.setenv(programs.ENV, "1")
    monkeypatch.setattr(programs, "_LOADED", {})
    was = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    yield tmp_path / "dpprobe-programs"
    jax.config.update("jax_compilation_cache_dir", was)


def _count_loads(monkeypatch):
    loads = []
    load = programs.serialize_executable.deserialize_and_load

    def counted(*args, **kwargs):
        loads.append(1)
        return load(*args, **kwargs)

    monkeypatch.setattr(programs.serialize_executable, "deserialize_and_load", counted)
    return loads


def test_a_stored_program_computes_bit_for_bit_what_the_traced_one_does(rng, store,
                                                                        monkeypatch):
    problem = _sweep(rng)
    with monkeypatch.context() as off:
        off.setenv(programs.ENV, "0")
        traced = _train_and_evaluate(*problem)
    assert not store.exists()
    compiled = _train_and_evaluate(*problem)  # compiled here and stored
    # first step, later steps, the evaluation's logits and counts
    assert len(list(store.iterdir())) == 4
    monkeypatch.setattr(programs, "_LOADED", {})  # a new process: read from disk
    loads = _count_loads(monkeypatch)
    loaded = _train_and_evaluate(*problem)
    assert len(loads) == 4
    _assert_bitwise_equal((traced[0].params, traced[1]), (compiled[0].params, compiled[1]))
    _assert_bitwise_equal((traced[0].params, traced[1]), (loaded[0].params, loaded[1]))
    np.testing.assert_array_equal(traced[0].clipped_fraction, loaded[0].clipped_fraction)


def test_other_shapes_or_static_arguments_are_other_programs(rng, store):
    features, labels, runs, keys, spec = _sweep(rng)
    probe.train_probe(features, labels, runs[:1], keys[:1], spec)
    first = set(store.iterdir())
    probe.train_probe(features, labels, runs[:2], keys[:2], spec)  # two runs: other shapes
    second = set(store.iterdir())
    probe.train_probe(features, labels, runs[:1], keys[:1],
                      probe.ProbeSpec(3, optimizer="momentum"))
    assert first < second < set(store.iterdir())


def test_a_damaged_entry_is_compiled_again_and_replaced(rng, store, monkeypatch):
    problem = _sweep(rng)
    expected = _train_and_evaluate(*problem)
    for entry in store.iterdir():
        entry.write_bytes(b"not a program")
    monkeypatch.setattr(programs, "_LOADED", {})
    again = _train_and_evaluate(*problem)
    _assert_bitwise_equal((expected[0].params, expected[1]), (again[0].params, again[1]))
    monkeypatch.setattr(programs, "_LOADED", {})
    loads = _count_loads(monkeypatch)
    _train_and_evaluate(*problem)
    assert len(loads) == 4  # the replaced entries load


def test_nothing_is_stored_unless_turned_on_with_a_cache_folder(rng, store, monkeypatch):
    problem = _sweep(rng)
    monkeypatch.delenv(programs.ENV)
    _train_and_evaluate(*problem)
    monkeypatch.setenv(programs.ENV, "1")
    jax.config.update("jax_compilation_cache_dir", None)
    _train_and_evaluate(*problem)
    assert not store.exists()


def test_programs_found_in_jax_cache_are_compiled_afresh_before_they_are_stored(digits_store,
                                                                                 tmp_path):
    """After a change to the package's sources (an upgrade) the stored programs' keys are new,
    but JAX's persistent cache still holds their executables (here: the stored ones removed).
    They are compiled again, not re-serialized from JAX's cache: XLA:CPU drops their kernels
    then, and the next `dpprobe probe` failed ("Function wrapped_is-finite not found"). Three
    processes of the command, with its own cache folder and code generation."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COMPILATION_CACHE_DIR", "XLA_FLAGS", programs.ENV)}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    command = [sys.executable, "-c", "from dpprobe.pipelines.cli import entry; entry()",
               "probe", digits_store, "--epsilons", "3", "--seeds", "1", "--steps", "3",
               "--out", str(tmp_path / "r.json"), "--quiet"]
    for run in range(3):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (run, done.stderr[-2000:])
        if run == 0:
            shutil.rmtree(tmp_path / "cache" / "dpprobe" / "jax" / "dpprobe-programs")
