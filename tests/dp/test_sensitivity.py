"""Floating-point sensitivity: on N aligned rows of norm C (the adversarial case for rounding),
nulling one row moves the sum each trainer hands to the noise by at most C (1 + 1e-6),
measured in float64 (`dp.accumulate`). benchmarks/sensitivity.py runs the same pair at
N = 10^4 .. 10^7 through `--stream`; here N is a few thousand, where a float32 sum already
breaks the bound (its rounding is relative to N C, not to C)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpprobe.probe.poisson
import dpprobe.probe.streaming
import dpprobe.probe.train  # noqa: F401  (submodules the lazy package loads on first use)
from dpprobe import accounting, dp, probe

CLIP = 1.0
NUM_CLASSES = 3
SPEC = probe.ProbeSpec(NUM_CLASSES, optimizer="sgd")


def aligned_rows(num_rows: int):
    """`num_rows` copies of one row whose gradient is clipped (every contribution is C, all
    aligned), and the same rows with row 0 made a null record (its label outside the classes):
    zero-out neighbours."""
    row = np.array([3.1, -1.7, 2.3, 0.7, -2.9], np.float32) * 7.3
    features = np.tile(row, (num_rows, 1))
    labels = np.zeros(num_rows, np.int64)
    nulled = labels.copy()
    nulled[0] = dp.NULL_LABEL
    return features, labels, nulled


def flat64(sums) -> np.ndarray:
    return np.concatenate([np.asarray(sums["w"], np.float64).ravel(),
                           np.asarray(sums["b"], np.float64).ravel()])


def spied_sums(monkeypatch, module, name: str, sums_arg: int, train):
    """The clipped sums `train()` hands to `module.name` (the DP update) at step 0, float64.

    A Python-loop trainer calls it on the host; a compiled trainer's call is traced, so the
    sums come back through `jax.debug.callback`, float64 as its bits (the callback may run
    in a thread where x64 is off, which would round it to float32)."""
    real, seen = getattr(module, name), []

    def record(wide, sums):
        if wide:
            sums = jax.tree.map(lambda s: np.ascontiguousarray(s).view(np.float64)[..., 0], sums)
        seen.append(flat64(sums))

    def spy(*args, **kwargs):
        sums = args[sums_arg]
        if not isinstance(jax.tree.leaves(sums)[0], jax.core.Tracer):
            seen.append(flat64(sums))
        else:
            wide = jax.tree.leaves(sums)[0].dtype == jnp.float64
            bits = (jax.tree.map(lambda s: jax.lax.bitcast_convert_type(s, jnp.uint32), sums)
                    if wide else sums)
            jax.debug.callback(functools.partial(record, wide), bits)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    jax.clear_caches()  # retrace the compiled trainers, so that they call the spy
    train()
    jax.effects_barrier()
    monkeypatch.setattr(module, name, real)
    jax.clear_caches()
    return seen[0]


def run():
    plan = accounting.DpPlan(1.0, 1, clip_norm=CLIP)
    return [probe.RunSpec(plan, 1.0)], dp.make_keys(1)


def in_memory(features, labels, mesh=False):
    runs, keys = run()
    flags = probe.PerformanceFlags(mesh=probe.make_data_mesh(1) if mesh else None)
    return probe.train_probe(features, labels, runs, keys, SPEC, flags=flags)


def streamed(features, labels, rows_per_chunk=1024):
    runs, keys = run()

    def chunks():
        for start in range(0, len(labels), rows_per_chunk):
            yield features[start:start + rows_per_chunk], labels[start:start + rows_per_chunk]

    return probe.train_probe_streaming(
        chunks, runs, keys, SPEC, num_examples=len(labels), dim=features.shape[-1],
        flags=probe.PerformanceFlags(rows_per_chunk=rows_per_chunk))


def poisson(features, labels):
    runs, keys = run()
    return probe.train_probe_poisson(features, labels, runs, keys, SPEC,
                                     flags=probe.PerformanceFlags(physical_batch_size=512),
                                     rng=np.random.default_rng(0))


def in_memory_views(features, labels):
    """Two identical views per example: the sum over (N, views, d) rows, not the single-view
    one (`probe.clipping`)."""
    return in_memory(np.stack([features, features], axis=1), labels)


def in_memory_small_blocks(features, labels):
    """Blocks of 64 rows: what `dp.accumulate.sum_block_rows` gives a small sum over wide rows
    (one run on 3,969 features: 128), here on the aligned rows' 5 features."""
    from unittest import mock

    from dpprobe.dp import accumulate

    with mock.patch.object(accumulate, "BLOCK_BYTES", 8 * features.shape[-1] * 64):
        return in_memory(features, labels)


