"""The tune job: the linear-scaling search on a store, its ledger, its config, its outputs."""

import json
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import pld

from dpprobe import accounting, dp
from dpprobe.checks import ConfigError
from dpprobe.pipelines import TuneConfig, cli, run_tune, tune_job


@pytest.mark.parametrize("selection", ["train", "holdout"])
def test_search_total_epsilon_is_at_most_the_request(digits_store, selection):
    """Every mechanism, the private selection included, is in the ledger, and dp_accounting
    composing the same events independently (per disjoint part) gives the requested total."""
    result = tune_job.linear_scaling_search(
        digits_store, 2.0, 1e-5, trials=3, r_range=(1, 100), steps_choices=(5, 10),
        normalization="group", groups=27, selection=selection, seed=0, quiet=True,
        search="random", standardize=True,  # digits is too small for either to pay: asked for
    )
    ledger = result["ledger"]
    # The standardization's two releases, 2 stages x (3 trials + their noisy counts), the final
    assert ledger["num_mechanisms"] == 10
    assert sum(e["role"] == "selection" for e in ledger["entries"]) == 2
    standardization = ledger["entries"][0]
    assert standardization["role"] == "standardization" and standardization["steps"] == 2
    assert standardization["data"] == {"train": "all", "holdout": "train part"}[selection]
    assert result["standardization"]["epsilon"] == pytest.approx(0.2)
    assert accounting.DpPlan(standardization["noise_multiplier"], 2).epsilon(1e-5) == (
        pytest.approx(0.2, rel=1e-6))
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
                     "--groups", "27", "--seed", "1", "--search", "random", "--out", str(out),
                     "--quiet"]) == 0
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


    seen = []
    original = dp.make_keys

    def recording(count):
        keys = original(count)
        seen.extend(tuple(int(v) for v in row) for row in jax.random.key_data(keys))
        return keys

    monkeypatch.setattr(dp, "make_keys", recording)
    tune_job.linear_scaling_search(digits_store, 1.0, 1e-5, trials=2, steps_choices=(3,),
                                 r_range=(1, 10), seed=7, quiet=True,
                                 search="grid", standardize=True)
    # standardization (1 key for its two releases), 2 + 2 trials, the final run
    assert len(seen) == 6 and len(set(seen)) == 6


def test_tune_config_fills_the_budgets_and_refuses_what_cannot_run():
    config = TuneConfig("s.zarr", epsilon=2.0)
    assert (config.eps0, config.eps1, config.eps_select, config.selection) == (
        0.1, 0.2, 0.1, "train")
    assert TuneConfig("s.zarr", 2.0, selection="holdout").eps_select is None
    assert TuneConfig("s.zarr", 2.0, public_validation="npz:v.npz").selection == "public"
    with pytest.raises(ValueError, match="does not combine with `selection=holdout`"):
        TuneConfig("s.zarr", 2.0, selection="holdout", public_validation="npz:v.npz")
    with pytest.raises(ValueError, match="`eps_select` applies to `selection=train`"):
        TuneConfig("s.zarr", 2.0, selection="holdout", eps_select=0.1)
    with pytest.raises(ValueError,
                       match=r"r_range: the low end \(5\) must be below the high end \(1\)"):
        TuneConfig("s.zarr", 2.0, r_range=(5, 1))
    with pytest.raises(ValueError, match="lower them"):
        TuneConfig("s.zarr", 1.0, eps0=0.7, eps1=0.8)
    with pytest.raises(ConfigError, match="epsilon: must be > 0 and finite"):
        TuneConfig("s.zarr", math.inf)


def test_run_tune_writes_its_model_atomically_and_replaces_only_its_own(digits_store, tmp_path):
    from dpprobe import model as dpmodel

    model = tmp_path / "probe.safetensors"
    options = dict(epsilon=1.0, trials=1, steps_choices=(2,), r_range=(1, 10), quiet=True,
                   standardize=True,  # digits is too small for it to pay: asked for
                   save_model=str(model))
    results = run_tune(digits_store, **options)
    arrays, document = dpmodel.read_model_file(model)
    assert np.array_equal(arrays["head/b"], results["params"]["b"][0])
    assert np.array_equal(arrays["head/w"], results["params"]["w"][0])
    # Every transform the probe was trained behind: GroupNorm 27, the folded standardization.
    assert document["transforms"][0] == {"op": "normalize", "method": "group", "groups": 27,
                                         "privacy": document["transforms"][0]["privacy"]}
    assert document["transforms"][1]["op"] == "standardize"
    assert document["privacy"]["epsilon"] == results["privacy"]["epsilon_total"]
    run_tune(digits_store, **options)  # its own model is replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["probe.safetensors"]  # no temp file
    (tmp_path / "mine.npz").write_bytes(b"user data")
    with pytest.raises(ValueError, match="was not written by dpprobe"):
        run_tune(digits_store, **(options | {"save_model": str(tmp_path / "mine.npz")}))


def test_default_normalization_comes_from_the_store_backbone(digits_store):
    """ScatterNet: GroupNorm over whole channel groups (27 of its 81 channels per input
    channel); anything else: none. Given options win; --groups alone means group."""
    from dpprobe.probe import recipe

    assert recipe.backbone_normalization({"name": "scatternet",
                                          "coefficients_per_channel": 81}) == ("group", 27)
    assert recipe.backbone_normalization({"name": "scatternet",
                                          "coefficients_per_channel": 25}) == ("group", 25)
    assert recipe.backbone_normalization({"name": "scatternet",
                                          "coefficients_per_channel": 217}) == ("group", 7)
    assert recipe.backbone_normalization({"name": "vit_tiny_patch16_224",
                                          "library": "timm"}) == ("none", None)
    assert recipe.backbone_normalization(None) == ("none", None)
    assert TuneConfig("s.zarr", 1.0).normalization is None
    assert TuneConfig("s.zarr", 1.0, groups=9).normalization == "group"
    options = dict(trials=1, steps_choices=(2,), r_range=(1, 10), quiet=True)
    result = tune_job.linear_scaling_search(digits_store, 1.0, 1e-5, **options)
    assert (result["probe"]["normalization"], result["probe"]["groups"]) == ("group", 27)
    result = tune_job.linear_scaling_search(digits_store, 1.0, 1e-5, normalization="l2",
                                            **options)
    assert (result["probe"]["normalization"], result["probe"]["groups"]) == ("l2", 1)
