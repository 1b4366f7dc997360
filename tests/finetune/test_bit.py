"""timm's BiT ResNetV2 as our NNX `ResNetV2` (`finetune.models.bit`): timm's logits within 1e-4
(BiT's "fixed" stem and the plain one), a `--weights FILE` state dict of `resnetv2_50x1_bit`
loaded strictly through the product's path, the way back to timm strict, the variants it does
not reproduce refused, `--train head|bias` training only their parameters (LoRA refused), and
book-keeping clipping equal to per-example clipping of `jax.vmap(jax.grad)` on a small
ResNetV2 built through timm's class the way `resnetv2_*_bit` is (StdConv2d with eps 1e-8,
GroupNormAct, pre-activation bottlenecks)."""

from __future__ import annotations

from functools import partial

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from dpprobe import accounting, finetune
from dpprobe.finetune.models import ResNetV2, model_from_timm
from dpprobe.finetune.models.timm_names import load_into_timm
from tests.conftest import fixed_keys
from tests.contract import NUM_CLASSES
from tests.family_contract import ModelFamilyContract
from tests.model_helpers import check_weights_file


def _perturb(timm_model, seed: int) -> None:
    """Every parameter moved by noise (norm scales near 1, offsets near 0, a head of signal),
    so that every layer carries gradient and the logits depend on all."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in timm_model.named_parameters():
            scale = 0.2 if "norm" in name else 0.05 * p.std().item() if p.ndim == 4 else 0.3
            p.add_(scale * torch.randn(p.shape, generator=gen))


def _small(fixed: bool = True, seed: int = 0):
    """A ResNetV2 of one bottleneck per stage, 8 GroupNorm groups, through timm's class as
    `_create_resnetv2_bit` builds it (StdConv2d eps 1e-8, GroupNormAct)."""
    from timm.layers import GroupNormAct, StdConv2d
    from timm.models.resnetv2 import ResNetV2 as TimmResNetV2

    torch.manual_seed(seed)
    model = TimmResNetV2(layers=[1, 1, 1, 1], channels=(32, 32, 64, 64), stem_chs=16,
                         num_classes=NUM_CLASSES, stem_type="fixed" if fixed else "",
                         conv_layer=partial(StdConv2d, eps=1e-8),
                         norm_layer=partial(GroupNormAct, num_groups=8)).eval()
    _perturb(model, seed + 1)
    return model


def _images(n: int, side: int, seed: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 3, side, side)).astype(np.float32)


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed_stem", "plain_stem"])
def test_logits_match_timm_and_the_way_back_is_strict(fixed):
    timm_model = _small(fixed)
    model = model_from_timm(timm_model, None, rngs=nnx.Rngs(0))
    assert isinstance(model, ResNetV2) and model.fixed_stem == fixed
    images = _images(3, 40)
    with torch.no_grad():
        expected = timm_model(torch.from_numpy(images)).numpy()
    assert np.abs(expected).max() > 0.1  # the blocks and head carry signal
    ours = ModelFamilyContract.image_logits(model, images)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-4)
    back = _small(fixed, seed=5)
    load_into_timm(model, back)  # every tensor written, load_state_dict(strict=True)
    for key, value in timm_model.state_dict().items():
        torch.testing.assert_close(back.state_dict()[key], value, rtol=0, atol=0)


def test_the_fixed_stem_pools_against_zeros():
    """BiT's stem pads the convolution's output with zeros before the pool: on an input whose
    stem output is negative everywhere the border maxima are 0, not the -inf padding's."""
    timm_model = _small(True)
    model = model_from_timm(timm_model, None, rngs=nnx.Rngs(0))
    x = jnp.asarray(_images(1, 16).transpose(0, 2, 3, 1))
    stem = -jnp.abs(model.stem_conv(x)) - 1.0
    from dpprobe.finetune.models.bit import _max_pool

    with torch.no_grad():
        expected = torch.nn.Sequential(timm_model.stem.pad, timm_model.stem.pool)(
            torch.from_numpy(np.array(stem).transpose(0, 3, 1, 2).copy())).numpy()
    ours = np.asarray(_max_pool(stem, True)).transpose(0, 3, 1, 2)
    np.testing.assert_array_equal(ours, expected)
    assert (ours[..., 0, :] == 0).all() and (np.asarray(_max_pool(stem, False)) < 0).all()


def test_bit50_weights_file_loads_strictly_into_the_finetuned_model(tmp_path):
    """A resnetv2_50x1_bit state dict as .safetensors through `extract.create_backbone(weights=)`
    (what `dpprobe finetune --model resnetv2_50x1_bit --weights FILE` builds its model from):
    our features are timm's pre-logits within 1e-4, the new head is zero; a file lacking one
    norm's scale is refused."""
    import timm

    torch.manual_seed(3)
    source = timm.create_model("resnetv2_50x1_bit", pretrained=False).eval()
    _perturb(source, 4)
    check_weights_file(tmp_path, "resnetv2_50x1_bit", source, _images(2, 32),
                       "stages.3.blocks.2.norm2.weight", match="norm2")


@pytest.mark.parametrize("name,match", [("resnetv2_50", "StdConv2d"),
                                        ("resnetv2_18", "StdConv2d"),
                                        ("resnetv2_50d_gn", "deep"),
                                        ("resnetv2_50d_evos", "deep")])
