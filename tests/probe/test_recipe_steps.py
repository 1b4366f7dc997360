"""The probe recipe's default step count, chosen from public quantities: T = 300 up to the
size it was measured at, then the steps that fit the time budget on this device, down to
Mehta et al.'s single step; the estimate is printed, and the choice reads no private data."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dpprobe import extract
from dpprobe.pipelines import ProbeConfig, cli
from dpprobe.probe import cost, recipe

SCATTERNET = {"backbone": {"name": "scatternet", "coefficients_per_channel": 81}}


def _steps(n, d, c, runs, platform="cpu", cores=2, **kwargs):
    estimate = cost.step_cost(n, d, c, runs, platform=platform, cores=cores, **kwargs)
    return recipe.default_steps(n, estimate)[0], estimate


def test_the_step_cost_is_n_d_c_runs_over_the_device_rate():
    estimate = cost.step_cost(200_000, 512, 10, 15, platform="cpu", cores=2)
    assert estimate.step_seconds == pytest.approx(200_000 * 512 * 10 * 15
                                                  / (2 * cost.CPU_RATE_PER_CORE))
    read = 200_000 * 512 * 2 / cost.READ_BYTES_PER_SECOND
    assert estimate.start_seconds == pytest.approx(cost.START_SECONDS + read)
    assert estimate.seconds(10) == pytest.approx(estimate.start_seconds
                                                 + 10 * estimate.step_seconds)
    # Streamed from disk, every step reads the store again.
    streamed = cost.step_cost(200_000, 512, 10, 15, platform="cpu", cores=2, streamed=True)
    assert streamed.step_seconds == pytest.approx(estimate.step_seconds + read)
    # Twice the cores or an accelerator: faster steps.
    assert cost.step_cost(200_000, 512, 10, 15, platform="cpu", cores=4).step_seconds == (
        pytest.approx(estimate.step_seconds / 2))
    assert cost.step_cost(200_000, 512, 10, 15, platform="gpu", cores=2).step_seconds < (
        estimate.step_seconds / 10)


def test_t_is_300_up_to_the_measured_size_whatever_it_costs():
    for n, d in ((1_438, 324), (60_000, 3_969), (recipe.MEASURED_ROWS, 10**5)):
        steps, estimate = _steps(n, d, 10, 21)
        assert steps == recipe.PROBE_STEPS
    assert estimate.seconds(300) > 60  # Fashion-MNIST-sized: minutes, kept (module docstring)


def test_beyond_it_t_fits_the_budget_and_falls_to_one_step_as_n_grows():
    previous = recipe.PROBE_STEPS
    for n in (80_000, 200_000, 500_000, 1_000_000, 1_281_167):
        steps, estimate = _steps(n, 1024, 10, 15)
        assert 1 <= steps <= previous  # never more steps for more rows
        assert steps * estimate.step_seconds <= recipe.STEP_SECONDS_BUDGET
        # the largest such T: one more step would not fit
        assert (steps + 1) * estimate.step_seconds > recipe.STEP_SECONDS_BUDGET
        previous = steps
    # The shapes on 2 cores: 200,000 x 512 x 10 (15 runs) within about a minute,
    # 10^6 x 1024 x 10 too, and ImageNet's shape at a single step.
    steps, estimate = _steps(200_000, 512, 10, 15)
    assert 10 <= steps < 300 and estimate.seconds(steps) <= 60
    steps, estimate = _steps(10**6, 1024, 10, 15)
    assert 1 <= steps < 10 and estimate.seconds(steps) <= 60
    assert _steps(1_281_167, 1280, 1000, 15)[0] == 1
    # A small store that is cheap keeps T = 300 past the measured size.
    assert _steps(70_000, 16, 2, 1)[0] == recipe.PROBE_STEPS


def test_the_recipe_takes_the_steps_says_why_and_prints_the_expected_time():
    estimate = cost.step_cost(200_000, 512, 10, 15, platform="cpu", cores=2)
    chosen = recipe.probe_recipe(ProbeConfig(store="s.zarr"), SCATTERNET, 200_000, estimate)
    steps = recipe.default_steps(200_000, estimate)[0]
    assert chosen.steps == (steps,) and steps < recipe.PROBE_STEPS
    line = chosen.describe([1.0])
    assert f"T = {steps} [the steps that fit 30 s at N = 200,000 (at most 300)]" in line
    assert "expected time about" in line and "cpu, 2 cores" in line
    # lr = r / T, capped: the linear scaling rule with the chosen T.
    assert chosen.learning_rate(1.0, steps) == pytest.approx(
        min(recipe.total_step_size(1.0, 1e-5, 200_000) / steps, recipe.MAX_LEARNING_RATE))
    # One step at ImageNet's shape, said so.
    huge = cost.step_cost(1_281_167, 1280, 1000, 15, platform="cpu", cores=2)
    single = recipe.probe_recipe(ProbeConfig(store="s.zarr"), {}, 1_281_167, huge)
    assert single.steps == (1,) and "Mehta et al." in single.describe([1.0])
    # Given steps, another optimizer, or Poisson sampling: the cost does not choose T.
    assert recipe.probe_recipe(ProbeConfig(store="s.zarr", steps=(300,)), {}, 200_000,
                               estimate).steps == (300,)
    assert recipe.probe_recipe(ProbeConfig(store="s.zarr", optimizer="adam"), {}, 200_000,
                               estimate).steps == (1,)
    assert recipe.probe_recipe(ProbeConfig(store="s.zarr", sampling_probability=0.1), {},
                               200_000, estimate).steps == (300,)
    # Without a cost estimate (the library's callers), T = 300 as before.
    assert recipe.probe_recipe(ProbeConfig(store="s.zarr"), {}, 200_000).steps == (300,)


def _store(path, features, labels):
    provenance = {"backbone": {"name": "synthetic"},
                  "dataset": {"name": "synthetic", "num_classes": 3}}
    for split, rows in (("train", slice(0, 200)), ("test", slice(200, 260))):
        writer = extract.SplitWriter(str(path), split, num_rows=rows.stop - rows.start,
                                     feature_shape=(features.shape[1],), dtype="float32",
                                     provenance=provenance)
        for chunk in writer.pending_chunks():
            start, stop = writer.chunk_rows(chunk)
            writer.write_chunk(chunk, features[rows][start:stop], labels[rows][start:stop])
        assert writer.finalize()
    return str(path)


def test_the_default_steps_read_no_feature_or_label(tmp_path, monkeypatch, capsys):
    """Two stores of the same public shapes, with different features and labels (one with
    rows of huge norm, one label everywhere), get the same recipe line and the same recorded
    recipe, with the budget binding (the measured size and the rate made small, so that
    T < 300 here)."""
    monkeypatch.setattr(recipe, "MEASURED_ROWS", 10)
    monkeypatch.setattr(cost, "CPU_RATE_PER_CORE", 2_000.0)
    rng = np.random.default_rng(0)
    plain = rng.normal(size=(260, 8)).astype(np.float32)
    hostile = rng.normal(size=(260, 8)).astype(np.float32)
    hostile[::7] = 1e30  # (the store writer refuses NaN)
    stores = [_store(tmp_path / "a.zarr", plain, rng.integers(0, 3, 260)),
              _store(tmp_path / "b.zarr", hostile, np.zeros(260, np.int64))]
    lines, recipes = [], []
    for store in stores:
        out = tmp_path / (store[-6] + ".json")
        assert cli.main(["probe", store, "--epsilons", "1", "--seeds", "2", "--out",
                         str(out)]) == 0
        lines.append(capsys.readouterr().err.splitlines()[0])
        recipes.append(json.loads(out.read_text())["recipe"])
    assert lines[0] == lines[1] and recipes[0] == recipes[1]
    steps = recipes[0]["steps"][0]
    assert 1 <= steps < recipe.PROBE_STEPS
    assert f"T = {steps} [the steps that fit" in lines[0] and "expected time about" in lines[0]
