"""The `dpprobe` CLI end to end on small real data (digits)."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

import accounting
from pipelines import cli


def _dpprobe(*args):
    return subprocess.run([sys.executable, "-m", "pipelines.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_account_both_directions(capsys):
    assert cli.main(["account", "--epsilon", "1", "--delta", "1e-5", "--steps", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["noise_multiplier"] == pytest.approx(
        accounting.calibrate_noise_multiplier(1.0, 1e-5, steps=4))
    assert out["epsilon"] == pytest.approx(1.0, abs=1e-3)
    assert out["neighboring_relation"] == "zero_out" and out["accountant"] == "pld"
    assert cli.main(["account", "--sigma", str(out["noise_multiplier"]), "--steps", "4"]) == 0
    assert "epsilon 1" in capsys.readouterr().out


def test_account_rejects_impossible_requests(capsys):
    assert cli.main(["account", "--epsilon", "-1"]) == 2
    assert "--epsilon: must be > 0 (or inf for non-private), got -1" in capsys.readouterr().err
    assert cli.main(["account", "--epsilon", "1", "--delta", "2"]) == 2
    assert "--delta: must be in (0, 1), got 2" in capsys.readouterr().err


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


def test_fresh_cli_process_equals_the_in_process_job(digits_store, tmp_path):
    """A fresh `dpprobe probe` reads the store in a forked child while it imports JAX; this
    process has JAX loaded, so `run_probe` reads in threads here. The non-private reference
    has no noise, so the two must agree exactly."""
    from pipelines import run_probe

    out = tmp_path / "cli.json"
    args = dict(epsilons=[math.inf], delta=1e-5, seeds=2, optimizer="adam")
    result = _dpprobe("probe", digits_store, "--epsilons", "inf", "--delta", "1e-5",
                      "--seeds", "2", "--optimizer", "adam", "--out", str(out), "--quiet")
    assert result.returncode == 0, result.stderr
    fresh = json.loads(out.read_text())["runs"]
    here = run_probe(digits_store, quiet=True, **args)["runs"]
    assert [r["test_accuracy"] for r in fresh] == [r["test_accuracy"] for r in here]
    assert [str(r["epsilon_spent"]) for r in fresh] == [str(r["epsilon_spent"]) for r in here]


def test_probe_errors_are_one_line(tmp_path, digits_store):
    result = _dpprobe("probe", str(tmp_path / "missing.zarr"))
    assert result.returncode == 2 and "no feature store" in result.stderr
    assert "Traceback" not in result.stderr
    result = _dpprobe("probe", digits_store, "--epsilons", "0,1")
    assert result.returncode == 2 and "epsilon must be > 0" in result.stderr


def test_extract_cli_and_single_split_sources(tmp_path, rng):
    images = rng.integers(0, 256, size=(12, 8, 8), dtype=np.uint8)
    np.savez(tmp_path / "a.npz", images=images, labels=np.arange(12) % 3)
    store = str(tmp_path / "s.zarr")
    for split in ("train", "test"):
        assert cli.main(["extract", "--backbone", "scatternet", "--data",
                         f"npz:{tmp_path / 'a.npz'}", "--num-classes", "3", "--split", split,
                         "--out", store,
                         "--quiet"]) == 0
    from extract import store_summary

    summary = store_summary(store)
    assert set(summary["splits"]) == {"train", "test"}
    assert all(s["complete"] for s in summary["splits"].values())


def test_demo_on_digits(tmp_path, capsys):
    assert cli.main(["demo", "--data", "digits", "--out", str(tmp_path), "--quiet",
                     "--seeds", "2"]) == 0
    table = capsys.readouterr().out
    assert "inf" in table
    results = json.loads((tmp_path / "results.json").read_text())
    assert {r["epsilon"] for r in results["runs"]} == {0.5, 1.0, 2.0, 4.0, 8.0, "inf"}
    assert all(math.isfinite(r["test_accuracy"]) for r in results["runs"])


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
