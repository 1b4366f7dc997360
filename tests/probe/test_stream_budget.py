"""The streamed trainer within a memory budget: runs split into groups and chunks cut to the rows
the budget leaves (`probe.budget`), with the same result as one unbounded pass. The small twin
of benchmarks/probe_load.py (1,000 runs on an ImageNet-shaped store)."""

import math

import numpy as np
import pytest

import dpprobe.probe.streaming  # noqa: F401 (loads the submodule)
from dpprobe import accounting, extract, probe
from dpprobe.probe import budget
from tests.conftest import calibrated_runs, fixed_keys

D, C = 8, 3
PER_RUN = budget.STATE_BYTES_PER_PARAM * (D + 1) * C


def _row_bytes(summed_runs):
    return budget.ROW_BYTES_PER_FEATURE * D + budget.ROW_BYTES_PER_LOGIT * summed_runs * C


def _runs(count, steps):
    """`count` runs, clip norms 1 and 2 alternating, learning rates varying."""
    return [probe.RunSpec(accounting.DpPlan(1.5, steps, clip_norm=1.0 + i % 2), 0.05 + 0.01 * i)
            for i in range(count)]


def test_plan_groups_and_rows_follow_the_budget():
    runs = _runs(12, steps=3)
    # Exactly 5 runs fit with MIN_ROWS rows (6 do not), so 12 runs take 3 equal groups of 4, and
    # the rows per call are what 4 runs' state leaves.
    fit = 5 * PER_RUN + budget.MIN_ROWS * _row_bytes(5)
    assert 6 * PER_RUN + budget.MIN_ROWS * _row_bytes(6) > fit
    plan = probe.plan_stream(runs, D, C, budget=fit)
    assert plan.groups == (range(0, 4), range(4, 8), range(8, 12))
    assert plan.max_rows == (fit - 4 * PER_RUN) // _row_bytes(4)
    assert probe.plan_stream(runs, D, C, budget=fit, chunk_rows=100).max_rows == 100
    # One step: a chunk call sums once per clip norm (2), not once per run.
    one_step = probe.plan_stream(_runs(12, steps=1), D, C, budget=fit)
    assert one_step.max_rows == (fit - 12 * PER_RUN) // _row_bytes(2)
    assert one_step.groups == (range(12),)
    # A budget below one run still trains, one run per group and MIN_ROWS rows per call.
    tiny = probe.plan_stream(runs[:3], D, C, budget=1)
    assert tiny.groups == (range(0, 1), range(1, 2), range(2, 3))
    assert tiny.max_rows == budget.MIN_ROWS
    with pytest.raises(ValueError, match="memory_budget"):
        probe.PerformanceFlags(memory_budget=0)


def _store(path, rng, rows=1200, chunk=500):
    features = rng.normal(size=(rows, D)).astype(np.float32)
    labels = rng.integers(0, C, size=rows)
    labels[7] = C + 4  # outside [0, C): a null row in every cut
    writer = extract.SplitWriter(
        str(path), "train", num_rows=rows, feature_shape=(D,), dtype="float32",
        provenance={"backbone": {"name": "x"}, "dataset": {"name": "y", "num_classes": C}},
        rows_per_chunk=chunk,
    )
    for index in writer.pending_chunks():
        a, b = writer.chunk_rows(index)
        writer.write_chunk(index, features[a:b], labels[a:b])
    writer.finalize()
    return features, labels


def test_a_sweep_split_by_the_budget_equals_one_pass(tmp_path, rng, monkeypatch):
    _, labels = _store(tmp_path / "s.zarr", rng)
    spec = probe.ProbeSpec(C, optimizer="adam")
    runs = _runs(11, steps=2) + calibrated_runs([math.inf], steps=1, lr=0.1)
    keys = fixed_keys(len(runs), 3)
    passes, call_rows = [], []

    def chunks():
        passes.append(1)
        return extract.iter_split_chunks(str(tmp_path / "s.zarr"), "train")

    chunk_sums = probe.streaming._chunk_sums

    def spy(params, features, *args, **kwargs):
        call_rows.append((features.shape[0], params["w"].shape[0]))
        return chunk_sums(params, features, *args, **kwargs)

    def train(memory_budget):
        passes.clear()
        call_rows.clear()
        flags = probe.PerformanceFlags(memory_budget=memory_budget)
        return probe.train_probe_streaming(chunks, runs, keys, spec, num_examples=len(labels),
                                           dim=D, flags=flags)

    monkeypatch.setattr(probe.streaming, "_chunk_sums", spy)
    whole = train(1 << 30)
    assert len(passes) == 2 and {rows for rows, _ in call_rows} == {500}
    fit = 5 * PER_RUN + budget.MIN_ROWS * _row_bytes(5)
    plan = probe.plan_stream(runs, D, C, budget=fit)
    assert len(plan.groups) == 3 and budget.MIN_ROWS <= plan.max_rows < 500
    split = train(fit)
    # Each group streams the store once per step of its longest run.
    assert len(passes) == sum(max(runs[i].plan.steps for i in g) for g in plan.groups)
    assert {rows for rows, _ in call_rows} == {plan.max_rows}
    assert max(p for _, p in call_rows) == max(len(g) for g in plan.groups)
    for name in ("w", "b"):
        np.testing.assert_allclose(split.params[name], whole.params[name], rtol=1e-5,
                                   atol=1e-7)
    np.testing.assert_allclose(split.clipped_fraction, whole.clipped_fraction, rtol=1e-6)


def test_evaluation_in_slices_of_runs_counts_the_same(rng, monkeypatch):
    """Many runs are evaluated a slice at a time (`EVAL_CALL_BYTES`); the counts are exact, so
    they equal one call's over every run, and each run's own alone."""
    import dpprobe.probe.evaluation  # noqa: F401 (loads the submodule)
    from dpprobe import probe

    x = rng.normal(size=(1500, D)).astype(np.float32)
    labels = rng.integers(0, C, size=1500)
    params = {"w": rng.normal(size=(11, D, C)).astype(np.float32),
              "b": rng.normal(size=(11, C)).astype(np.float32)}
    whole = probe.evaluation.count_totals(params, [(x, labels)])
    calls = []
    block_counts = probe.evaluation._block_counts

    def spy(part, *args, **kwargs):
        calls.append(part["w"].shape[0])
        return block_counts(part, *args, **kwargs)

    monkeypatch.setattr(probe.evaluation, "_block_counts", spy)
    # Room for 4 runs' logits per call: 11 runs in 3 slices of 4, 4, 3, for each of 2 blocks.
    monkeypatch.setattr(probe.evaluation, "EVAL_CALL_BYTES",
                        4 * 32 * probe.EVAL_BLOCK_ROWS * C)
    sliced = probe.evaluation.count_totals(params, [(x, labels)])
    assert calls == [4, 4, 3] * 2
    for got, want in zip(sliced, whole, strict=True):
        np.testing.assert_array_equal(got, want)
    alone = probe.evaluation.count_totals({k: v[9:10] for k, v in params.items()}, [(x, labels)])
    np.testing.assert_array_equal(sliced[0][9:10], alone[0])
