"""A step's physical batches summed in one compiled call (`finetune.batch_sums.stacked_sums`):
the same sums as the per-batch calls added in turn, slots past the live batches never read, and
the trainer's result independent of how many batches a call takes."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dpprobe import accounting, dp, finetune
from dpprobe.finetune.batch_sums import stacked_sums
from dpprobe.finetune.batches import STACK_BYTES, batches_per_call, stacked_rows
from dpprobe.finetune.graph_key import graph_key
from tests.finetune.test_finetune_train import NUM_CLASSES, TinyConvNet, _flat


def _stack(rng, m, p):
    images = rng.normal(size=(m, p, 8, 8, 1)).astype(np.float32) * 3
    labels = rng.integers(0, NUM_CLASSES, (m, p))
    mask = (rng.random((m, p)) < 0.8).astype(np.float32)
    rows = np.arange(m * p, dtype=np.int32).reshape(m, p)
    return images, labels, mask, rows


@pytest.mark.parametrize("private", [True, False])
def test_a_stack_sums_its_live_batches_in_turn_and_never_reads_the_rest(rng, private):
    """`stacked_sums` of 3 live batches of 5 = the float64 sum of the per-batch calls in
    turn (to the rounding of float32 work compiled in another program), from a nonzero
    total; NaN images in the 2 slots past them change nothing, bit for bit."""
    graphdef, params, rest = nnx.split(TinyConvNet(nnx.Rngs(0)), nnx.Param, ...)
    structure = (jax.tree.structure(params), jax.tree.structure(rest))
    spec = finetune.FinetuneSpec(NUM_CLASSES, augmult=2, crop_padding=1, flip=True)
    flags = finetune.FinetuneFlags(physical_batch_size=5)
    images, labels, mask, rows = _stack(rng, 5, 5)
    base, step, clip = jax.random.key(3), 7, jnp.float32(0.5)
    with jax.enable_x64(True):
        total = [jnp.full(v.shape, 0.25, jnp.float64) for v in jax.tree.leaves(params)]
    one = finetune.clipped_sum if private else finetune.gradient_sum
    expected = [np.asarray(t, np.float64) for t in total]
    for j in range(3):
        part = one(graphdef, params, rest, jnp.asarray(images[j]), jnp.asarray(labels[j]),
                   jnp.asarray(mask[j]), jnp.asarray(rows[j]), clip,
                   jax.random.fold_in(base, step), spec=spec, flags=flags)
        expected = [e + np.asarray(s, np.float64)
                    for e, s in zip(expected, jax.tree.leaves(part), strict=True)]

    def stacked(images):
        return stacked_sums(graph_key(graphdef), jax.tree.leaves(params), jax.tree.leaves(rest),
                            total, images, labels, mask, rows, np.int32(3), clip, base,
                            np.int32(step), spec=spec, flags=flags, structure=structure,
                            private=private)

    got = stacked(images)
    assert all(v.dtype == np.float64 for v in got)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6)
    poisoned = images.copy()
    poisoned[3:] = np.nan
    for a, b in zip(stacked(poisoned), got, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("clipping", ["bookkeeping", "per_example"])
def test_the_trained_model_does_not_depend_on_the_batches_per_call(rng, clipping):
    """Steps of about 4 physical batches (Poisson), summed 1, 3 (a last call partly filled)
    or 8 (all) at a time: the same model (same keys and sampler), bit for bit between the
    looped calls (3 and 8), to float rounding against one batch a call."""
    images = rng.normal(size=(48, 8, 8, 1)).astype(np.float32)
    labels = np.arange(48) % NUM_CLASSES
    plan = accounting.DpPlan(1.0, 3, 0.5, 1.0)
    spec = finetune.FinetuneSpec(NUM_CLASSES, learning_rate=0.2, augmult=2, crop_padding=1,
                                 flip=True, ema_decay=0.9)
    keys = dp.make_keys(2)
    out = []
    for per_call in (1, 3, 8):
        flags = finetune.FinetuneFlags(physical_batch_size=6, clipping=clipping,
                                       batches_per_call=per_call)
        result = finetune.train_finetune(TinyConvNet(nnx.Rngs(0)), images, labels, plan, spec,
                                         keys=keys, flags=flags, rng=np.random.default_rng(2))
        assert result.batch_sizes.max() > 12  # at least 3 physical batches in some step
        out.append([_flat(nnx.state(m, nnx.Param)) for m in (result.model, result.ema_model)])
    assert np.abs(out[0][0]).max() > 0
    for a, b, c in zip(*out, strict=True):  # one batch a call is a program without the loop
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(c, b)


def test_batches_per_call_covers_a_poisson_step_within_the_byte_budget():
    flags = finetune.FinetuneFlags(physical_batch_size=64)
    gpu = functools.partial(batches_per_call, flags, 2048.0, backend="gpu")
    assert gpu(3 * 32 * 32) == math.ceil((2048 + 4 * math.sqrt(2048) + 1) / 64) == 35
    assert gpu(224 * 224 * 3) == STACK_BYTES // (64 * 224 * 224 * 3) == 6
    assert gpu(10**9) == 1
    assert batches_per_call(flags, 2048.0, 3 * 32 * 32, backend="cpu") == 1
    assert batches_per_call(finetune.FinetuneFlags(batches_per_call=5), 1e6, 10**9) == 5
    with pytest.raises(ValueError, match="batches_per_call"):
        finetune.FinetuneFlags(batches_per_call=0)


def test_stacked_rows_packs_a_group_and_zeros_the_rest():
    images = np.arange(1, 11, dtype=np.uint8).reshape(10, 1, 1, 1)
    labels = np.arange(10) % 3
    group = [(np.array([4, 5, 6]), np.ones(3, np.float32)),
             (np.array([7, 12, 13]), np.array([1, 1, 0], np.float32))]  # 12, 13: canaries'
    stacked, rows, mask, index = stacked_rows(images, np.append(labels, [0, 0, 0]), group,
                                              first=2, m=3)
    assert stacked.shape == (3, 3, 1, 1, 1) and index.dtype == np.int32
    np.testing.assert_array_equal(stacked[:, :, 0, 0, 0], [[3, 4, 5], [6, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(index, [[4, 5, 6], [7, 12, 13], [0, 0, 0]])
    np.testing.assert_array_equal(mask, [[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    np.testing.assert_array_equal(rows[:2], [[2, 0, 1], [2, 0, 0]])


def test_a_count_outside_the_stack_reads_no_slot_twice(rng):
    """count is clipped to [0, m]: above m, the whole stack once; 0, the total as it came
    (with m = 1 too, where no loop is traced)."""
    graphdef, params, rest = nnx.split(TinyConvNet(nnx.Rngs(0)), nnx.Param, ...)
    structure = (jax.tree.structure(params), jax.tree.structure(rest))
    spec, flags = finetune.FinetuneSpec(NUM_CLASSES), finetune.FinetuneFlags(physical_batch_size=4)
    with jax.enable_x64(True):
        total = [jnp.full(v.shape, 0.5, jnp.float64) for v in jax.tree.leaves(params)]
    for m in (1, 2):
        stack = _stack(rng, m, 4)

        def summed(count, stack=stack):
            return stacked_sums(graph_key(graphdef), jax.tree.leaves(params),
                                jax.tree.leaves(rest), total, *stack, np.int32(count),
                                jnp.float32(1.0), jax.random.key(0), np.int32(0), spec=spec,
                                flags=flags, structure=structure, private=True)

        for a, b in zip(summed(m + 3), summed(m), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(summed(0), total, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert any(np.abs(np.asarray(a) - 0.5).max() > 0 for a in summed(m))
