"""The finetuning trainer: the DP contract (tests/contract.py), its clipped sum against a loop
of single-example gradients, augmentation multiplicity and EMA against their formulas."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dpprobe import accounting, dp, finetune, probe
from tests.conftest import with_test_xla_flags
from tests.contract import NUM_CLASSES, TrainerContract


class ProbeAsModel(nnx.Module):
    """The linear probe as an NNX model (per-example normalization, then a zero-init linear
    layer): the finetuning trainer on it must meet the same contract as the probe's."""

    def __init__(self, dim: int, spec: probe.ProbeSpec):
        self.spec = spec
        self.w = nnx.Param(jnp.zeros((dim, spec.num_classes)))
        self.b = nnx.Param(jnp.full((spec.num_classes,), spec.initial_bias))

    def __call__(self, x):
        x = probe.normalize_features(x.reshape(x.shape[0], -1), self.spec.normalization,
                                     groups=self.spec.groups)
        return x @ self.w + self.b


@dataclasses.dataclass(frozen=True)
class _Result:
    params: dict


class _FinetuneContract(TrainerContract):
    physical_batch_size = 8

    def train(self, features, labels, runs, spec):
        views = 1 if features.ndim == 2 else features.shape[1]
        images = features.reshape(len(labels), *((views,) if views > 1 else ()), 1, 1, -1)
        w, b = [], []
        for run in runs:
            model = ProbeAsModel(features.shape[-1], spec)
            recipe = finetune.FinetuneSpec(spec.num_classes, optimizer="sgd",
                                           learning_rate=run.learning_rate, augmult=views,
                                           ema_decay=None)
            result = finetune.train_finetune(
                model, images, labels, run.plan, recipe,
                flags=finetune.FinetuneFlags(physical_batch_size=self.physical_batch_size))
            w.append(np.asarray(result.model.w[...]))
            b.append(np.asarray(result.model.b[...]))
        return _Result({"w": np.stack(w), "b": np.stack(b)})


class TestFinetuneTrainer(_FinetuneContract):
    """Full batch (q = 1), cut into physical batches of 8."""


class TestFinetunePoissonTrainer(_FinetuneContract):
    sampled = True


# ------------------------------------------------------------------------------------------


