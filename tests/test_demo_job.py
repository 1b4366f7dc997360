"""The demo job: the default data through ScatterNet, then the epsilon sweep."""

import json
import math

import pytest

from pipelines import DemoConfig, cli
from pipelines.config import ConfigError


def test_demo_on_digits(tmp_path, capsys):
    assert cli.main(["demo", "--data", "digits", "--out", str(tmp_path), "--quiet",
                     "--seeds", "2"]) == 0
    table = capsys.readouterr().out
    assert "inf" in table
    results = json.loads((tmp_path / "results.json").read_text())
    assert {r["epsilon"] for r in results["runs"]} == {0.5, 1.0, 2.0, 4.0, 8.0, "inf"}
    assert all(math.isfinite(r["test_accuracy"]) for r in results["runs"])


def test_demo_config_refuses_what_the_demo_cannot_run():
    with pytest.raises(ConfigError, match="seeds: must be >= 1, got 0"):
        DemoConfig(seeds=0)
    with pytest.raises(ConfigError, match="data: must be one of"):
        DemoConfig(data="cifar10")
