"""The defaults chosen from public quantities: the probe's recipe (`probe.recipe`), tune's
decision to search or not (`probe.search.decide_search`), finetune's recipe
(`finetune.recipe`)."""

from __future__ import annotations

import json
import math

import pytest

from dpprobe import accounting
from dpprobe.finetune.recipe import default_model, ema_full_step, finetune_recipe
from dpprobe.pipelines import FinetuneConfig, ProbeConfig, cli, run_finetune, run_probe
from dpprobe.probe import recipe, search


def test_total_step_size_is_the_linear_scaling_rule_in_closed_form():
    for epsilon in (0.5, 1.0, 3.0, 8.0):
        assert recipe.total_step_size(epsilon, 1e-5, 60_000) == pytest.approx(
            0.011 * accounting.gdp_mu(epsilon, 1e-5) * 60_000)
    # r stops growing at epsilon 8, and the non-private reference takes epsilon 8's r.
    at_8 = recipe.total_step_size(8.0, 1e-5, 1438)
    assert recipe.total_step_size(20.0, 1e-5, 1438) == at_8
    assert recipe.total_step_size(math.inf, 1e-5, 1438) == at_8
    assert recipe.total_step_size(3.0, 1e-5, 2 * 1438) == pytest.approx(
        2 * recipe.total_step_size(3.0, 1e-5, 1438))


def test_group_normalization_without_groups_takes_the_backbones_groups():
    """`--normalize group` alone on a ScatterNet store is its 27 channel groups (the default's),
    not one global group; given groups win; a backbone without groups gets 1."""
    scatternet = {"backbone": {"name": "scatternet", "coefficients_per_channel": 81}}
    timm = {"backbone": {"name": "vit_tiny_patch16_224"}}
    for attrs, normalization, groups, expected in [
            (scatternet, "group", None, 27), (scatternet, "group", 9, 9),
            (scatternet, None, None, 27), (timm, "group", None, 1), (timm, None, None, None)]:
        config = ProbeConfig(store="s.zarr", normalization=normalization, groups=groups)
        chosen = recipe.probe_recipe(config, attrs, 1000)
        assert chosen.groups == expected, (attrs, normalization, groups)
    chosen = recipe.probe_recipe(ProbeConfig(store="s.zarr", normalization="group"), scatternet,
                                 1000)
    assert "group (27 groups) [groups from the store's backbone]" in chosen.describe([1.0])
    assert ", full-batch momentum" in chosen.describe([1.0])
    sampled = recipe.probe_recipe(ProbeConfig(store="s.zarr", sampling_probability=0.1),
                                  scatternet, 1000)
    assert ", Poisson-sampled (q = 0.1) momentum" in sampled.describe([1.0])


