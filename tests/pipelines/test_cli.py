"""The `dpprobe` CLI end to end on small real data (digits)."""

import dataclasses
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from dpprobe.pipelines import cli


def _dpprobe(*args):
    return subprocess.run([sys.executable, "-m", "dpprobe.pipelines.cli", *args],
                          capture_output=True, text=True, timeout=300)


def test_account_rejects_impossible_requests(capsys):
    assert cli.main(["account", "--epsilon", "-1"]) == 2
    assert "--epsilon: must be > 0 (or inf for non-private), got -1" in capsys.readouterr().err
    assert cli.main(["account", "--epsilon", "1", "--delta", "2"]) == 2
    assert "--delta: must be in (0, 1), got 2" in capsys.readouterr().err


def test_fresh_cli_process_equals_the_in_process_job(digits_store, tmp_path):
    """A fresh `dpprobe probe` reads the store while it imports JAX; this process has JAX
    loaded already. The non-private reference has no noise, so the two must agree exactly."""
    from dpprobe.pipelines import run_probe

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
    from dpprobe.extract import store_summary

    summary = store_summary(store)
    assert set(summary["splits"]) == {"train", "test"}
    assert all(s["complete"] for s in summary["splits"].values())




MINIMAL = {  # each command with only its required options, and the config fields they set
    "extract": (["--backbone", "none", "--data", "npz:x.npz", "--out", "x.zarr"],
                {"backbone", "data", "out"}),
    "probe": (["s.zarr"], {"store"}),
    "tune": (["s.zarr", "--epsilon", "1"], {"store", "epsilon"}),
    "account": (["--epsilon", "1"], {"epsilon"}),
    "audit": (["s.zarr", "--epsilon", "1"], {"store", "epsilon"}),
    "finetune": ([], set()),
    "verify": (["s.zarr"], {"store"}),
    "info": (["s.zarr"], {"store"}),
    "demo": ([], set()),
    "predict": (["--model", "m.safetensors", "--data", "s.zarr"], {"model", "data"}),
    "export": (["out.onnx", "--model", "m.safetensors", "--format", "onnx"],
               {"out", "model", "format"}),
}


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_command_builds_one_frozen_config_with_the_configs_defaults(command):
    _, config_class, *_ = cli.COMMANDS[command]
    argv, given = MINIMAL[command]
    args = cli.build_parser(command).parse_args([command, *argv])
    config = cli.make_config(args)
    assert type(config) is config_class
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.store = "other"
    # Options not given leave the config's defaults: the CLI keeps no second set of defaults.
    fields = {f.name for f in dataclasses.fields(config_class)}
    assert fields & set(vars(args)) == given


def test_choices_are_the_library_constants():
    from dpprobe import dp, probe
    from dpprobe.accounting import ACCOUNTANTS
    from dpprobe.extract.store import FEATURE_DTYPES
    from dpprobe.pipelines.demo_job import DEMO_DATA
    from dpprobe.pipelines.export_job import FORMATS
    from dpprobe.probe.search import EXTRAPOLATIONS, SEARCH_CHOICES, SELECTIONS

    model = {"optimizer": dp.OPTIMIZERS, "loss": probe.LOSSES,
             "normalization": probe.NORMALIZATIONS}
    expected = {
        "probe": model | {"accountant": ACCOUNTANTS},
        "tune": model | {"search": SEARCH_CHOICES, "extrapolation": EXTRAPOLATIONS,
                         "selection": tuple(s for s in SELECTIONS if s != "public")},
        "account": {"accountant": ACCOUNTANTS},
        "audit": {"optimizer": dp.OPTIMIZERS, "loss": probe.LOSSES},
        "extract": {"dtype": FEATURE_DTYPES, "split": ("train", "test", "all"),
                    "amp": ("auto", "off", "bf16", "fp16")},  # (no constants in extract)
        "demo": {"data": DEMO_DATA},
        "verify": {},
        "info": {},
        "predict": {},
        "export": {"format": FORMATS},
    }
    for command, options in expected.items():
        argv, _ = MINIMAL[command]
        parser = cli.build_parser(command).parse_args([command, *argv]).parser
        choices = {a.dest: tuple(a.choices) for a in parser._actions
                   if a.choices is not None and a.dest != "help"}
        assert choices == {k: tuple(v) for k, v in options.items()}, command


def test_written_out_vocabularies_are_the_library_constants():
    from dpprobe import extract, options
    from dpprobe.finetune.modes import TRAIN_MODES

    assert options.TRAIN_MODES == TRAIN_MODES
    assert options.AUGMENTATIONS == extract.AUGMENTATIONS
    parser = cli.build_parser("finetune")
    finetune = parser._subparsers._group_actions[0].choices["finetune"]
    assert {a.dest: tuple(a.choices) for a in finetune._actions
            if a.dest == "train"} == {"train": TRAIN_MODES}