def test_variants_it_does_not_reproduce_are_refused(name, match):
    import timm

    with pytest.raises(ValueError, match=match):
        model_from_timm(timm.create_model(name, pretrained=False), None, rngs=nnx.Rngs(0))


def _params(model) -> dict[str, np.ndarray]:
    return {"/".join(map(str, k)): np.asarray(v[...])
            for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("mode,pattern", [("head", r"head/.*"),
                                          ("bias", r"(head/.*|.*norm\d?/bias)")])
def test_head_and_bias_modes_train_only_their_parameters(mode, pattern):
    """One DP step of `--train head` / `bias`: the head (and the GroupNorm offsets, BiT's only
    biases) change, every other parameter is bitwise the same."""
    import re

    model = model_from_timm(_small(), NUM_CLASSES, rngs=nnx.Rngs(0))
    before = _params(model)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (8, 16, 16, 3)).astype(np.uint8)
    spec = finetune.FinetuneSpec(NUM_CLASSES, optimizer="sgd", learning_rate=0.5,
                                 ema_decay=None, mean=(0.5,) * 3, std=(0.5,) * 3, train=mode)
    result = finetune.train_finetune(model, images, rng.integers(0, NUM_CLASSES, 8),
                                     accounting.DpPlan(2.0, 1, 1.0, 1.0), spec,
                                     keys=fixed_keys(1, 0),
                                     flags=finetune.FinetuneFlags(physical_batch_size=8))
    after = _params(result.model)
    trained = {k for k in before if re.fullmatch(pattern, k)}
    assert any("norm" in k for k in trained) == (mode == "bias")
    for name, value in before.items():
        assert np.array_equal(after[name], value) != (name in trained), name
    with pytest.raises(ValueError, match="ResNetV2 has none"):
        finetune.add_lora(model, 4, rngs=nnx.Rngs(0))


class TestSmallResNetV2(ModelFamilyContract):
    """The family contract (clipped sum = per-example clipping within 1e-5, leave-one-out
    <= C (1 + 1e-6), no example touches another) on a small BiT ResNetV2 (every convolution
    weight-standardized with eps 1e-8, GroupNorm scales and offsets by offsets)."""

    image_size = 24

    @pytest.fixture(scope="class")
    @classmethod
    def family(cls):
        timm_model = _small()
        return timm_model, model_from_timm(timm_model, None, rngs=nnx.Rngs(0)), _images(
            cls.examples, cls.image_size)

    def test_the_ghost_rule_in_every_convolution_moves_the_sum_by_at_most_c(self, family, sums):
        """Every StdConv through the ghost norm of `finetune.models.ws_ghost` (ghost=True; the
        trainer's cost choice keeps this small model's layers instantiated): its norms are
        upper bounds of `jax.vmap(jax.grad)`'s within 1e-3, its unclipped sum is the plain sum
        within 1e-5, and removing any one example moves the clipped sum by at most
        C (1 + 1e-6)."""
        _, model, images = family
        params, clipper, _ = self.clippers(model, ghost=True)
        x, labels = self.nhwc(images), jnp.arange(self.examples) % NUM_CLASSES
        ones = np.ones(self.examples, np.float32)

        def run(clip, mask=ones):
            result = clipper(params, (x, labels), jnp.float32(clip), jnp.asarray(mask))
            return np.asarray(result.norms, np.float64), self.flat(result.grads)

        clip = sums["median"]
        left_out = [run(clip, mask)[1] for mask in self.masks_leaving_out()]
        self.check_leave_one_out(sums["rows"], run(np.inf), run(clip)[1], left_out, clip)


@pytest.mark.slow
def test_a_finetuned_bit50_model_file_exports_to_timm_strictly(tmp_path):
    """resnetv2_50x1_bit fine-tuned (every parameter perturbed) in a model file: it holds no
    statistics (GroupNorm only) and rebuilds; `dpprobe export --format timm` loads strictly
    into `timm.create_model("resnetv2_50x1_bit", num_classes=K)` and gives dpprobe's logits
    within 1e-4 (the head written back as timm's 1 x 1 convolution)."""
    import safetensors.torch
    import timm

    from dpprobe import model as dpmodel
    from dpprobe.pipelines import cli
    from tests.model_helpers import CLASSES, network_file, perturb_nnx, uint8_images

    name = "resnetv2_50x1_bit"
    torch.manual_seed(0)
    source = timm.create_model(name, pretrained=False, num_classes=len(CLASSES)).eval()
    model = model_from_timm(source, len(CLASSES), rngs=nnx.Rngs(0))
    perturb_nnx(model, 0.01)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    path = network_file(tmp_path / "m.safetensors", model, name=name, side=32, channels=3,
                        mean=mean, std=std, rgb=True, timm_architecture=name)
    assert not any(k.startswith("stats/") for k in safetensors.torch.load_file(path))
    out = tmp_path / "timm.safetensors"
    assert cli.main(["export", "--model", path, "--format", "timm", str(out), "--quiet"]) == 0
    loaded = timm.create_model(name, pretrained=False, num_classes=len(CLASSES))
    loaded.load_state_dict(safetensors.torch.load_file(out), strict=True)
    images = uint8_images(3, 32, 3)
    x = torch.from_numpy(images.transpose(0, 3, 1, 2).astype(np.float32) / 255.0)
    x = (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    with torch.no_grad():
        theirs = loaded.eval()(x).numpy()
    ours = dpmodel.load_model(path).logits(images)
    assert np.abs(ours).max() > 0.1
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-4)
