"""The demo job: the default data through ScatterNet, the epsilon sweep with the probe's
defaults, a paid tune at epsilon 3, the trade-off plot; a second run reuses the features."""

import json
import math

import pytest

from dpprobe.checks import ConfigError
from dpprobe.pipelines import DemoConfig, cli


@pytest.mark.slow
def test_demo_on_digits_shows_the_trade_off_and_reuses_its_features(tmp_path, capsys):
    argv = ["demo", "--data", "digits", "--out", str(tmp_path), "--seeds", "2"]
    assert cli.main([*argv, "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""  # --quiet: the final report only, on stdout
    report = captured.out
    assert "inf: non-private" in report and "tuned privately:" in report
    assert "features extracted" in report
    for name in ("results.json", "tune.json", "tradeoff.png"):
        assert f"wrote {tmp_path / name}" in report
    assert ("next: dpprobe finetune --data digits --epsilon 3 --out ft" in report
            and f"dpprobe export --model {tmp_path / 'tuned.safetensors'} --format onnx" in report)
    results = json.loads((tmp_path / "results.json").read_text())
    assert {r["epsilon"] for r in results["runs"]} == {0.5, 1.0, 2.0, 4.0, 8.0, "inf"}
    assert all(math.isfinite(r["test_accuracy"]) for r in results["runs"])
    assert results["recipe"]["optimizer"] == "momentum"  # the probe's defaults
    tune = json.loads((tmp_path / "tune.json").read_text())
    assert tune["privacy"]["epsilon_total"] == pytest.approx(3.0, abs=1e-6)
    assert (tmp_path / "tradeoff.png").read_bytes()[:4] == b"\x89PNG"
    # A second run says, in plain words, that it reused the features.
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert "already extracted by an earlier run, reused" in captured.err
    assert "its 1 chunk already extracted by an earlier run; reused" in captured.err
    assert "reused the features extracted by an earlier run" in captured.out


def test_demo_config_refuses_what_the_demo_cannot_run():
    with pytest.raises(ConfigError, match="seeds: must be >= 1, got 0"):
        DemoConfig(seeds=0)
    with pytest.raises(ConfigError, match="data: must be one of"):
        DemoConfig(data="cifar10")
