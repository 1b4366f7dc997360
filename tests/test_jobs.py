"""The job functions (`dpprobe.jobs`): the command line's names, one spelling each; results as
objects; `dpprobe.extract`, `dpprobe.probe`, `dpprobe.finetune` both packages and jobs."""

import importlib
import inspect
import subprocess
import sys

import numpy as np
import pytest

import dpprobe
from dpprobe import jobs
from dpprobe.pipelines import audit_job, cli, probe_job
from tests.pipelines.test_cli import MINIMAL

JOBS = ["extract", "probe", "tune", "finetune", "audit", "predict"]
# Config fields with no command-line option of their own (`--r-min`/`--r-max` set `r_range`).
PYTHON_ONLY = {"r_range", "head_bias_init", "microbatch_size"}


def _cli_names(command):
    """{field: the option's names without dashes} of a command's parser."""
    parser = cli.build_parser(command).parse_args([command, *MINIMAL[command][0]]).parser
    names = {}
    for action in parser._actions:
        if action.dest != "help":
            spelled = [s.lstrip("-").replace("-", "_") for s in action.option_strings
                       if s.startswith("--")] or [action.dest]
            names.setdefault(action.dest, set()).update(spelled)
    return names


@pytest.mark.parametrize("name", JOBS)
def test_every_option_is_spelled_as_the_command_line_spells_it(name):
    parameters = inspect.signature(getattr(jobs, name)).parameters
    cli_names = _cli_names(name)
    spelled = set().union(*cli_names.values())
    assert set(parameters) - PYTHON_ONLY <= spelled, set(parameters) - PYTHON_ONLY - spelled
    # one parameter per option (argparse destination): no field twice, none missing
    python_only = (set(parameters) & PYTHON_ONLY) - set(cli_names)
    assert len(parameters) == len(cli_names) + len(python_only)


def test_one_spelling_each():
    assert {"epsilons", "lr", "normalize", "quiet"} <= set(inspect.signature(dpprobe.probe)
                                                           .parameters)
    for name in ("tune", "finetune", "audit"):
        parameters = inspect.signature(getattr(dpprobe, name)).parameters
        assert "epsilon" in parameters and "epsilons" not in parameters
    assert "quiet" in inspect.signature(dpprobe.extract).parameters  # not `progress`
    with pytest.raises(TypeError, match="epsilons"):
        dpprobe.tune("s.zarr", epsilon=1, epsilons=[1])
    with pytest.raises(TypeError, match="learning_rates"):
        dpprobe.probe("s.zarr", learning_rates=[1])
    with pytest.raises(TypeError, match="normalization"):
        dpprobe.probe("s.zarr", normalization="l2")


def test_the_packages_are_callable_jobs_and_still_packages():
    from dpprobe.probe.train import train_probe

    for name in ("extract", "probe", "finetune"):
        package = getattr(dpprobe, name)
        assert callable(package) and package.__name__ == f"dpprobe.{name}"
        assert inspect.signature(package) == inspect.signature(getattr(jobs, name))
    assert dpprobe.probe.train_probe is train_probe
    assert dpprobe.extract.load_split is dpprobe.load_split
    assert importlib.import_module("dpprobe.finetune.specs").FinetuneSpec is (
        dpprobe.finetune.FinetuneSpec)


