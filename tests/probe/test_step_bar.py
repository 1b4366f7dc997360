"""The step bar's heartbeat: a long compile or block of steps never leaves stderr silent."""

import io

import numpy as np

from dpprobe import accounting, probe
from dpprobe.probe import step_bar as step_bar_module
from tests.conftest import fixed_keys


def test_the_note_shows_after_a_silence_and_a_step_clears_it(monkeypatch):
    """Still for less than the interval: nothing new; past it: what the job waits for and for
    how long; a landed step clears the note."""
    clock = [100.0]
    monkeypatch.setattr(step_bar_module.time, "monotonic", lambda: clock[0])
    out = io.StringIO()
    bar = step_bar_module.StepBar(total=10, file=out, heartbeat=3600.0)  # the test ticks it
    bar.wait_for("compiling the steps")
    clock[0] += 2.0
    bar.note_if_still(3.0)
    assert "compiling" not in out.getvalue()
    clock[0] += 10.0
    bar.note_if_still(3.0)
    assert "compiling the steps, 12 s" in out.getvalue()
    bar.update(1)
    assert bar.postfix == ""
    clock[0] += 1.0
    bar.note_if_still(3.0)
    assert bar.postfix == ""
    bar.close()


def test_a_disabled_bar_starts_no_thread():
    bar = step_bar_module.step_bar(10, False, "probe steps")
    assert bar._beat is None
    bar.update(1)
    bar.close()


def test_train_probe_names_the_compile_while_it_runs(rng, monkeypatch, capsys):
    """With a heartbeat of 10 ms, the compile of a program never seen before (an odd shape)
    outlasts it: stderr says what the job waits for before the first step lands. The old bar
    printed nothing until the compiled call returned."""
    monkeypatch.setattr(step_bar_module, "HEARTBEAT_SECONDS", 0.01)
    features = rng.normal(size=(37, 13)).astype(np.float32)
    labels = rng.integers(0, 3, 37)
    runs = [probe.RunSpec(accounting.DpPlan(1.3, 5, clip_norm=1.0), 0.1)]
    result = probe.train_probe(features, labels, runs, fixed_keys(1, 5),
                               probe.ProbeSpec(3, optimizer="adam"), progress=True)
    assert np.isfinite(result.params["w"]).all()
    err = capsys.readouterr().err
    assert "compiling the first step, 0 s" in err
    assert "compiling the steps, 0 s" in err
