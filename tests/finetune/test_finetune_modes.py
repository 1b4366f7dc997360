"""`--train head|bias|lora` and `--non-private`: only the trained parameters change, get noise
and count; LoRA adapters merge into the released model exactly enough to export it (the
exports: tests/model/test_export.py); the non-private reference is plain SGD on the batch
gradient; results.json records the speed."""

from __future__ import annotations

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dpprobe.dp.optimizers  # noqa: F401 (loads the submodule)
import dpprobe.finetune.models as fm
from dpprobe import accounting, dp, finetune
from dpprobe import model as dpmodel
from dpprobe.dp.canaries import GradientCanaries
from dpprobe.dp.taps import rule_for
from dpprobe.finetune.modes import count_params
from tests.conftest import fixed_keys
from tests.model_helpers import network_file, perturb_nnx, uint8_images
from tests.pipelines.test_finetune_job import FAST, _finetune, _images, _write

CLASSES = 4
TINY_VIT = fm.ViTConfig(image_size=(16, 16), patch_size=(8, 8), in_channels=3, embed_dim=16,
                        depth=2, num_heads=2, head_dim=8, mlp_dim=32)
# Which parameters each mode trains, by name (written out here, not through the filters).
TRAINED = {"head": r"head/.*", "bias": r"(head/.*|.*/bias)", "lora": r"(head/.*|.*/lora_[ab])"}


def _model(family: str, seed: int = 0):
    rngs = nnx.Rngs(seed)
    if family == "vit":
        return fm.VisionTransformer(TINY_VIT, CLASSES, rngs=rngs)
    return fm.create_model(family, CLASSES, image_size=16, in_channels=1, rngs=rngs)


def _params(model) -> dict[str, np.ndarray]:
    return {"/".join(map(str, k)): np.asarray(v[...])
            for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _spec(mode: str, channels: int, **options):
    return finetune.FinetuneSpec(CLASSES, optimizer="sgd", learning_rate=0.5, ema_decay=None,
                                 mean=(0.5,) * channels, std=(0.5,) * channels, train=mode,
                                 **options)


def _noise_sizes(monkeypatch) -> list[int]:
    """The dimension of every noise draw traced from now on (`dp.optimizers.add_noise`)."""
    sizes, original = [], dp.optimizers.add_noise

    def recording(tree, stddev, key):
        sizes.append(sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree)))
        return original(tree, stddev, key)

    monkeypatch.setattr(dp.optimizers, "add_noise", recording)
    finetune.train.dp_update.clear_cache()  # trace again, through the recorder
    return sizes


def _check_only_trained_changed(before: dict, after: dict, pattern: str) -> int:
    """Trained parameters (names matching `pattern`) all changed, the others are bitwise the
    same; returns the trained count."""
    assert set(before) == set(after)
    trained = 0
    for name, value in before.items():
        if re.fullmatch(pattern, name):
            trained += value.size
            assert not np.array_equal(after[name], value), f"{name} was not trained"
        else:
            np.testing.assert_array_equal(after[name], value, err_msg=f"{name} changed")
    return trained


@pytest.mark.parametrize("family,mode,clipping", [
    ("cnn", "head", "bookkeeping"), ("cnn", "bias", "per_example"), ("vit", "head", "bookkeeping"),
    ("vit", "bias", "bookkeeping")])
def test_head_and_bias_modes_train_noise_and_count_only_their_parameters(family, mode, clipping,
                                                                         rng, monkeypatch):
    channels = 3 if family == "vit" else 1
    model = _model(family)
    before = _params(model)
    sizes = _noise_sizes(monkeypatch)
    images, labels = uint8_images(12, 16, channels), rng.integers(0, CLASSES, 12)
    result = finetune.train_finetune(
        model, images.reshape(12, 16, 16, channels), labels,
        accounting.DpPlan(2.0, 2, 1.0, 1.0), _spec(mode, channels), keys=fixed_keys(2, 0),
        flags=finetune.FinetuneFlags(physical_batch_size=8, clipping=clipping))
    trained = _check_only_trained_changed(before, _params(result.model), TRAINED[mode])
    assert sizes and set(sizes) == {trained}  # the noise has the trained dimension only
    head = before["head/kernel"].size + before["head/bias"].size
    assert trained == head if mode == "head" else trained > head
    assert all(np.array_equal(v, before[k])  # the given model is not modified
               for k, v in _params(model).items())


