"""`dpprobe.dp` imports its names on first use: the probe's trainer loads neither SciPy nor
Flax (the audit's and the finetune clipper's dependencies), and every public name resolves."""

import subprocess
import sys

import dpprobe.dp as dp


def test_every_public_name_resolves_to_its_module():
    for name in dp.__all__:
        value = getattr(dp, name)
        assert value is getattr(sys.modules[dp._LAZY[name]], name)
    assert sorted(dp.__all__) == sorted(dp._LAZY)
    assert set(dp.__all__) <= set(dir(dp))


def test_an_unknown_name_is_an_attribute_error():
    try:
        dp.no_such_name  # noqa: B018
    except AttributeError as err:
        assert "no_such_name" in str(err)
    else:
        raise AssertionError("an unknown name resolved")


def test_the_probe_trainer_loads_neither_scipy_stats_nor_flax():
    code = ("import sys, dpprobe.probe.train, dpprobe.probe.evaluation; "
            "print(sorted({'scipy.stats', 'flax'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout.strip()
    assert out == "[]"