TRAINERS = {
    "in_memory": (probe.train, "dp_update", 3, in_memory),
    "in_memory_small_blocks": (probe.train, "dp_update", 3, in_memory_small_blocks),
    "in_memory_views": (probe.train, "dp_update", 3, in_memory_views),
    "sharded": (probe.train, "dp_update", 3, lambda x, y: in_memory(x, y, mesh=True)),
    "streamed": (probe.streaming, "dp_update_jit", 3, streamed),
    "poisson": (probe.poisson, "dp_update_jit", 3, poisson),
}


@pytest.mark.parametrize("trainer", TRAINERS)
def test_nulling_one_aligned_row_moves_the_sum_by_at_most_c(monkeypatch, trainer):
    module, name, sums_arg, train = TRAINERS[trainer]
    features, labels, nulled = aligned_rows(8192)
    full = spied_sums(monkeypatch, module, name, sums_arg, lambda: train(features, labels))
    other = spied_sums(monkeypatch, module, name, sums_arg, lambda: train(features, nulled))
    moved = np.linalg.norm(full - other) / CLIP
    assert 1 - 1e-3 < moved <= 1 + 1e-6, moved  # the row is clipped: it moves it by ~C


def test_compensated_sum_is_exact_where_a_float64_loop_is_not():
    """Neumaier's sum of 1, 1e100, 1, -1e100 is 2 (a plain float64 loop gives 0), and of 10^5
    copies of 0.1 it is within one rounding of the exact 10^4 * float64(0.1)."""
    from dpprobe.dp.accumulate import CompensatedSum

    total = CompensatedSum()
    for value in (1.0, 1e100, 1.0, -1e100):
        total.add({"a": np.array([value])})
    assert float(total.value()["a"][0]) == 2.0
    total = CompensatedSum()
    part = {"a": np.full(3, 0.1, np.float32)}
    for _ in range(10_000):
        total.add(part)
    exact = 10_000 * float(np.float32(0.1))
    assert abs(float(total.value()["a"][0]) - exact) <= math.ulp(exact)


def test_add_float64_keeps_float64():
    from dpprobe.dp.accumulate import add_float64

    total = None
    for _ in range(3):
        total = add_float64(total, {"a": np.full(2, 2.0**-30, np.float32)})
    assert total["a"].dtype == np.float64
    np.testing.assert_array_equal(np.asarray(total["a"]), 3 * 2.0**-30)


