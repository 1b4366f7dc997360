"""The probe job: the epsilon sweep on a store, its drivers, its records and its config."""

import json
import math

import numpy as np
import pytest

from dpprobe import accounting
from dpprobe.checks import ConfigError
from dpprobe.pipelines import ProbeConfig, cli, run_probe


def test_probe_writes_results_json(digits_store, tmp_path, capsys):
    out = tmp_path / "results.json"
    code = cli.main(["probe", digits_store, "--epsilons", "1,8,inf", "--delta", "1e-5",
                     "--seeds", "2", "--optimizer", "momentum", "--steps", "20", "--lr", "3",
                     "--normalize", "group", "--groups", "27", "--out", str(out), "--quiet"])
    assert code == 0
    table = capsys.readouterr().out
    assert "test acc %" in table and "PLD" in table
    results = json.loads(out.read_text())
    assert len(results["runs"]) == 6
    required = {"epsilon", "delta", "noise_multiplier", "steps", "optimizer", "learning_rate",
                "replicate", "test_accuracy", "accountant", "guarantee"}
    for run in results["runs"]:
        assert required <= set(run)
        if run["epsilon"] != "inf":
            assert run["epsilon_spent"] == pytest.approx(run["epsilon"], abs=1e-3)
            sigma = accounting.calibrate_noise_multiplier(run["epsilon"], 1e-5, steps=20)
            assert run["noise_multiplier"] == pytest.approx(sigma)
        else:
            assert run["noise_multiplier"] == 0
    assert results["privacy"]["neighboring_relation"] == "zero_out"
    assert results["provenance"]["train"]["backbone"]["name"] == "scatternet"
    assert results["provenance"]["train"]["dataset"]["name"] == "digits"
    acc = {r["epsilon"]: r["test_accuracy"] for r in results["runs"]}
    # ScatterNet + linear on digits: well above chance (10%) privately, ~95% without DP.
    assert acc["inf"] > 0.9 and acc[8.0] > 0.6


def test_probe_streamed_equals_in_memory_and_writes_csv_and_plot(digits_store, tmp_path):
    # Without noise the two drivers must agree (with noise: test_engine, same keys).
    common = ["probe", digits_store, "--epsilons", "inf", "--seeds", "2",
              "--optimizer", "adam", "--steps", "3", "--lr", "0.01", "--quiet"]
    assert cli.main([*common, "--in-memory", "--out", str(tmp_path / "a.json")]) == 0
    assert cli.main([*common, "--stream", "--out", str(tmp_path / "b.json"),
                     "--csv", str(tmp_path / "b.csv"), "--plot", str(tmp_path / "b.png")]) == 0
    a = json.loads((tmp_path / "a.json").read_text())
    b = json.loads((tmp_path / "b.json").read_text())
    assert "streamed" in b["probe"]["driver"] and "in memory" in a["probe"]["driver"]
    for ra, rb in zip(a["runs"], b["runs"], strict=True):
        assert ra["test_accuracy"] == pytest.approx(rb["test_accuracy"], abs=1 / 359 + 1e-9)
    lines = (tmp_path / "b.csv").read_text().splitlines()
    assert lines[0].startswith("epsilon,epsilon_spent,delta") and len(lines) == 3
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_probe_poisson_mode_records_the_sampled_mechanism(digits_store, tmp_path):
    out, diagnostics = tmp_path / "p.json", tmp_path / "diag.json"
    assert cli.main(["probe", digits_store, "--epsilons", "4", "--seeds", "1", "-q", "0.25",
                     "--steps", "8", "--optimizer", "momentum", "--lr", "1",
                     "--physical-batch-size", "64", "--out", str(out), "--quiet",
                     "--diagnostics", str(diagnostics)]) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["sampling_probability"] == 0.25
    assert run["dp_event"]["event"]["type"] == "PoissonSampledDpEvent"
    assert run["epsilon_spent"] <= 4.0 + 1e-9
    # The sampled batch sizes are private: only in the local diagnostics file.
    assert "batch_size" not in out.read_text().replace("physical_batch_size", "")
    local = json.loads(diagnostics.read_text())
    assert local["warning"].startswith("PRIVATE")
    sizes = local["runs"][0]["batch_sizes"]
    assert len(sizes) == 8
    assert abs(np.mean(sizes) - 0.25 * 1438) < 5 * math.sqrt(1438 * 0.25 * 0.75 / 8)


def test_run_probe_takes_its_config_or_keywords(digits_store):
    """Without noise (epsilon inf) the two calls must agree exactly."""
    options = dict(epsilons=[math.inf], seeds=1, optimizer="sgd", steps=[2], quiet=True)
    config = ProbeConfig(digits_store, **options)
    assert config.epsilons == (math.inf,) and config.steps == (2,)  # sequences made tuples
    by_config = run_probe(config)["runs"]
    by_keywords = run_probe(digits_store, **options)["runs"]
    assert [r["test_accuracy"] for r in by_config] == [r["test_accuracy"] for r in by_keywords]
    with pytest.raises(TypeError, match="not both"):
        run_probe(config, seeds=2)


@pytest.mark.parametrize(("options", "match"), [
    (dict(epsilons=[1, -1]), "each epsilon must be > 0"),
    (dict(epsilons=[]), "epsilons: expected at least one number"),
    (dict(delta=1.0), r"delta: must be in \(0, 1\), got 1"),
    (dict(steps=[0]), r"steps: each must be in \[1, 10000000\], got 0"),
    (dict(learning_rates=[math.inf]), "learning_rates: expected finite numbers > 0"),
    (dict(clip_norm=math.inf), "clip_norm: expected a finite number, got inf"),
    (dict(sampling_probability=0), r"sampling_probability: must be in \(0, 1\]"),
    (dict(seeds=0), "seeds: must be >= 1, got 0"),
    (dict(groups=4, normalization="l2"), "`groups=4` needs `normalization=group`"),
    (dict(learning_rates=[1, 2, 1]), "learning_rates: 1 given more than once"),
    (dict(seeds=10**6, epsilons=[1, 2]), "the sweep has 2000000 runs"),
])
def test_probe_config_checks_every_value_once(options, match):
    with pytest.raises(ValueError, match=match):
        ProbeConfig("store.zarr", **options)
    assert ProbeConfig("store.zarr", normalization="group", groups=4).groups == 4
    assert ProbeConfig("store.zarr", groups=4).normalization == "group"  # as for tune
    assert isinstance(ConfigError("delta", "x"), ValueError)