def test_import_dpprobe_loads_no_jax_torch_or_sklearn():
    code = ("import dpprobe, sys; loaded = sorted({'jax', 'torch', 'sklearn'} & set(sys.modules))"
            "; import dpprobe.probe.step; print(loaded, callable(dpprobe.probe), "
            "dpprobe.probe.step.__name__, dpprobe.probe.train_probe.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["[]", "True", "dpprobe.probe.step", "dpprobe.probe.train"]


def test_probe_returns_its_table_ledger_models_and_paths(digits_store, tmp_path):
    out, models = tmp_path / "results.json", tmp_path / "models"
    result = dpprobe.probe(digits_store, epsilons=[2], seeds=1, steps=[5], lr=[0.5],
                           normalize="l2", out=str(out), save_model=str(models), quiet=True)
    assert isinstance(result, dpprobe.JobResult) and result.job == "probe"
    (run,) = result.results["runs"]
    assert (run["learning_rate"], run["steps"]) == (0.5, 5)
    assert result.results["probe"]["normalization"] == "l2"
    assert result.table == probe_job.probe_table(result.results)
    assert result.ledger["epsilon_by_role"]["private"] == pytest.approx(2, rel=1e-6)
    model_file = str(models / "eps2.safetensors")
    assert result.paths == (str(out), str(tmp_path / "results.timings.json"), model_file)
    (model,) = result.models
    assert model.path == model_file and model.privacy.epsilon == pytest.approx(2, rel=1e-6)
    written = dpprobe.load_model(model_file)
    assert written.document == model.document
    np.testing.assert_array_equal(written.arrays["head/w"], model.arrays["head/w"])

    predicted = dpprobe.predict(model_file, data=[digits_store], out=str(tmp_path / "p.csv"),
                                quiet=True)
    assert predicted.results["rows"] == 359 and predicted.paths == (str(tmp_path / "p.csv"),)
    assert predicted.results["accuracy"] == pytest.approx(run["test_accuracy"])


def test_probe_gives_its_models_in_memory_without_writing_them(digits_store, tmp_path,
                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = dpprobe.probe(digits_store, epsilons=[2, 4], seeds=1, steps=[5], quiet=True)
    assert result.paths == () and list(tmp_path.iterdir()) == []
    assert [m.path for m in result.models] == ["eps2.safetensors", "eps4.safetensors"]
    assert [round(m.privacy.epsilon, 6) for m in result.models] == [2, 4]
    features, labels, _ = dpprobe.load_split(digits_store, "test")
    for model, run in zip(result.models, result.results["runs"], strict=True):
        accuracy = np.mean(model.predict(features) == np.array(model.class_names)[labels])
        assert accuracy == pytest.approx(run["test_accuracy"])  # the model the job scored


def test_tune_and_extract_as_functions(digits_store, tmp_path, capsys):
    result = dpprobe.tune(digits_store, epsilon=2, trials=2, steps_choices=[3, 6],
                          r_range=(1, 30), final_steps=5, search="random", seed=3,
                          save_model=str(tmp_path / "tuned.safetensors"), quiet=True)
    (model,) = result.models
    assert model.privacy.epsilon <= 2 * (1 + 1e-6)
    assert result.ledger == result.results["ledger"]
    assert result.paths == (str(tmp_path / "tuned.safetensors"),)

    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        np.savez(tmp_path / f"{split}.npz", features=rng.normal(size=(40, 8)),
                 labels=rng.integers(0, 2, 40), class_names=np.array(["a", "b"]))
    capsys.readouterr()
    store = str(tmp_path / "emb.zarr")
    for split in ("train", "test"):
        extracted = dpprobe.extract(backbone="none", data=f"npz:{tmp_path / split}.npz",
                                    split=split, out=store, quiet=True)
        assert extracted.paths == (store,) and extracted.results[0].complete
    assert capsys.readouterr().err == ""  # quiet=True is --quiet: no progress bar
    assert dpprobe.load_split(store, "test")[0].shape == (40, 8)


def test_audit_as_a_function(digits_store, tmp_path):
    out = tmp_path / "audit.json"
    result = dpprobe.audit(digits_store, epsilon=1, runs=50, rows=100, out=str(out), quiet=True)
    assert result.table == audit_job.audit_report(result.results)
    assert result.results["claim"]["epsilon"] == pytest.approx(1, rel=1e-6)
    assert result.paths == (str(out),) and result.ledger is None and result.models == ()


def test_the_command_line_calls_the_job_functions(digits_store, tmp_path, monkeypatch, capsys):
    calls = []

    def recorded(name):
        job = getattr(jobs, name)

        def call(*args, **kwargs):
            calls.append((name, args, kwargs))
            result = job(*args, **kwargs)
            calls[-1] += (result,)
            return result
        return call

    for name in ("probe", "predict"):
        monkeypatch.setattr(jobs, name, recorded(name))
    models = tmp_path / "models"
    assert cli.main(["probe", digits_store, "--epsilons", "2", "--seeds", "1", "--steps", "5",
                     "--save-model", str(models), "--quiet"]) == 0
    printed = capsys.readouterr().out
    (name, args, kwargs, result) = calls[0]
    assert (name, kwargs) == ("probe", {}) and isinstance(args[0], dpprobe.ProbeConfig)
    assert printed == result.table + "\n"  # the command prints the job function's table
    assert cli.main(["predict", "--model", str(models / "eps2.safetensors"), "--data", digits_store,
                     "--out", str(tmp_path / "p.csv"), "--quiet"]) == 0
    (name, args, _, result) = calls[1]
    assert name == "predict" and isinstance(args[0], dpprobe.PredictConfig)
    assert capsys.readouterr().err.endswith(result.table + "\n")
    assert result.paths == (str(tmp_path / "p.csv"),)


def test_a_job_function_takes_its_config(digits_store):
    config = dpprobe.ProbeConfig(digits_store, epsilons=[2], seeds=1, steps=[5], quiet=True)
    result = dpprobe.probe(config)
    assert [run["steps"] for run in result.results["runs"]] == [5]
    with pytest.raises(TypeError):
        dpprobe.probe(config, seeds=2)  # a config or keywords, not both
