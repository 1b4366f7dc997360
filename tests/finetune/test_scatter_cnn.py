"""`scatternet_cnn` (Tramer & Boneh's ScatterNet + CNN) and `scatternet_cnn_linear`: their
front is kymatio's torch ScatterNet and torch's GroupNorm; training on the front's features
computed once is training on the images; the job trains, records, predicts and exports them.
(Book-keeping on them, against per-example clipping and on hostile rows:
tests/dp/test_bookkeeping.py.)"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import dpprobe.finetune.fronts  # noqa: F401 (loads the submodule)
import dpprobe.finetune.train  # noqa: F401 (loads the submodule)
from dpprobe import accounting, finetune
from dpprobe.finetune.models import create_model
from dpprobe.finetune.models.scatter import ScatterCNN, scatter_groupnorm, scattering
from dpprobe.pipelines import cli
from tests.dp.test_bookkeeping import _flat
from tests.pipelines.test_finetune_job import CLASSES, _images, _write

SIDE, CHANNELS, NUM_CLASSES = 16, 2, 4


def _model(seed=0) -> ScatterCNN:
    model = create_model("scatternet_cnn", NUM_CLASSES, image_size=SIDE, in_channels=CHANNELS,
                         rngs=nnx.Rngs(seed))
    keys = iter(jax.random.split(jax.random.key(seed + 1), 100))
    graphdef, params = nnx.split(model, nnx.Param)
    params = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(next(keys), p.shape), params)
    nnx.update(model, params)
    return model


def test_front_is_kymatio_torch_scatternet_channel_major_then_torch_groupnorm():
    from kymatio.torch import Scattering2D

    x = np.random.default_rng(0).random((3, SIDE, SIDE, CHANNELS)).astype(np.float32)
    ours = np.asarray(scattering(jnp.asarray(x)))
    nchw = torch.from_numpy(x.transpose(0, 3, 1, 2).copy())
    theirs = Scattering2D(J=2, shape=(SIDE, SIDE), L=8)(nchw)
    theirs = theirs.reshape(3, CHANNELS * 81, SIDE // 4, SIDE // 4)  # channel c at 81 c + k
    np.testing.assert_allclose(ours, theirs.permute(0, 2, 3, 1).numpy(), rtol=1e-5, atol=1e-6)
    normed = torch.nn.functional.group_norm(theirs, 27, eps=1e-5).permute(0, 2, 3, 1).numpy()
    np.testing.assert_allclose(np.asarray(scatter_groupnorm(jnp.asarray(ours))), normed,
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(ScatterCNN.front(jnp.asarray(x))), normed, rtol=1e-4,
                               atol=1e-4)
    with pytest.raises(ValueError, match="multiple of 4"):
        create_model("scatternet_cnn", 3, image_size=18, in_channels=1, rngs=nnx.Rngs(0))


def _train(model, images, labels, spec, steps=3):
    plan = accounting.DpPlan(1.0, steps, 0.5, 0.1)
    keys = jax.random.wrap_key_data(np.array([[0, 1], [0, 2]], np.uint32))
    return finetune.train_finetune(model, images, labels, plan, spec, keys=keys,
                                   rng=np.random.default_rng(5),
                                   flags=finetune.FinetuneFlags(physical_batch_size=16))


def test_training_on_the_fronts_features_is_training_on_the_images(monkeypatch):
    """The trainer computes the fixed front once (no augmentation) and trains on its output:
    the same parameters, within float rounding, as the model run on the images every step;
    the released models read images again. With flips drawn, or features larger than the
    cache's limit, every step runs the front."""
    images, labels = _images(np.random.default_rng(0), 40, side=SIDE, channels=CHANNELS)
    spec = finetune.FinetuneSpec(NUM_CLASSES, learning_rate=0.5, mean=(0.0,) * CHANNELS,
                                 std=(1.0,) * CHANNELS)
    cached = _train(_model(), images, labels, spec)
    monkeypatch.setattr(finetune.train, "cached_front",
                        lambda model, images, spec: (model, images, spec, lambda m: m))
    every_step = _train(_model(), images, labels, spec)
    a, b = (_flat(nnx.state(r.model, nnx.Param)) for r in (cached, every_step))
    assert np.linalg.norm(b - _flat(nnx.state(_model(), nnx.Param))) > 1e-3  # it trained
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    for result in (cached, every_step):
        assert result.model.on_features is False and result.ema_model.on_features is False
    x = jnp.asarray(images[:4], jnp.float32) / 255
    np.testing.assert_allclose(cached.model(x), every_step.model(x), rtol=1e-4, atol=1e-5)
    model = _model()
    for flip in (False, True):
        kept = finetune.fronts.cached_front(model, images, dataclasses.replace(spec, flip=flip))
        assert (kept[0] is model) is flip
    monkeypatch.setattr(finetune.fronts, "CACHE_MAX_BYTES", 40 * 4 * 4 * 162 * 4 - 1)
    assert finetune.fronts.cached_front(model, images, spec)[0] is model  # too large to hold


@pytest.mark.parametrize("name", ["scatternet_cnn", "scatternet_cnn_linear"])
def test_the_job_trains_records_predicts_and_exports_the_scatternet_models(name, tmp_path,
                                                                          monkeypatch):
    from dpprobe import model as dpmodel

    rng = np.random.default_rng(0)
    _write(tmp_path, _images(rng, 80, side=SIDE), _images(rng, 30, side=SIDE))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["finetune", "--data", "npz:train.npz", "--test-data", "npz:test.npz",
                     "--model", name, "--batch-size", "32", "--steps", "3",
                     "--physical-batch-size", "16", "--epsilon", "4", "--out", "run",
                     "--quiet"]) == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["model"]["name"] == name
    assert results["model"]["input"] == f"{SIDE} px, scaled to [0, 1]"
    assert results["trained"]["parameters"] == results["trained"]["of"] > 0
    assert results["recipe"]["ema_decay"] == 0.999 and "ema_decay" in results["recipe"]["chosen"]
    model = dpmodel.load_model(tmp_path / "run" / "model.safetensors")
    test = np.load(tmp_path / "test.npz")
    predicted = model.predict(test["images"])
    accuracy = np.mean(np.asarray(predicted) == CLASSES[test["labels"]])
    assert accuracy == pytest.approx(results["test_accuracy_ema"])
    with torch.no_grad():
        theirs = model.to_torch()(torch.from_numpy(test["images"][:, None] / 255.0).float())
    np.testing.assert_allclose(theirs.numpy(), model.logits(test["images"]), atol=1e-4)
    # The file records its ScatterNet; another one is refused, not silently rebuilt.
    from dpprobe.model.format import ModelFileError
    from dpprobe.model.network import rebuild_network

    document = json.loads(json.dumps(model.document))
    assert document["architecture"]["scatternet"]["J"] == 2
    document["architecture"]["scatternet"]["J"] = 3
    with pytest.raises(ModelFileError, match="ScatterNet"):
        rebuild_network(model.arrays, document, "m.safetensors")