def test_probe_defaults_come_from_the_store_and_are_printed_first_and_recorded(
        digits_store, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert cli.main(["probe", digits_store, "--epsilons", "1,8,inf", "--seeds", "1",
                     "--out", str(out)]) == 0
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith("recipe: per-example normalization group (27 groups) [from the "
                            "store's backbone], full-batch momentum [default], T = 300")
    results = json.loads(out.read_text())
    assert (results["probe"]["normalization"], results["probe"]["groups"]) == ("group", 27)
    assert results["recipe"]["num_examples"] == 1438
    for run in results["runs"]:
        epsilon = math.inf if run["epsilon"] == "inf" else run["epsilon"]
        assert run["optimizer"] == "momentum" and run["steps"] == 300
        assert run["learning_rate"] == pytest.approx(
            recipe.total_step_size(epsilon, 1e-5, 1438) / 300)
    # The recipe gives way to what is given: adam takes its default lr and T = 1.
    adam = run_probe(digits_store, epsilons=[1.0], seeds=1, optimizer="adam", quiet=True)
    assert (adam["runs"][0]["steps"], adam["runs"][0]["learning_rate"]) == (1, 1e-3)
    assert ProbeConfig("s.zarr").optimizer is None  # chosen when the store is read


def test_search_is_skipped_where_its_scores_are_noise_and_run_where_they_are_not():
    def decide(n, epsilon, selection="train"):
        return search.decide_search(num_trained=n, num_scored=n, epsilon=epsilon, delta=1e-5,
                                    eps0=epsilon / 20, eps_select=epsilon / 20, trials=5,
                                    scoring=selection)

    small = decide(1438, 3.0)  # digits: one trial's score has a std of 4.7 points
    assert not small.search and small.score_noise == pytest.approx(
        math.sqrt(10) / accounting.gdp_mu(0.15, 1e-5) / 1438)
    assert "std of 4.7 accuracy points" in small.reason and "--search random" in small.reason
    assert decide(60_000, 3.0).search  # Fashion-MNIST: 0.11 points
    assert not decide(60_000, 0.5).search  # 0.57 points
    public = search.decide_search(num_trained=1438, num_scored=10_000, epsilon=8.0, delta=1e-5,
                                  eps0=0.4, eps_select=None, trials=5, scoring="public")
    assert not public.search and "mu N = 74.5 < 100" in public.reason


def test_tune_on_small_data_spends_the_whole_budget_on_the_default_recipe(digits_store,
                                                                         tmp_path, capsys):
    out = tmp_path / "t.json"
    assert cli.main(["tune", digits_store, "--epsilon", "2", "--final-steps", "20",
                     "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "no search: with 1438 examples to score on" in printed
    results = json.loads(out.read_text())
    assert results["stages"] == [] and results["search"]["kind"] == "none"
    roles = [entry["role"] for entry in results["ledger"]["entries"]]
    assert roles == ["final"]  # nothing spent on a search, nor on a standardization this noisy
    assert results["standardization"]["decision"].startswith("off: with N = 1438 and epsilon "
                                                              "0.2 the released means would")
    assert results["ledger"]["epsilon"] == pytest.approx(2.0, abs=1e-6)
    assert results["chosen"]["r"] == pytest.approx(recipe.total_step_size(
        results["privacy"]["epsilon_final_alone"], 1e-5, 1438))


def test_standardization_is_decided_from_its_noise():
    noise = math.sqrt(2) / accounting.gdp_mu(0.3, 1e-5) * 18.0 / 1438  # digits, epsilon 3
    assert recipe.decide_standardization(None, 0.3, 1e-5, 18.0, 1438) == (
        True, f"on: the released means carry noise of std {noise:.2g} per feature "
              "(--no-standardize turns it off)")
    assert not recipe.decide_standardization(None, 0.1, 1e-5, 18.0, 1438)[0]  # epsilon 1
    assert recipe.decide_standardization(True, 0.1, 1e-5, 18.0, 1438)[0]  # asked for
    assert not recipe.decide_standardization(None, 0.3, 1e-5, math.inf, 1438)[0]
    with pytest.raises(ValueError, match="needs a per-example normalization"):
        recipe.decide_standardization(True, 0.3, 1e-5, math.inf, 1438)


def test_a_clipped_r_is_explained_with_what_to_do():
    from dpprobe.pipelines.tune_job import _line_report

    line = {"extrapolation": "clipped", "alpha": 300.0, "b": 10.0, "exponent": None,
            "r_star": 1000.0, "r_line": 1234.0, "searched": [1.0, 1000.0], "clipped": True,
            "fallback_used": False}
    text = _line_report(line, 3.0)
    assert "clipped to the searched range" not in text
    assert ("the line gave r = 1234, above the r the search tried ([1, 1e+03]), so the final "
            "run uses 1000") in text
    assert "rerun with --r-max 3e+03" in text and "--extrapolation linear" in text


@pytest.mark.parametrize(("n", "batch", "epochs", "lr"), [
    (1438, 256, 54.0, 4.0 * math.sqrt(256 / 2048)),  # digits: not full batch, >= 300 steps
    (60_000, 2048, 30.0, 4.0),  # Fashion-MNIST: Tramer & Boneh's recipe, unchanged
    (10_240, 2048, 60.0, 4.0),
    (100, 16, 48.0, 4.0 * math.sqrt(16 / 2048)),
])
def test_finetune_recipe_from_public_quantities(n, batch, epochs, lr):
    chosen = finetune_recipe(FinetuneConfig(epsilon=8.0, model="cnn"), num_examples=n,
                             image_size=16, num_classes=10)
    assert (chosen.batch_size, chosen.epochs, chosen.clip_norm) == (batch, epochs, 0.1)
    assert chosen.learning_rate == pytest.approx(lr)
    assert batch <= n / 5 and math.ceil(epochs * n / batch) >= 300
    given = finetune_recipe(FinetuneConfig(batch_size=64, learning_rate=0.3, steps=7,
                                           model="cnn"),
                            num_examples=n, image_size=16, num_classes=10)
    assert (given.batch_size, given.epochs, given.learning_rate) == (64, None, 0.3)
    assert set(given.chosen) == {"clip_norm", "ema_decay"}
    assert chosen.ema_decay == given.ema_decay == 0.999  # De et al.'s, for the cnn


@pytest.mark.parametrize("model", ["scatternet_cnn", "scatternet_cnn_linear"])
def test_scatternet_models_take_tramer_and_bonehs_40_epochs(model):
    config = FinetuneConfig(epsilon=3.0, model=model)
    chosen = finetune_recipe(config, num_examples=60_000, image_size=28, num_classes=10)
    assert (chosen.batch_size, chosen.epochs, chosen.learning_rate) == (2048, 40.0, 4.0)
    assert chosen.chosen["epochs"] == "at least 40 and at least 300 steps"
    digits = finetune_recipe(config, num_examples=1438, image_size=8, num_classes=10)
    assert digits.epochs == 54.0  # the 300 steps decide


@pytest.mark.parametrize(("optimizer", "momentum", "at_2048", "at_256", "why"), [
    ("momentum", 0.9, 4.0, 4.0 / math.sqrt(8), "4 sqrt(B / 2048)"),
    ("momentum", 0.5, 20.0, 20.0 / math.sqrt(8), "4 sqrt(B / 2048) (1 - 0.5) / 0.1"),
    ("sgd", 0.9, 40.0, 40.0 / math.sqrt(8), "40 sqrt(B / 2048): momentum 0.9's step"),
    ("adam", 0.9, 0.01, 0.01, "measured for adam"),
    ("sign", 0.9, 0.01, 0.01, "measured for sign"),
    ("lamb", 0.9, 0.01, 0.01, "measured for lamb")])
def test_the_learning_rate_keeps_momentums_step_for_every_update_rule(
        optimizer, momentum, at_2048, at_256, why):
    """lr / (1 - rho) stays 4 sqrt(B / 2048) / 0.1 for momentum and sgd (rho 0); the adaptive
    rules, whose steps do not scale with the gradient, get a fixed 0.01 (digits: before, adam
    got 1.41 and trained to 83% against 97% at 0.01)."""
    config = FinetuneConfig(epsilon=8.0, model="cnn", optimizer=optimizer, momentum=momentum)
    for n, lr in ((60_000, at_2048), (1438, at_256)):
        chosen = finetune_recipe(config, num_examples=n, image_size=16, num_classes=10)
        assert chosen.learning_rate == pytest.approx(lr)
        assert f"[{why}]" in chosen.describe()


def test_a_momentum_of_one_or_more_is_refused():
    from dpprobe.checks import ConfigError

    for momentum in (1.0, -0.1):
        with pytest.raises(ConfigError, match="momentum"):
            FinetuneConfig(epsilon=8.0, momentum=momentum)


@pytest.mark.parametrize("model", ["scatternet_cnn_linear", "scatternet_cnn", "wrn16_4"])
def test_the_ema_decay_is_de_et_als_unless_given(model):
    chosen = finetune_recipe(FinetuneConfig(epsilon=3.0, model=model), num_examples=60_000,
                             image_size=28, num_classes=10)
    assert chosen.ema_decay == 0.999
    assert "EMA 0.999 [De et al.; their warm-up (1 + t) / (10 + t) until step 8,990]" in (
        chosen.describe())
    for given in (0.0, 0.99):  # 0 turns it off; a given decay is kept, not chosen
        kept = finetune_recipe(FinetuneConfig(epsilon=3.0, model=model, ema_decay=given),
                               num_examples=60_000, image_size=28, num_classes=10)
        assert kept.ema_decay == given and "ema_decay" not in kept.chosen


@pytest.mark.parametrize("decay", [0.0, 0.5, 0.9, 0.9 + 1e-15, 0.99, 0.998, 0.999,
                                   0.99900000000001, 0.9995, 0.99999, 1 - 1e-9])
def test_the_ema_decay_binds_from_the_step_the_recipe_names(decay):
    """De et al.'s warm-up, not the decay, sets the EMA before `ema_full_step`: a run shorter
    than that trains the same for any larger decay (0.998 and 0.999 alike below step 4,490).
    The trainer takes the minimum in float64 (`dp_update` is an x64 program)."""
    import jax

    from dpprobe.finetune import ema_decay_at

    step = ema_full_step(decay)
    with jax.enable_x64(True):
        assert float(ema_decay_at(step, decay)) == decay
        if step:
            before = float(ema_decay_at(step - 1, decay))
            assert before < decay and before == float(ema_decay_at(step - 1, 1 - 1e-12))


def test_the_default_model_is_chosen_from_the_input_side(tmp_path, capsys):
    """ScatterNet + CNN + linear up to 32 px (a side divisible by 4), else the CNN; a run that
    names no model records the choice, keeps None in its options, and its rerun finds it done."""
    assert [default_model(s) for s in (8, 16, 28, 32)] == ["scatternet_cnn_linear"] * 4
    assert [default_model(s) for s in (4, 30, 36, 64, 224)] == ["cnn"] * 5
    options = dict(data="digits", steps=2, batch_size=64, physical_batch_size=64, epsilon=8.0,
                   out=str(tmp_path / "run"))
    results = run_finetune(**options)
    assert results["model"]["name"] == "scatternet_cnn_linear"
    assert results["model"]["chosen"] == "the default for 8 px images"
    assert "model: scatternet_cnn_linear [the default for 8 px images]" in capsys.readouterr().err
    assert json.loads((tmp_path / "run" / ".dpprobe-finetune-options.json").read_text())[
        "model"] is None
    again = run_finetune(**options)  # done: not refused, not retrained
    assert again["already_complete"] and again["test_accuracy"] == results["test_accuracy"]
    with pytest.raises(ValueError, match="name a timm ViT"):
        run_finetune(data="digits", train="lora", steps=1)
    with pytest.raises(ValueError, match="are for a timm model"):
        run_finetune(data="digits", random_init=True, steps=1)
    # A finished run that named the CNN, rerun naming none: refused, saying how to find it.
    previous = tmp_path / "run" / ".dpprobe-finetune-options.json"
    previous.write_text(json.dumps(json.loads(previous.read_text()) | {"model": "cnn"}))
    with pytest.raises(ValueError, match="add `--model cnn` for that run"):
        run_finetune(**options)