def test_lora_trains_only_adapters_and_the_head_and_releases_them_merged(rng, tmp_path,
                                                                         monkeypatch):
    model = finetune.add_lora(_model("vit"), 2, rngs=nnx.Rngs(1))
    before = _params(model)
    sizes = _noise_sizes(monkeypatch)
    images, labels = uint8_images(12, 16, 3), rng.integers(0, CLASSES, 12)
    spec = _spec("lora", 3)
    result = finetune.train_finetune(model, images, labels, accounting.DpPlan(2.0, 2, 1.0, 1.0),
                                     spec, keys=fixed_keys(2, 0),
                                     flags=finetune.FinetuneFlags(physical_batch_size=8))
    trained = _check_only_trained_changed(before, _params(result.model), TRAINED["lora"])
    # Rank 2 on qkv (16 -> 48), proj (16 -> 16), fc1 (16 -> 32), fc2 (32 -> 16), 2 blocks, and
    # the head (16 x 4 + 4).
    assert trained == 2 * 2 * (64 + 32 + 48 + 48) + 68 and set(sizes) == {trained}
    merged = finetune.merge_lora(result.model)
    assert not any(isinstance(m, nnx.LoRA) for _, m in nnx.iter_modules(merged))
    assert any(isinstance(m, nnx.LoRA) for _, m in nnx.iter_modules(result.model))  # unchanged
    x = finetune.model_inputs(jnp.asarray(images), spec)
    ours = np.asarray(result.model(x))
    assert np.abs(ours).max() > 1e-3  # the trained head reads the adapted features
    np.testing.assert_allclose(np.asarray(merged(x)), ours, atol=1e-5)
    # The model file (plain ViT arrays) predicts what the trained adapter model computes.
    path = network_file(tmp_path / "m.safetensors", merged, name="vit", side=16, channels=3,
                        rgb=True)
    np.testing.assert_allclose(dpmodel.load_model(path).logits(images), ours, atol=1e-5)


@pytest.mark.parametrize("mode", ["bias", "lora"])
def test_both_clippers_agree_on_the_trained_parameters_of_a_mode(mode, rng):
    """Book-keeping and per-example clipping of the same split (frozen layers in `rest`, the
    trained parameters alone clipped): the same clipped sum."""
    model = _model("vit")
    if mode == "lora":
        finetune.add_lora(model, 2, rngs=nnx.Rngs(1))
        # Its own book-keeping rule (rows to adapter gradients), not per-example copies.
        assert rule_for(model.blocks[0].attn.qkv).row_grads is not None
    perturb_nnx(model, 0.3)
    spec = _spec(mode, 3)
    graphdef, params, rest = finetune.split_trained(model, spec)
    images, labels = uint8_images(6, 16, 3), rng.integers(0, CLASSES, 6)
    mask = np.array([1, 1, 1, 0, 1, 1], np.float32)
    sums = [finetune.clipped_sum(
        graphdef, params, rest, jnp.asarray(images), jnp.asarray(labels), jnp.asarray(mask),
        jnp.arange(6, dtype=jnp.int32), jnp.float32(1.0), jax.random.key(0), spec=spec,
        flags=finetune.FinetuneFlags(physical_batch_size=6, clipping=clipping))
        for clipping in ("bookkeeping", "per_example")]
    flat = [np.concatenate([np.ravel(v) for v in jax.tree.leaves(s)]) for s in sums]
    assert flat[0].size == count_params(params) and np.linalg.norm(flat[1]) > 0.5
    np.testing.assert_allclose(flat[0], flat[1], rtol=1e-4, atol=1e-6)


# A LoRA ViT's merged model file and its torch, ONNX and timm exports equal the adapter model:
# tests/model/test_export.py::test_finetuned_vit_exports_a_timm_state_dict_torch_and_onnx (the
# one ViT exported in the suite).


