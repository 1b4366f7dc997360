"""Model files for the tests of `dpmodel`: a network file written from a model built in the
test (no training needed to test a format, a prediction or an export), and small image sets."""

import numpy as np
import pytest

from dpprobe import model as dpmodel
from dpprobe import model_files

CLASSES = ["a", "b", "c", "d"]


def network_file(path, model, *, name: str, side: int, channels: int, mean=(0.5,),
                 std=(0.5,), rgb: bool = False, timm_architecture=None) -> str:
    """A model file holding `model` (an NNX network) as the finetune job writes it."""
    document = model_files.header("finetune", CLASSES) | dpmodel.network_document(
        model, name=name, num_classes=len(CLASSES), image_size=side, channels=channels,
        resize=None, crop=None, rgb=rgb, mean=tuple(mean) * (channels // len(mean)),
        std=tuple(std) * (channels // len(std)), timm_architecture=timm_architecture) | {
        "parameters": {"released": "final iterate"},
        "privacy": {"epsilon": 1.0, "delta": 1e-5, "accountant": "pld",
                    "neighboring_relation": "zero_out", "ledger": {}},
        "training": {}}
    model_files.write_model(path, dpmodel.network_arrays(model), document)
    return str(path)


def perturb_nnx(model, scale: float = 0.3, seed: int = 0) -> None:
    """Every parameter plus N(0, scale^2) noise (the zero head too), so logits depend on all.

    The noise is NumPy's and the sum is taken in NumPy: an eager JAX op compiles one program
    per parameter shape (BiT-50's 6 s here), where NumPy compiles none."""
    import jax.numpy as jnp
    from flax import nnx

    rng = np.random.default_rng(seed)
    for _, param in (p for p in nnx.iter_graph(model) if isinstance(p[1], nnx.Param)):
        value = np.asarray(param[...])
        noise = scale * rng.standard_normal(value.shape)
        param[...] = jnp.asarray((value + noise).astype(value.dtype))


def uint8_images(n: int, side: int, channels: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = (n, side, side) if channels == 1 else (n, side, side, channels)
    return rng.integers(0, 256, shape).astype(np.uint8)


def nchw01(images: np.ndarray) -> np.ndarray:
    """uint8 NHW[C] images as the exported modules' input: float32 NCHW in [0, 1]."""
    x = images.astype(np.float32) / np.float32(255.0)
    return (x[:, None] if x.ndim == 3 else x.transpose(0, 3, 1, 2)).copy()


def check_weights_file(tmp_path, name: str, source, images: np.ndarray, missing: str,
                       match: str) -> None:
    """`source`'s state dict (a timm model) as .safetensors through
    `extract.create_backbone(name, weights=)` (what `dpprobe finetune --model NAME --weights
    FILE` builds its model from): our features are timm's pre-logits on `images` (NCHW) within
    1e-4 and the new head is zero; the file without the tensor `missing` is refused (its
    message matching `match`)."""
    import jax.numpy as jnp
    import safetensors.torch
    import torch
    from flax import nnx

    from dpprobe import extract
    from dpprobe.finetune.models import model_from_timm

    state = {k: v.contiguous() for k, v in source.state_dict().items()}
    side = images.shape[-1]
    safetensors.torch.save_file(state, str(tmp_path / "full.safetensors"))
    backbone = extract.create_backbone(name, weights=tmp_path / "full.safetensors", crop=side,
                                       device="cpu")
    model = model_from_timm(backbone.module, 10, rngs=nnx.Rngs(0))
    with torch.no_grad():
        expected = source.forward_head(source.forward_features(torch.from_numpy(images)),
                                       pre_logits=True).numpy()
    # One compiled program: op by op, BiT-50's forward compiled hundreds of small ones.
    features = nnx.jit(lambda model, x: model.features(x))
    ours = np.asarray(features(model, jnp.asarray(images.transpose(0, 2, 3, 1))))
    assert np.abs(expected).max() > 0.1
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-4)
    assert not np.asarray(model.head.kernel[...]).any()
    del state[missing]
    safetensors.torch.save_file(state, str(tmp_path / "partial.safetensors"))
    with pytest.raises(ValueError, match=match):
        extract.create_backbone(name, weights=tmp_path / "partial.safetensors", crop=side,
                                device="cpu")