class TinyConvNet(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
        self.head = nnx.Linear(4 * 8 * 8, NUM_CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.head(jnp.tanh(self.conv(x)).reshape(x.shape[0], -1))


def _example_grads(model, images, labels):
    """Per-example gradients, one `jax.grad` at a time (float64 flat)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, x, y):
        logits = nnx.merge(graphdef, params, rest)(x[None])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y[None]).mean()

    flat = []
    for x, y in zip(images, labels, strict=True):
        g = jax.grad(loss)(params, jnp.asarray(x, jnp.float32), jnp.asarray(y))
        flat.append(np.concatenate([np.asarray(v, np.float64).ravel()
                                    for v in jax.tree.leaves(g)]))
    return np.stack(flat)


def _flat(tree):
    return np.concatenate([np.asarray(v, np.float64).ravel() for v in jax.tree.leaves(tree)])


def _clipped_sum(model, images, labels, mask, clip, spec, *, key=None):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return finetune.clipped_sum(graphdef, params, rest, jnp.asarray(images),
                                jnp.asarray(labels), jnp.asarray(mask),
                                jnp.arange(len(labels), dtype=jnp.int32), jnp.float32(clip),
                                jax.random.key(0) if key is None else key, spec=spec,
                                flags=finetune.FinetuneFlags(physical_batch_size=len(labels)))


def test_clipped_sum_equals_a_loop_of_clipped_single_example_gradients(rng):
    model = TinyConvNet(nnx.Rngs(0))
    images = rng.normal(size=(10, 8, 8, 1)).astype(np.float32) * 3
    labels = rng.integers(0, NUM_CLASSES, 10)
    mask = np.ones(10, np.float32)
    mask[3] = 0
    spec = finetune.FinetuneSpec(NUM_CLASSES)
    grads = _example_grads(model, images, labels)
    for clip in (0.1, 1.0, 100.0):
        norms = np.linalg.norm(grads, axis=1, keepdims=True)
        expected = (grads * np.minimum(1, clip / norms) * mask[:, None]).sum(0)
        got = _flat(_clipped_sum(model, images, labels, mask, clip, spec))
        np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("clipping", ["bookkeeping", "per_example"])
def test_the_trainers_flat_call_equals_the_state_call(rng, clipping):
    """What the trainer calls (lists of arrays, `structure`, the graph's `graph_key`) gives
    the clipped sum of the documented call on nnx.States, bit for bit, leaf for leaf; the
    non-private `gradient_sum` too."""
    from dpprobe.finetune.graph_key import graph_key

    model = TinyConvNet(nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    structure = (jax.tree.structure(params), jax.tree.structure(rest))
    flags = finetune.FinetuneFlags(physical_batch_size=6, clipping=clipping)
    spec = finetune.FinetuneSpec(NUM_CLASSES)
    arrays = (jnp.asarray(rng.normal(size=(6, 8, 8, 1)).astype(np.float32)),
              jnp.asarray(rng.integers(0, NUM_CLASSES, 6)), jnp.ones(6),
              jnp.arange(6, dtype=jnp.int32), jnp.float32(0.5), jax.random.key(0))
    for fn in (finetune.clipped_sum, finetune.train.gradient_sum):
        tree = fn(graphdef, params, rest, *arrays, spec=spec, flags=flags)
        flat = fn(graph_key(graphdef), jax.tree.leaves(params), jax.tree.leaves(rest),
                  *arrays, spec=spec, flags=flags, structure=structure)
        assert isinstance(flat, list) and len(flat) == len(jax.tree.leaves(tree))
        for a, b in zip(jax.tree.leaves(tree), flat, strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_augmult_averages_the_views_gradients_before_clipping(rng):
    """De et al. eq. 4: clip(mean_k grad(view_k)), the views being `augment_views` of the
    example's key (fold_in(key, row))."""
    model = TinyConvNet(nnx.Rngs(1))
    images = rng.normal(size=(4, 8, 8, 1)).astype(np.float32) * 3
    labels = np.arange(4) % NUM_CLASSES
    spec = finetune.FinetuneSpec(NUM_CLASSES, augmult=3, crop_padding=2, flip=True)
    key = jax.random.key(7)
    expected = 0
    for row in range(4):
        views = finetune.augment_views(jax.random.fold_in(key, row), jnp.asarray(images[row]),
                                       views=3, padding=2, flip=True)
        assert len({np.asarray(v).tobytes() for v in views}) > 1  # the views differ
        mean = _example_grads(model, np.asarray(views), [labels[row]] * 3).mean(0)
        expected = expected + mean * min(1, 0.5 / np.linalg.norm(mean))
    got = _flat(_clipped_sum(model, images, labels, np.ones(4, np.float32), 0.5, spec, key=key))
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-6)


def test_augment_views_are_crops_of_the_padded_image_and_flips():
    image = jnp.arange(5 * 5, dtype=jnp.float32).reshape(5, 5, 1)
    views = np.asarray(finetune.augment_views(jax.random.key(3), image, views=64, padding=2,
                                              flip=True))
    padded = np.pad(np.asarray(image), ((2, 2), (2, 2), (0, 0)), mode="reflect")
    crops = {padded[i:i + 5, j:j + 5].tobytes() for i in range(5) for j in range(5)}
    crops |= {padded[i:i + 5, j:j + 5][:, ::-1].tobytes() for i in range(5) for j in range(5)}
    assert all(v.tobytes() in crops for v in views)
    assert len({v.tobytes() for v in views}) > 10
    same = finetune.augment_views(jax.random.key(3), image, views=2, padding=0, flip=False)
    np.testing.assert_array_equal(np.asarray(same), np.stack([image, image]))


def test_ema_follows_its_formula(rng):
    """ema_t = d_t ema_{t-1} + (1 - d_t) params_t with d_t = min(decay, (1 + t) / (10 + t))
    (De et al., App. C), from ema_0 = the initial parameters."""
    features = rng.normal(size=(30, 1, 1, 4)).astype(np.float32)
    labels = np.arange(30) % NUM_CLASSES
    spec = finetune.FinetuneSpec(NUM_CLASSES, optimizer="sgd", learning_rate=0.5,
                                 ema_decay=0.8)
    model = ProbeAsModel(4, probe.ProbeSpec(NUM_CLASSES))
    trajectory = []
    result = finetune.train_finetune(
        model, features, labels, accounting.DpPlan(1.0, 5, 1.0, 1.0), spec,
        on_step=lambda state, _: trajectory.append(np.asarray(state.params["w"])))
    ema = np.zeros_like(trajectory[0])
    for t, params in enumerate(trajectory):
        decay = min(0.8, (1 + t) / (10 + t))
        ema = decay * ema + (1 - decay) * params
    np.testing.assert_allclose(np.asarray(result.ema_model.w[...]), ema, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(result.model.w[...]), trajectory[-1])


def test_mixed_precision_clips_and_noises_in_float32(rng):
    """bf16 forward/backward: the sum is float64 (A, B and gradients float32 before it, as
    in the float32 model) and within bf16 rounding of the float32 one; each example still
    contributes at most C."""
    model = TinyConvNet(nnx.Rngs(2))
    images = rng.normal(size=(6, 8, 8, 1)).astype(np.float32)
    labels = np.arange(6) % NUM_CLASSES
    spec = finetune.FinetuneSpec(NUM_CLASSES)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    args = (graphdef, params, rest, jnp.asarray(images), jnp.asarray(labels),
            jnp.ones(6, jnp.float32), jnp.arange(6, dtype=jnp.int32), jnp.float32(0.3),
            jax.random.key(0))
    half = finetune.clipped_sum(*args, spec=spec, flags=finetune.FinetuneFlags(
        physical_batch_size=6, mixed_precision=True))
    full = finetune.clipped_sum(*args, spec=spec, flags=finetune.FinetuneFlags(
        physical_batch_size=6))
    assert all(leaf.dtype == np.float64 for leaf in jax.tree.leaves(half))
    assert np.linalg.norm(_flat(half)) <= 6 * 0.3 * (1 + 1e-6)
    np.testing.assert_allclose(_flat(half), _flat(full), atol=0.05)


@pytest.mark.parametrize("bad", ["nan_image", "label"])
def test_null_records_in_images(rng, bad):
    model = TinyConvNet(nnx.Rngs(3))
    images = rng.normal(size=(6, 8, 8, 1)).astype(np.float32)
    labels = np.arange(6) % NUM_CLASSES
    spec = finetune.FinetuneSpec(NUM_CLASSES)
    mask = np.ones(6, np.float32)
    broken_images, broken_labels = images.copy(), labels.copy()
    if bad == "nan_image":
        broken_images[2, 3, 3, 0] = np.nan
    else:
        broken_labels[2] = NUM_CLASSES
    masked = mask.copy()
    masked[2] = 0
    np.testing.assert_allclose(
        _flat(_clipped_sum(model, broken_images, broken_labels, mask, 1.0, spec)),
        _flat(_clipped_sum(model, images, labels, masked, 1.0, spec)), rtol=1e-6, atol=1e-7)


class _Killed(Exception):
    pass


def test_a_killed_run_resumes_to_the_uninterrupted_result(rng, tmp_path):
    """Checkpoints every 2 steps, a crash after step 3; the resumed run restores step 2 (keys,
    sampler, optimizer, EMA) and ends bitwise equal to a run that was never interrupted."""
    images = rng.normal(size=(40, 8, 8, 1)).astype(np.float32)
    labels = np.arange(40) % NUM_CLASSES
    plan = accounting.DpPlan(1.0, 6, 0.25, 1.0)
    spec = finetune.FinetuneSpec(NUM_CLASSES, learning_rate=0.1, augmult=2, crop_padding=1,
                                 flip=True, ema_decay=0.9)
    keys = dp.make_keys(2)
    flags = finetune.FinetuneFlags(physical_batch_size=8)

    def run(**options):
        return finetune.train_finetune(TinyConvNet(nnx.Rngs(0)), images, labels, plan, spec,
                                       keys=keys, flags=flags, rng=np.random.default_rng(5),
                                       **options)

    def crash(state, _):
        if state.step == 3:
            raise _Killed

    with pytest.raises(_Killed):
        run(checkpointer=finetune.Checkpointer(tmp_path, every=2, config={"a": 1}),
            on_step=crash)
    steps_seen = []
    resumed = run(checkpointer=finetune.Checkpointer(tmp_path, every=2, config={"a": 1}),
                  on_step=lambda state, _: steps_seen.append(state.step))
    assert steps_seen == [3, 4, 5, 6]  # no step twice
    whole = run()
    for a, b in ((resumed.model, whole.model), (resumed.ema_model, whole.ema_model)):
        np.testing.assert_array_equal(_flat(nnx.state(a, nnx.Param)),
                                      _flat(nnx.state(b, nnx.Param)))
    with pytest.raises(ValueError, match="another run"):
        finetune.Checkpointer(tmp_path, every=2, config={"a": 2}).restore(
            finetune.init_state(nnx.state(TinyConvNet(nnx.Rngs(0)), nnx.Param), spec, plan,
                                keys[0], len(labels)))


_SHARDED = """
import numpy as np
from flax import nnx
from dpprobe import accounting, dp, finetune
from tests.finetune.test_finetune_train import TinyConvNet, _flat
images = np.random.default_rng(0).normal(size=(64, 8, 8, 1)).astype(np.float32)
labels = np.arange(64) % 3
keys = dp.make_keys(2)
spec = finetune.FinetuneSpec(3, learning_rate=0.2, augmult=2, crop_padding=1, flip=True)
out = []
for devices, per_call in ((1, None), (4, None), (4, 2)):  # 2: a looped stack, as on a GPU
    result = finetune.train_finetune(
        TinyConvNet(nnx.Rngs(0)), images, labels, accounting.DpPlan(1.0, 3, 0.3, 1.0), spec,
        keys=keys, rng=np.random.default_rng(1),
        flags=finetune.FinetuneFlags(physical_batch_size=16, devices=devices,
                                     batches_per_call=per_call))
    out.append(_flat(nnx.state(result.model, nnx.Param)))
assert np.abs(out[0]).max() > 0
for other in out[1:]:
    np.testing.assert_allclose(other, out[0], rtol=1e-5, atol=1e-6)
print("ok")
"""


def test_data_parallel_over_four_devices_equals_one(tmp_path):
    """--devices 4 (forced host devices) trains the same model as one device, up to the order
    of float32 sums, with one physical batch a call or two (the stack's loop)."""
    import os
    import subprocess
    import sys

    four_devices = with_test_xla_flags("--xla_force_host_platform_device_count=4")
    env = dict(os.environ, XLA_FLAGS=four_devices, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", _SHARDED], env=env, capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[2],
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_a_graph_key_is_hashed_once_and_shared_by_equal_graphs():
    """`finetune.graph_key`: a jitted function given the key never rehashes the graph (it
    does on every call given the graph), equal graphs (two splits of one architecture) share
    one key and so one compiled program, another architecture gets another key."""
    from dpprobe.finetune.graph_key import graph_key, graph_of

    class Graph:  # a static argument that counts its hashes
        hashes = 0

        def __init__(self, width):
            self.width = width

        def __hash__(self):
            Graph.hashes += 1
            return hash(self.width)

        def __eq__(self, other):
            return isinstance(other, Graph) and self.width == other.width

    run = jax.jit(lambda g, x: x * graph_of(g).width, static_argnums=0)
    key, x = graph_key(Graph(3)), jnp.ones(2)
    before = Graph.hashes
    for _ in range(5):
        np.testing.assert_array_equal(run(key, x), 3 * x)
    assert Graph.hashes == before
    for _ in range(5):
        run(Graph(3), x)
    assert Graph.hashes >= before + 5  # the bare graph: hashed on every call
    first, second, other = (nnx.split(nnx.Linear(4, w, rngs=nnx.Rngs(0)))[0] for w in (3, 3, 5))
    assert first is not second and first == second
    assert graph_key(second) is graph_key(first) and graph_of(graph_key(first)) == first
    assert graph_key(graph_key(first)) is graph_key(first) and graph_of(first) is first
    assert graph_key(other) != graph_key(first)
    run = jax.jit(lambda g, x: nnx.merge(graph_of(g), nnx.split(nnx.Linear(
        4, 3, rngs=nnx.Rngs(0)))[1])(x), static_argnums=0)
    for graph in (first, second):
        run(graph_key(graph), jnp.ones((2, 4)))
    assert run._cache_size() == 1
