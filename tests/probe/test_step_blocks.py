"""The step bar: blocks of steps sized from the time per step, waited for, results unchanged."""

import math

import numpy as np
import pytest

from dpprobe import accounting, probe
from dpprobe.probe import step as step_module
from tests.conftest import fixed_keys, random_problem


class _Bar:
    def __init__(self, disable=False):
        self.disable, self.n = disable, 0

    def update(self, count):
        self.n += count


def test_blocks_grow_to_the_bar_interval_and_cover_every_step_once(monkeypatch):
    """With 1/8 s per step, blocks grow 1, 4, then hold at 16 steps (2 s): the bar moves every
    2 s, never after one long silent call (the old 20 equal blocks were 49 steps here)."""
    clock = [0.0]
    monkeypatch.setattr(step_module.time, "perf_counter", lambda: clock[0])
    bar, blocks = _Bar(), []
    for start, stop in step_module.step_blocks(1000, bar, seconds=2.0):
        blocks.append((start, stop))
        clock[0] += 0.125 * (stop - start)  # the caller runs (and waits for) the block
    sizes = [stop - start for start, stop in blocks]
    assert sizes[:3] == [1, 4, 16] and set(sizes[2:-1]) == {16}
    assert blocks[0][0] == 1 and blocks[-1][1] == 1000
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:], strict=False))
    assert bar.n == 999
    assert list(step_module.step_blocks(1000, _Bar(disable=True))) == [(1, 1000)]
    assert list(step_module.step_blocks(1, _Bar(disable=True))) == []


@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_the_bar_changes_no_result(rng, optimizer):
    """Blocks of 1, 4, 16, ... steps (bar on; these steps take microseconds) or one block (bar
    off): the same program over the same steps, so the same parameters, bit for bit."""
    features, labels, _ = random_problem(rng, n=64, d=8, c=3)
    sigma = accounting.calibrate_noise_multiplier(2.0, 1e-5, steps=30)
    runs = [probe.RunSpec(accounting.DpPlan(sigma, 30, clip_norm=1.0), 0.1),
            probe.RunSpec(accounting.DpPlan(0.0, 30, clip_norm=math.inf), 0.1)]
    spec = probe.ProbeSpec(3, optimizer=optimizer)
    keys = fixed_keys(2, 3)
    shown = probe.train_probe(features, labels, runs, keys, spec, progress=True)
    hidden = probe.train_probe(features, labels, runs, keys, spec, progress=False)
    for name in ("w", "b"):
        np.testing.assert_array_equal(shown.params[name], hidden.params[name])