def test_non_private_is_plain_sgd_on_the_batch_gradient(rng):
    """A plan with clip_norm = inf: params - lr * grad(sum of the losses) / (q N), the same for
    any noise key (no noise), a bad label a null record, padding rows zero."""
    model = _model("cnn")
    perturb_nnx(model, 0.1)
    images = uint8_images(11, 16, 1).reshape(11, 16, 16, 1)
    labels = rng.integers(0, CLASSES, 11)
    labels[4] = 9  # a null record
    spec = _spec("all", 1)
    plan = accounting.DpPlan(0.0, 1, 1.0, math.inf)
    runs = [finetune.train_finetune(model, images, labels, plan, spec, keys=fixed_keys(2, seed),
                                    rng=np.random.default_rng(0),  # the same batches
                                    flags=finetune.FinetuneFlags(physical_batch_size=8))
            for seed in (0, 1)]
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    valid = labels < CLASSES

    def summed_loss(params):
        logits = nnx.merge(graphdef, params, rest)(finetune.model_inputs(images, spec))
        losses = optax.softmax_cross_entropy_with_integer_labels(logits,
                                                                 np.where(valid, labels, 0))
        return jnp.sum(jnp.where(valid, losses, 0.0))

    gradient = jax.grad(summed_loss)(params)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(gradient)) > 1e-3
    expected = jax.tree.map(lambda p, g: p - 0.5 * g / 11, params, gradient)
    got = nnx.state(runs[0].model, nnx.Param)
    for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(nnx.state(runs[1].model, nnx.Param)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_train_modes_fail_loudly_where_they_select_nothing_or_mean_nothing():
    with pytest.raises(ValueError, match="selects no parameter"):
        finetune.split_trained(_model("vit"), _spec("lora", 3))
    with pytest.raises(ValueError, match="adapts a ViT's attention"):
        finetune.add_lora(_model("cnn"), 4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="train must be one of"):
        _spec("everything", 1)
    with pytest.raises(ValueError, match="non-private plan"):
        finetune.train_finetune(_model("cnn"), np.zeros((4, 16, 16, 1), np.uint8),
                                np.zeros(4, int), accounting.DpPlan(0.0, 1, 1.0, math.inf),
                                _spec("all", 1), canaries=GradientCanaries.draw(
                                    20, (100,), np.random.default_rng(0)))


# ------------------------------------------------------------------------------------------
# The job.


def test_non_private_bias_run_says_it_is_not_private_everywhere(rng, tmp_path, monkeypatch):
    _write(tmp_path, _images(rng, 120), _images(rng, 40))
    monkeypatch.chdir(tmp_path)
    assert _finetune(*FAST, "--train", "bias", "--non-private", "--out", "run") == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    privacy = results["privacy"]
    assert privacy["private"] is False and float(privacy["epsilon"]) == math.inf
    assert "NO privacy guarantee" in privacy["claim"] and privacy["dp_event"] == {
        "type": "NonPrivateDpEvent"}
    assert float(privacy["plan"]["clip_norm"]) == math.inf
    assert privacy["plan"]["noise_multiplier"] == 0
    assert float(results["ledger"]["epsilon"]) == math.inf
    assert results["trained"]["mode"] == "bias"
    assert 0 < results["trained"]["parameters"] < results["trained"]["of"]
    timings = json.loads((tmp_path / "run" / "results.timings.json").read_text())  # the owner's
    assert timings["compile_seconds"] > 0 and timings["images_per_second"] > 0
    model = dpmodel.load_model(tmp_path / "run" / "model.safetensors")
    assert model.privacy.epsilon == math.inf and model.document["privacy"]["private"] is False
    assert model.document["privacy"]["covers"].startswith("NOTHING: NOT private")
    assert model.document["training"]["trained"]["mode"] == "bias"
    assert len(model.predict(_images(rng, 5)[0])) == 5


def test_modes_that_cannot_run_are_refused_in_one_line(rng, tmp_path, monkeypatch, capsys):
    _write(tmp_path, _images(rng, 40), _images(rng, 20))
    monkeypatch.chdir(tmp_path)
    assert _finetune(*FAST, "--train", "lora") == 2
    err = capsys.readouterr().err.strip()
    assert "--train lora adapts a ViT's attention and MLP layers; --model cnn has none" in err
    assert len(err.splitlines()) == 1
    assert _finetune(*FAST, "--non-private", "--audit-canaries", "10") == 2
    assert "--audit-canaries" in capsys.readouterr().err


@pytest.mark.slow
def test_a_lora_vit_run_releases_a_plain_vit_that_reproduces_its_accuracy(rng, tmp_path,
                                                                          monkeypatch):
    from tests.model.test_predict import _accuracy, _predict

    # timm's test_vit: a VisionTransformer like vit_tiny (6 blocks of width 64, 2 heads, not 12
    # of 192) at half its XLA compile time; the LoRA path is the same for every timm ViT.
    _write(tmp_path, _images(rng, 24, 32, 3), _images(rng, 40, 32, 3))
    monkeypatch.chdir(tmp_path)
    assert _finetune("--model", "test_vit", "--random-init", "--steps", "2",
                     "--batch-size", "8", "--physical-batch-size", "8", "--lr", "0.5",
                     "--train", "lora", "--lora-rank", "4", "--out", "run", "--quiet") == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    trained = results["trained"]
    # 6 blocks of rank-4 adapters on qkv (64 -> 192), proj, fc1 (64 -> 192), fc2; the head.
    assert trained["mode"] == "lora" and trained["lora_rank"] == 4
    assert trained["parameters"] == 6 * 4 * (256 + 128 + 256 + 256) + 64 * 4 + 4
    arrays, document = dpmodel.read_model_file(tmp_path / "run" / "model.safetensors")
    assert not [k for k in arrays if "lora" in k or "base_module" in k]
    assert document["training"]["trained"] == trained
    rows = _predict("run/model.safetensors", "npz:test.npz", out=tmp_path / "p.csv")
    assert _accuracy(rows) == results["test_accuracy_ema"]
