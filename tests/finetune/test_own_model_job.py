"""`dpprobe.finetune(model=<your own Flax NNX module>)` end to end: DP results, the unknown
layer's notice on stderr, the model file rebuilt from the module given back, what an own module
cannot take refused."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

import dpprobe
from dpprobe import model as dpmodel
from dpprobe.model.format import ModelFileError
from tests.dp.test_own_layers import OwnNet, own_net

CLASSES = np.array(["a", "b", "c", "d"])
STEPS = dict(steps=2, batch_size=16, physical_batch_size=16, augmult=1, quiet=True)


def _write(directory, rng):
    for split, n in (("train", 48), ("test", 20)):
        labels = rng.integers(0, 4, n)
        images = rng.integers(0, 60, (n, 12, 12, 3)).astype(np.uint8)
        images[labels == 1, :6] += 150
        np.savez(directory / f"{split}.npz", images=images, labels=labels, class_names=CLASSES)


def _params(model) -> np.ndarray:
    return np.concatenate([np.asarray(v[...]).ravel() for _, v in
                           nnx.to_flat_state(nnx.state(model, nnx.Param))])


def test_an_own_module_finetunes_and_its_file_needs_the_module(rng, tmp_path, capsys):
    _write(tmp_path, rng)
    module = own_net(len(CLASSES))
    before = _params(module)
    result = dpprobe.finetune(data=f"npz:{tmp_path / 'train.npz'}",
                              test_data=f"npz:{tmp_path / 'test.npz'}", model=module,
                              epsilon=2, delta=1e-4, out=str(tmp_path / "run"), **STEPS)
    err = capsys.readouterr().err
    name = "tests.dp.test_own_layers.OwnNet"
    assert ("book-keeping clipping has no rule for the layers dilated (flax.nnx.nn.linear.Conv), "
            "gain (tests.dp.test_own_layers.Gain)") in err
    results = result.results
    assert results["model"]["name"] == name and results["model"]["family"] == "own_module"
    assert results["privacy"]["epsilon"] <= 2.0 and results["privacy"]["private"] is True
    assert results["trained"]["parameters"] == before.size  # every Param ("of": + statistics)
    np.testing.assert_array_equal(_params(module), before)  # the job trained a copy
    (released,) = result.models
    assert released.document["architecture"]["module_class"] == name
    released_params = _params(released._network)
    assert not np.array_equal(released_params, before)  # trained and noised
    images = np.load(tmp_path / "test.npz")["images"]
    assert set(released.predict(images)) <= set(CLASSES)
    again = dpmodel.load_model(tmp_path / "run" / "model.safetensors", module=own_net(4))
    np.testing.assert_array_equal(again.logits(images), released.logits(images))
    with pytest.raises(ModelFileError, match=f"your own Flax module {name}: load it with"):
        dpmodel.load_model(tmp_path / "run" / "model.safetensors")
    with pytest.raises(ModelFileError, match="holds a tests.dp.test_own_layers.OwnNet, not a"):
        dpmodel.load_model(tmp_path / "run" / "model.safetensors",
                           module=nnx.Linear(2, 2, rngs=nnx.Rngs(0)))


@pytest.mark.parametrize("change,message", [
    ({"train": "lora"}, "an own module: train all, head or bias"),
    ({"random_init": True}, "an own module starts from its own parameters"),
    ({"batchnorm": True}, "BatchNorm bn normalizes by the batch's statistics"),
    ({"classes": 3}, r"to \(2, 3\); the data needs \(2, 4\) logits"),
])
def test_what_an_own_module_cannot_take_is_refused(tmp_path, rng, change, message):
    _write(tmp_path, rng)
    module = OwnNet(change.pop("classes", len(CLASSES)), nnx.Rngs(0))
    if change.pop("batchnorm", False):
        module.bn.use_running_average = False
    with pytest.raises(ValueError, match=message):
        dpprobe.finetune(data=f"npz:{tmp_path / 'train.npz'}",
                         test_data=f"npz:{tmp_path / 'test.npz'}", model=module,
                         **STEPS, **change)