@pytest.mark.parametrize("rows", [7, 64, 65, 200, 257])
def test_row_block_sum_is_the_float64_sum_over_every_row_once(rows):
    """Blocks of at most 64 rows (the last one overlapping the one before, its repeated rows
    weighted 0) give the float64 X^T W and column sums of W, every row counted once."""
    from dpprobe.dp.accumulate import row_block_sum, x64_jit

    rng = np.random.default_rng(rows)
    inputs = rng.normal(size=(rows, 3)).astype(np.float32)
    weights = rng.normal(size=(rows, 2)).astype(np.float32)

    def block_sum(x, w):
        return {"xw": jnp.einsum("nd,nc->dc", x, w, preferred_element_type=jnp.float64),
                "w": jnp.sum(w, axis=0, dtype=jnp.float64)}

    sums = x64_jit(lambda x, w: row_block_sum(block_sum, x, w, block_rows=64))(inputs, weights)
    x64, w64 = inputs.astype(np.float64), weights.astype(np.float64)
    assert sums["xw"].dtype == np.float64
    np.testing.assert_allclose(np.asarray(sums["xw"]), x64.T @ w64, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(np.asarray(sums["w"]), w64.sum(0), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("block_rows", [0, 2**15 + 1])
def test_row_block_sum_refuses_blocks_beyond_the_bound(block_rows):
    """The bound of `dp.accumulate` holds for blocks of at most `MAX_BLOCK_ROWS` rows: a larger
    block (or none) is refused, not summed with a looser bound than the docstring states."""
    from dpprobe.dp.accumulate import MAX_BLOCK_ROWS, row_block_sum

    assert MAX_BLOCK_ROWS == 2**15
    rows = np.ones((4, 2), np.float32)
    with pytest.raises(ValueError, match="block_rows"):
        row_block_sum(lambda x, w: {"xw": x.T @ w}, rows, rows, block_rows=block_rows)


@pytest.mark.parametrize("rows,shape", [(1, (130, 128)), (31, (130, 128)), (32, (130, 128)),
                                        (65, (130, 128)), (100, (130, 128)), (70, (4, 5))])
def test_weighted_rows_sum_is_each_row_once_within_gamma_n(rows, shape):
    """The float64 weighted sum over examples (unrolled blocks of 32 rows in a loop above 2^14
    entries per row, a plain reduction below) counts every row once, with its weight, and rounds
    within gamma_n sum |w_i x_i| of the exact sum (80-bit reference); a row weighted 0 adds
    nothing, whatever it holds."""
    from dpprobe.dp.accumulate import weighted_rows_sum, x64_jit

    rng = np.random.default_rng(rows)
    x = (rng.normal(size=(rows, *shape)) * 2.0 ** rng.integers(-30, 30, (rows, 1, 1))).astype(
        np.float32)
    w = rng.random(rows).astype(np.float32)
    w[rows // 2] = 0.0
    x[rows // 2] = np.float32(3e38)  # weighted 0: must add exactly nothing
    got = x64_jit(lambda x, w: weighted_rows_sum(x, w, jnp.float64))(x, w)
    assert got.dtype == np.float64
    terms = x.astype(np.longdouble) * w.astype(np.longdouble)[:, None, None]
    exact = terms.sum(axis=0)
    gamma = rows * 2.0**-53 / (1 - rows * 2.0**-53)
    bound = gamma * np.abs(terms).sum(axis=0)
    assert np.all(np.abs(np.asarray(got).astype(np.longdouble) - exact) <= bound)


def test_add_float64_returns_a_float64_first_part_as_it_is():
    from dpprobe.dp.accumulate import add_float64

    with jax.enable_x64(True):
        part = {"a": jnp.full(2, 0.5, jnp.float64)}
    assert add_float64(None, part) is part
    total = add_float64(add_float64(None, part), {"a": np.full(2, 0.25, np.float32)})
    assert total["a"].dtype == np.float64
    np.testing.assert_array_equal(np.asarray(total["a"]), 0.75)


def test_sum_block_rows_keeps_a_small_sums_blocks_in_cache():
    """Rows per float64 block from public shapes: a power of two whose block fits
    `BLOCK_BYTES` for a sum of at most `SMALL_SUM_BYTES` or of at most `SMALL_SUM_WIDTH`
    entries per feature, else `SUM_BLOCK_ROWS`."""
    from dpprobe.dp.accumulate import SUM_BLOCK_ROWS, sum_block_rows

    assert sum_block_rows(8 * 3969, 8 * 10 * 3969) == 128  # one run, 10 classes, 3,969 features
    assert sum_block_rows(8 * 3969, 8 * 30 * 3969) == 128  # three runs: 0.95 MB
    assert sum_block_rows(8 * 3969, 8 * 150 * 3969) == SUM_BLOCK_ROWS  # fifteen: 4.8 MB
    assert sum_block_rows(8 * 768, 8 * 10 * 768) == 512
    assert sum_block_rows(8 * 5, 8 * 3 * 5) == SUM_BLOCK_ROWS  # narrow rows: at most 1,024
    assert sum_block_rows(8 * 10**6, 8 * 10) == 32  # at least 32
    # One run of 10 classes on ScatterNet's 20,736 / 15,552 features (sums of 1.7 / 1.2 MB):
    # narrow, so in cache, not in 1,024-row blocks of 170 / 127 MB.
    assert sum_block_rows(8 * 20736, 8 * 10 * 20736) == 32
    assert sum_block_rows(8 * 15552, 8 * 10 * 15552) == 32
    assert sum_block_rows(8 * 3 * 15552, 8 * 10 * 15552, views=3) == 32  # three views each
    # Three runs of 10 classes: not narrow, with one view or with three.
    assert sum_block_rows(8 * 3 * 15552, 8 * 30 * 15552, views=3) == SUM_BLOCK_ROWS
    assert sum_block_rows(8 * 15552, 8 * 30 * 15552) == SUM_BLOCK_ROWS  # three runs: 3.7 MB
    assert sum_block_rows(8 * 2048, 8 * 100 * 2048) == SUM_BLOCK_ROWS  # 100 classes: 1.6 MB
