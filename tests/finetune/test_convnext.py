"""timm's ConvNeXt as our NNX `ConvNeXt` (`finetune.models.convnext`): timm's logits within
1e-4 (both MLP forms, with and without the head's norm), a `--weights FILE` state dict loaded
strictly through the product's path, the way back to timm strict, and book-keeping clipping
equal to per-example clipping of `jax.vmap(jax.grad)` on a small ConvNeXt whose layer scales
are far from timm's 1e-6 init (so every block's parameters carry gradient)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flax import nnx

from dpprobe.finetune.models import ConvNeXt, model_from_timm
from dpprobe.finetune.models.timm_names import load_into_timm
from tests.contract import NUM_CLASSES
from tests.family_contract import ModelFamilyContract, perturb_layer_scales
from tests.model_helpers import check_weights_file


def _small(conv_mlp: bool, head_norm_first: bool = False, kernel: int = 7):
    """A ConvNeXt of five blocks in four narrow stages, through timm's class, its layer scales
    drawn in [0.5, 1.5] (timm's init 1e-6 would mute every block)."""
    from timm.models.convnext import ConvNeXt as TimmConvNeXt

    torch.manual_seed(0)
    model = TimmConvNeXt(num_classes=NUM_CLASSES, depths=(1, 1, 2, 1), dims=(8, 12, 16, 24),
                         conv_mlp=conv_mlp, head_norm_first=head_norm_first,
                         kernel_sizes=kernel).eval()
    perturb_layer_scales(model, 1)
    return model


def _images(n: int, side: int, seed: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 3, side, side)).astype(np.float32)


@pytest.mark.parametrize("conv_mlp,head_norm_first", [(False, False), (True, False),
                                                      (False, True)])
def test_logits_match_timm_and_the_way_back_is_strict(conv_mlp, head_norm_first):
    timm_model = _small(conv_mlp, head_norm_first)
    model = model_from_timm(timm_model, None, rngs=nnx.Rngs(0))
    assert isinstance(model, ConvNeXt) and model.conv_mlp == conv_mlp
    images = _images(3, 32)
    with torch.no_grad():
        expected = timm_model(torch.from_numpy(images)).numpy()
    assert np.abs(expected).max() > 0.1  # the blocks and head carry signal
    ours = ModelFamilyContract.image_logits(model, images)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-4)
    back = _small(conv_mlp, head_norm_first)
    with torch.no_grad():
        for p in back.parameters():
            p.zero_()
    load_into_timm(model, back)  # every tensor written, load_state_dict(strict=True)
    for key, value in timm_model.state_dict().items():
        torch.testing.assert_close(back.state_dict()[key], value, rtol=0, atol=0)


def test_weights_file_loads_strictly_into_the_finetuned_model(tmp_path):
    """A convnext_atto state dict as .safetensors through `extract.create_backbone(weights=)`
    (what `dpprobe finetune --model convnext_atto --weights FILE` builds its model from):
    our features are timm's pre-logits within 1e-4, the new head is zero; a file lacking one
    layer scale is refused."""
    import timm

    torch.manual_seed(3)
    source = timm.create_model("convnext_atto", pretrained=False).eval()
    perturb_layer_scales(source, 4)
    check_weights_file(tmp_path, "convnext_atto", source, _images(2, 32), "stages.2.blocks.3.gamma",
                       match="gamma")


@pytest.mark.parametrize("name,match", [("convnext_atto_ols", "stem"),
                                        ("convnextv2_atto", "global response"),
                                        ("convnext_zepto_rms", "LayerNorm")])
def test_variants_it_does_not_reproduce_are_refused(name, match):
    import timm

    with pytest.raises(ValueError, match=match):
        model_from_timm(timm.create_model(name, pretrained=False), None, rngs=nnx.Rngs(0))


class TestSmallConvNeXt(ModelFamilyContract):
    """The family contract (clipped sum = per-example clipping within 1e-5, leave-one-out
    <= C (1 + 1e-6), no example touches another) on a small ConvNeXt with layer scales near 1
    and the dense (non-convolutional) MLP, its depthwise kernels 3 x 3: the MLP's form is what
    this class adds to tests/test_contract.py's TestConvNeXtAtto (convnext_atto's stages at
    depths 1, 1, 2, 1, 7 x 7 depthwise, layer scales near 1, 1 x 1-convolution MLP); the
    depthwise layer and its rule are the same code at either size. At 7 x 7 its 49 shifted
    windows per layer made XLA's compilation of the vmapped gradient and the clipper ~5x
    slower (24.6 -> 4.6 s and 30 -> 8 s here)."""

    @pytest.fixture(scope="class")
    @classmethod
    def family(cls):
        timm_model = _small(conv_mlp=False, kernel=3)
        return timm_model, model_from_timm(timm_model, None, rngs=nnx.Rngs(0)), _images(
            cls.examples, cls.image_size)
