"""The account job: epsilon from a noise multiplier, or the noise multiplier for an epsilon."""

import json

import pytest

from dpprobe import accounting
from dpprobe.pipelines import AccountConfig, account, cli


def test_account_both_directions(capsys):
    assert cli.main(["account", "--epsilon", "1", "--delta", "1e-5", "--steps", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["noise_multiplier"] == pytest.approx(
        accounting.calibrate_noise_multiplier(1.0, 1e-5, steps=4))
    assert out["epsilon"] == pytest.approx(1.0, abs=1e-3)
    assert out["neighboring_relation"] == "zero_out" and out["accountant"] == "pld"
    assert cli.main(["account", "--sigma", str(out["noise_multiplier"]), "--steps", "4"]) == 0
    assert "epsilon 1" in capsys.readouterr().out


def test_account_takes_its_config_or_keywords():
    by_keywords = account(epsilon=1.0, delta=1e-5, steps=4)
    by_config = account(AccountConfig(epsilon=1.0, delta=1e-5, steps=4))
    assert by_keywords == by_config
    with pytest.raises(TypeError, match="not both"):
        account(AccountConfig(epsilon=1.0), steps=2)
    with pytest.raises(ValueError, match="exactly one of `epsilon` and `noise_multiplier`"):
        AccountConfig()