def test_help_of_every_command_loads_no_jax_nor_torch():
    """`dpprobe COMMAND --help` must return at once: importing JAX or torch takes seconds."""
    code = ("import sys, contextlib, io; from dpprobe.pipelines import cli\n"
            "for command in cli.COMMANDS:\n"
            "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "        assert cli.main([command, '--help']) == 0 and '--' in out.getvalue()\n"
            "print(sorted(m for m in ('jax', 'torch', 'flax', 'scipy', 'optax', 'zarr')\n"
            "             if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_a_bad_value_names_its_option_and_a_command_imports_only_what_it_needs():
    code = ("import sys; from dpprobe.pipelines import cli; "
            "code = cli.main(['account', '--epsilon', '1', '-q', '2']); "
            "print(code, 'jax' in sys.modules, 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.split() == ["2", "False", "False"], result.stderr
    assert "argument --sampling-probability/-q: must be in (0, 1], got 2" in result.stderr


def test_probe_parses_without_jax_a_probe_choice_given_or_not():
    """`dpprobe probe` imports JAX while it reads the store, not while it parses (its choices
    are written out: `options.OPTIMIZERS`)."""
    code = ("import sys; from dpprobe.pipelines import cli; p = cli.build_parser('probe'); "
            "p.parse_args(['probe', 's.zarr', '--seeds', '2']); a = 'jax' in sys.modules; "
            "p.parse_args(['probe', 's.zarr', '--optimizer', 'sgd']); print(a, 'jax' in "
            "sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.split() == ["False", "False"], result.stderr


# how each command prints, not what it runs
OUTPUT_OPTIONS = {"info": {"json"}, "account": {"json"}, "verify": {"json"}}


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_each_option_is_written_once_on_its_config_field(command, capsys):
    """The parser is generated from the config: its options are exactly the fields that carry
    one (no option the config lacks, no field the parser forgot), and --help shows each flag."""
    from dpprobe import options

    _, config_class, *_ = cli.COMMANDS[command]
    argv, _ = MINIMAL[command]
    parser = cli.build_parser(command).parse_args([command, *argv]).parser
    dests = {a.dest for a in parser._actions if a.dest != "help"}
    fields = {f.name for f in options.cli_fields(config_class)}
    assert dests == fields | OUTPUT_OPTIONS.get(command, set())
    assert fields <= {f.name for f in dataclasses.fields(config_class)}
    assert cli.main([command, "--help"]) == 0
    text = capsys.readouterr().out
    for action in parser._actions:
        for name in action.option_strings or [action.metavar or action.dest]:
            assert name in text, f"{command} --help lacks {name}"
        if action.help and action.dest in fields:
            assert "%(default)s" not in parser._get_formatter()._expand_help(action)


def test_library_errors_name_fields_and_the_cli_names_their_options(capsys):
    from dpprobe import options
    from dpprobe.pipelines.extract_job import ExtractConfig

    with pytest.raises(ValueError, match=r"^`ray_shards`/`ray_address` need `ray=True`$"):
        ExtractConfig("none", "npz:x.npz", "x.zarr", ray_shards=2)
    parser = cli.build_parser("tune").parse_args(["tune", "s.zarr", "--epsilon", "1"]).parser
    words = {
        "`groups=4` needs `normalization='group'`": "--groups 4 needs --normalize group",
        "`eps_standardize` needs `standardize=True`, not `standardize=False`":
            "--eps-standardize needs --standardize, not --no-standardize",
        "`save_model` and `quiet=True`; `r_range`": "--save-model and --quiet; --r-min/--r-max",
        "`quiet=False`": "`quiet=False`",  # not what --quiet sets: the field stays
        "`weights` in `dpprobe extract`": "`weights` in `dpprobe extract`",  # not tune's fields
    }
    for text, expected in words.items():
        assert options.cli_words(text, parser) == expected
    verify = cli.build_parser("verify").parse_args(["verify", "s.zarr"]).parser
    assert options.cli_words("`progress=False`; `progress=True`", verify) == (
        "--quiet; `progress=True`")  # a store_false switch: its flag means False
    assert cli.main(["extract", "--backbone", "none", "--data", "npz:x.npz", "--out", "x.zarr",
                     "--ray-shards", "2", "--quiet"]) == 2
    assert "--ray-shards/--ray-address need --ray" in capsys.readouterr().err


def test_verify_data_and_finetune_take_num_classes_for_an_npz_without_class_names(tmp_path,
                                                                                    capsys):
    images = np.zeros((6, 8, 8), np.uint8)
    np.savez(tmp_path / "x.npz", images=images, labels=np.array([0, 1, 2, 0, 1, 5]))
    assert cli.main(["verify", "--data", f"npz:{tmp_path / 'x.npz'}"]) == 2
    assert "declare the classes with --num-classes K" in capsys.readouterr().err
    assert cli.main(["verify", "--data", f"npz:{tmp_path / 'x.npz'}", "--num-classes", "3"]) == 1
    assert "label 5 outside the declared classes [0, 3)" in capsys.readouterr().out
    parser = cli.build_parser("finetune").parse_args(["finetune", "--num-classes", "3"])
    assert cli.make_config(parser).num_classes == 3


def test_import_dpprobe_is_the_public_api_and_stays_light():
    """`import dpprobe` gives the jobs, the data and store readers and `load_model`, every name
    of its `__all__` defined, without importing JAX or torch (a fresh process)."""
    code = ("import sys, dpprobe; missing = [n for n in dpprobe.__all__ if not hasattr(dpprobe, n)]"
            "; print(missing, sorted({'jax', 'torch'} & set(sys.modules)), all(hasattr(dpprobe, n)"
            " for n in ('run_probe', 'run_finetune', 'open_source', 'load_split', 'load_model')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]", "[]", "True"], out.stdout + out.stderr
