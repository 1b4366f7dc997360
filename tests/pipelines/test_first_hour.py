"""What a newcomer hits in the first hour (issue 23, point 4): each stumble, fixed.

Every test here failed on the code before the fix (checked against that code)."""

from __future__ import annotations

import io
import json
import re
import time

import numpy as np
import pytest

from dpprobe.pipelines import cli

CLASSES = np.array(["a", "b", "c", "d"])


def _images(rng, n, side=16):
    labels = rng.integers(0, 4, n)
    images = rng.integers(0, 60, (n, side, side)).astype(np.uint8)
    images[labels == 1, : side // 2] += 150  # something to learn
    return images, labels


@pytest.fixture
def image_npz(rng, tmp_path, monkeypatch):
    """train.npz (120 images) and test.npz (40) in the working directory."""
    monkeypatch.chdir(tmp_path)
    for name, count in (("train", 120), ("test", 40)):
        images, labels = _images(rng, count)
        np.savez(f"{name}.npz", images=images, labels=labels, class_names=CLASSES)
    return tmp_path


FINETUNE = ["finetune", "--data", "npz:train.npz", "--test-data", "npz:test.npz", "--model",
            "cnn", "--batch-size", "40", "--steps", "2", "--physical-batch-size", "32",
            "--lr", "0.5", "--epsilon", "2", "--delta", "1e-4", "--quiet"]


def test_finetune_rerun_of_a_finished_run_is_already_complete(image_npz, capsys):
    assert cli.main([*FINETUNE, "--out", "run"]) == 0
    before = (image_npz / "run" / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert cli.main([*FINETUNE, "--out", "run"]) == 0
    out = capsys.readouterr().out
    assert "already complete: run/results.json" in out
    assert (image_npz / "run" / "model.safetensors").read_bytes() == before  # nothing retrained
    # Other options: one line that says what differs and suggests a new --out.
    assert cli.main([*FINETUNE, "--out", "run", "--seed", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "finished finetune run with other options (differs in: seed)" in err
    assert "give a new --out" in err
    # The options file keeps --seed (which drives the audit's coins) private to its owner.
    assert (image_npz / "run" / ".dpprobe-finetune-options.json").stat().st_mode & 0o077 == 0


def test_audit_prints_progress_and_where_it_wrote(digits_store, tmp_path, capsys):
    out = tmp_path / "audit.json"
    code = cli.main(["audit", digits_store, "--epsilon", "2", "--runs", "60", "--rows", "50",
                     "--runs-per-call", "20", "--out", str(out)])
    assert code in (0, 1)
    captured = capsys.readouterr()
    progress = [line for line in captured.err.splitlines() if line.startswith("audit: ")]
    assert any(re.search(r"audit: 20/120 runs \(17%\), [\d.e+-]+ runs/s, about .* left", line)
               for line in progress), progress
    assert any(re.search(r"audit: 120/120 runs \(100%\), done in", line) for line in progress)
    assert f"wrote {out}" in captured.out


def test_finetune_says_how_long_its_first_step_compiled():
    from dpprobe import finetune

    stream = io.StringIO()
    report = finetune.print_progress(10, 8.0, 1, stream=stream)
    time.sleep(0.01)
    report(1)
    first = stream.getvalue().splitlines()[0]
    assert re.fullmatch(r"step 1/10 took \d+\.\d s \(it compiled the training step; later steps "
                        r"reuse it\)", first), first


@pytest.mark.parametrize("command", [
    ["probe", "{store}", "--epsilons", "4", "--seeds", "1", "--steps", "3"],
    ["tune", "{store}", "--epsilon", "4", "--final-steps", "3"],
], ids=["probe", "tune"])
def test_delta_of_at_least_one_over_n_warns_even_with_quiet(command, digits_store, tmp_path,
                                                             capsys):
    out = tmp_path / "r.json"
    argv = [a.format(store=digits_store) for a in command]
    assert cli.main([*argv, "--delta", "0.01", "--quiet", "--out", str(out)]) == 0
    expected = "delta = 0.01 >= 1/N = 0.000695"
    assert f"warning: {expected}" in capsys.readouterr().out  # in the final report
    assert any(expected in w for w in json.loads(out.read_text())["warnings"])


def test_delta_of_at_least_one_over_n_warns_in_finetune_and_account(image_npz, capsys):
    assert cli.main([a if a != "1e-4" else "0.01" for a in FINETUNE]) == 0
    assert "warning: delta = 0.01 >= 1/N = 0.00833" in capsys.readouterr().out
    assert cli.main(["account", "--epsilon", "1", "--delta", "0.01",
                     "--num-examples", "1000"]) == 0
    assert "warning: delta = 0.01 >= 1/N = 0.001" in capsys.readouterr().out
    assert cli.main(["account", "--epsilon", "1", "--delta", "1e-5",
                     "--num-examples", "1000"]) == 0
    assert "warning" not in capsys.readouterr().out


def test_random_init_features_are_flagged_in_stdout_results_and_plot(image_npz, capsys):
    from PIL import Image

    for split in ("train", "test"):
        assert cli.main(["extract", "--backbone", "test_vit", "--random-init", "--crop", "32",
                         "--data", f"npz:{split}.npz", "--split", split, "--out", "vit.zarr",
                         "--batch-size", "64", "--quiet"]) == 0
    capsys.readouterr()
    assert cli.main(["probe", "vit.zarr", "--epsilons", "4", "--seeds", "1", "--steps", "2",
                     "--out", "r.json", "--plot", "r.png", "--quiet"]) == 0
    flag = "RANDOMLY INITIALIZED backbone (test_vit, seed 0)"
    assert flag in capsys.readouterr().out
    assert any(flag in w for w in json.loads((image_npz / "r.json").read_text())["warnings"])
    with Image.open(image_npz / "r.png") as plot:
        assert flag in plot.info["Warning"]


def test_extract_quiet_prints_the_final_report_and_a_rerun_says_it_reused(image_npz, capsys):
    argv = ["extract", "--backbone", "scatternet", "--data", "npz:train.npz", "--out",
            "s.zarr", "--rows-per-chunk", "16"]
    assert cli.main([*argv, "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == ("s.zarr/train: 120 x (1296,) (float16), 8/8 chunks written, "
                                    "complete") and captured.err == ""
    assert cli.main(argv) == 0
    assert ("s.zarr/train: 120 x (1296,) (float16), all 8 chunks already extracted by an "
            "earlier run; reused, nothing to do, complete") in capsys.readouterr().err


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_help_offers_only_options_the_command_accepts(command, monkeypatch):
    monkeypatch.setenv("COLUMNS", "10000")  # no option name broken across lines
    parser = cli.build_parser(command).parse_args(
        [command, *{"extract": ["--backbone", "x", "--data", "x", "--out", "x"],
                    "tune": ["s", "--epsilon", "1"], "audit": ["s", "--epsilon", "1"],
                    "account": ["--epsilon", "1"], "probe": ["s"], "verify": ["s"],
                    "info": ["s"], "predict": ["--model", "m", "--data", "d"],
                    "export": ["--model", "m", "--format", "onnx", "o"]}.get(command, [])]).parser
    accepted = {flag for action in parser._actions for flag in action.option_strings}
    offered = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", parser.format_help()))
    assert offered <= accepted, f"{command} --help offers {sorted(offered - accepted)}"


def test_probe_refuses_a_repeated_value_instead_of_merging_its_rows(digits_store, capsys):
    assert cli.main(["probe", digits_store, "--epsilons", "1,1", "--seeds", "2"]) == 2
    assert "--epsilons: 1 given more than once" in capsys.readouterr().err
    assert cli.main(["probe", digits_store, "--steps", "5,5", "--seeds", "2"]) == 2
    assert "--steps: 5 given more than once" in capsys.readouterr().err


@pytest.mark.parametrize("seeds", [1, 2])
def test_probe_table_repeats_no_column(digits_store, seeds):
    from dpprobe.pipelines import probe_table, run_probe

    results = run_probe(digits_store, epsilons=[1, 8, float("inf")], seeds=seeds, steps=[3],
                        quiet=True)
    lines = probe_table(results).splitlines()
    header = re.split(r"\s{2,}", lines[1].strip())
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines[3:3 + len(results["summary"])]]
    private = [row for row in rows if not row[0].startswith("inf")]
    epsilons = [row[0] for row in private]
    repeats = [header[j] for j in range(1, len(header)) if [row[j] for row in private] == epsilons]
    assert not repeats, f"{repeats} repeat the epsilon column: {header} {rows}"
