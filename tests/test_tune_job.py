"""The tune job: the linear-scaling search on a store, its ledger, its config, its outputs."""

import json
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import pld

from pipelines import TuneConfig, cli, run_tune, tune_job
from pipelines.config import ConfigError


@pytest.mark.parametrize("selection", ["train", "holdout"])
def test_search_total_epsilon_is_at_most_the_request(digits_store, selection):
    """Every mechanism, the private selection included, is in the ledger, and dp_accounting
    composing the same events independently (per disjoint part) gives the requested total."""
    result = tune_job.linear_scaling_search(
        digits_store, 2.0, 1e-5, trials=3, r_range=(1, 100), steps_choices=(5, 10),
        normalization="group", groups=27, selection=selection, seed=0, quiet=True,
    )
    ledger = result["ledger"]
    # 2 stages x (3 trials + their noisy counts) + the final run
    assert ledger["num_mechanisms"] == 9
    assert sum(e["role"] == "selection" for e in ledger["entries"]) == 2
    assert ledger["epsilon"] <= 2.0
    assert ledger["epsilon"] == pytest.approx(2.0, abs=1e-6)  # the final run gets the rest
    parts = {"train": ["all"], "holdout": ["train part", "validation part"]}[selection]
    assert ledger["parts"] == parts
    for part in parts:
        acc = pld.PLDAccountant(
            neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_SPECIAL)
        for entry in ledger["entries"]:
            if entry["data"] in ("all", part):
                acc.compose(dp_accounting.GaussianDpEvent(entry["noise_multiplier"]),
                            entry["steps"])
        assert acc.get_epsilon(1e-5) <= 2.0 + 1e-3
        assert acc.get_epsilon(1e-5) == pytest.approx(2.0, abs=1e-3)
    assert result["selection"]["num_scored"] == {"train": 1438, "holdout": round(0.1 * 1438)}[
        selection]
    assert result["privacy"]["epsilon_total"] == ledger["epsilon"]
    assert 0.5 < result["final"]["test_accuracy"] <= 1.0
    assert result["chosen"]["learning_rate"] * result["chosen"]["steps"] == pytest.approx(
        result["chosen"]["r"])


def test_tune_cli_writes_results_with_the_ledger(digits_store, tmp_path, capsys):
    out = tmp_path / "tune.json"
    assert cli.main(["tune", digits_store, "--epsilon", "1", "--delta", "1e-5", "--trials", "2",
                     "--steps-choices", "5", "--r-max", "50", "--normalize", "group",
                     "--groups", "27", "--seed", "1", "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "privacy ledger" in printed and "basic composition" in printed
    assert "selection: noisy correct counts" in printed
    results = json.loads(out.read_text())
    assert results["ledger"]["epsilon"] <= 1.0
    assert {"epsilon", "delta", "noise_multiplier", "test_accuracy"} <= set(results["runs"][0])
    assert "params" not in results


def test_seeded_search_never_reuses_noise_across_mechanisms(digits_store, monkeypatch):
    """Composition assumes independent noise: each stage and the final run get their own keys."""
    import jax

    import probe

    seen = []
    original = probe.make_keys

    def recording(count):
        keys = original(count)
        seen.extend(tuple(int(v) for v in row) for row in jax.random.key_data(keys))
        return keys

    monkeypatch.setattr(probe, "make_keys", recording)
    tune_job.linear_scaling_search(digits_store, 1.0, 1e-5, trials=2, steps_choices=(3,),
                                 r_range=(1, 10), seed=7, quiet=True)
    assert len(seen) == 5 and len(set(seen)) == 5


def test_tune_config_fills_the_budgets_and_refuses_what_cannot_run():
    config = TuneConfig("s.zarr", epsilon=2.0)
    assert (config.eps0, config.eps1, config.eps_select, config.selection) == (
        0.1, 0.2, 0.1, "train")
    assert TuneConfig("s.zarr", 2.0, selection="holdout").eps_select is None
    assert TuneConfig("s.zarr", 2.0, public_validation="npz:v.npz").selection == "public"
    with pytest.raises(ValueError, match="does not combine with --selection holdout"):
        TuneConfig("s.zarr", 2.0, selection="holdout", public_validation="npz:v.npz")
    with pytest.raises(ValueError, match="--eps-select applies to --selection train"):
        TuneConfig("s.zarr", 2.0, selection="holdout", eps_select=0.1)
    with pytest.raises(ValueError, match=r"--r-min \(5\) must be below --r-max \(1\)"):
        TuneConfig("s.zarr", 2.0, r_range=(5, 1))
    with pytest.raises(ValueError, match="lower them"):
        TuneConfig("s.zarr", 1.0, eps0=0.7, eps1=0.8)
    with pytest.raises(ConfigError, match="epsilon: must be > 0 and finite"):
        TuneConfig("s.zarr", math.inf)


def test_run_tune_writes_its_model_atomically_and_replaces_only_its_own(digits_store, tmp_path):
    model = tmp_path / "probe.npz"
    options = dict(epsilon=1.0, trials=1, steps_choices=(2,), r_range=(1, 10), quiet=True,
                   model=str(model))
    results = run_tune(digits_store, **options)
    with np.load(model) as saved:
        assert saved["w"].shape == results["params"]["w"][0].shape
        assert np.array_equal(saved["b"], results["params"]["b"][0])
    run_tune(digits_store, **options)  # its own model is replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["probe.npz"]  # no temp file left
    (tmp_path / "mine.npz").write_bytes(b"user data")
    with pytest.raises(ValueError, match="was not written by dpprobe"):
        run_tune(digits_store, **(options | {"model": str(tmp_path / "mine.npz")}))
