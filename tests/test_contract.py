"""Every clipper and every trainer meets the DP contract (tests/contract.py); every timm family
the finetuner converts meets the model-family contract (tests/family_contract.py)."""

import jax
import jax.numpy as jnp
from flax import nnx

from dpprobe import dp, probe
from tests.contract import NUM_CLASSES, ClipperContract, TrainerContract, probe_loss
from tests.family_contract import ModelFamilyContract, perturb_layer_scales


class TestClosedFormClipper(ClipperContract):
    """`probe.linear_clipper`: the linear probe's per-example norms in closed form."""

    def clipper(self):
        return probe.linear_clipper(self.spec.loss)

    def inputs(self, features, labels, clip_norm):
        params = probe.init_params(1, features.shape[-1], self.spec)
        batch = (jnp.asarray(features), jax.nn.one_hot(labels, NUM_CLASSES))
        return params, batch, jnp.full((1,), clip_norm, jnp.float32)


class TestInMemoryTrainer(TrainerContract):
    def train(self, features, labels, runs, spec):
        return probe.train_probe(features, labels, runs, dp.make_keys(len(runs)), spec)


class TestShardedTrainer(TrainerContract):
    def train(self, features, labels, runs, spec):
        flags = probe.PerformanceFlags(mesh=probe.make_data_mesh(1))
        return probe.train_probe(features, labels, runs, dp.make_keys(len(runs)), spec,
                                 flags=flags)


class TestStreamedTrainer(TrainerContract):
    def train(self, features, labels, runs, spec):
        def chunks():
            for start in range(0, len(labels), 5):
                yield features[start:start + 5], labels[start:start + 5]

        return probe.train_probe_streaming(
            chunks, runs, dp.make_keys(len(runs)), spec, num_examples=len(labels),
            dim=features.shape[-1], flags=probe.PerformanceFlags(rows_per_chunk=5))


class TestPoissonTrainer(TrainerContract):
    sampled = True

    def train(self, features, labels, runs, spec):
        return probe.train_probe_poisson(features, labels, runs, dp.make_keys(len(runs)),
                                         spec, flags=probe.PerformanceFlags(physical_batch_size=7))


class TestPerExampleClipper(ClipperContract):
    """`dp.per_example_clipper` (`jax_privacy.clipped_grad`: per-example gradients of any
    loss, the clipper of the finetuning path) on the probe's loss, views averaged."""

    def clipper(self):
        return dp.per_example_clipper(probe_loss(self.spec))

    def inputs(self, features, labels, clip_norm):
        params = jax.tree.map(lambda p: p[0], probe.init_params(1, features.shape[-1],
                                                                 self.spec))
        x = jnp.asarray(features, jnp.float32)
        batch = (x if x.ndim == 3 else x[:, None, :], jnp.asarray(labels))
        return params, batch, jnp.float32(clip_norm)


class _ProbeModule(nnx.Module):
    """The probe as an NNX model: one dense layer on each view."""

    def __init__(self, dim: int):
        self.linear = nnx.Linear(dim, NUM_CLASSES, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.linear(x)


class TestBookkeepingClipper(ClipperContract):
    """`dp.bookkeeping_clipper` on the probe as an NNX model (views as tokens of one example),
    through an adapter from the contract's {"w", "b"} parameters to the model's state."""

    def clipper(self):
        spec = self.spec

        def loss(model, extra, x, y):
            logits = model(x)
            return probe.example_losses(logits, jax.nn.one_hot(y, NUM_CLASSES)[None],
                                        spec.loss).mean()

        def clip(params, batch, clip_norm, mask):
            graphdef, state = nnx.split(_ProbeModule(params["w"].shape[0]))
            state["linear"]["kernel"].set_value(params["w"])
            state["linear"]["bias"].set_value(params["b"])
            result = dp.bookkeeping_clipper(loss, graphdef, nnx.State({}))(
                state, batch, clip_norm, mask)
            grads = result.grads["linear"]
            return dp.ClippedSum({"w": grads["kernel"][...], "b": grads["bias"][...]},
                                 result.norms)

        return clip

    def inputs(self, features, labels, clip_norm):
        return TestPerExampleClipper.inputs(self, features, labels, clip_norm)


class TestResNet18(ModelFamilyContract):
    """timm's resnet18: BasicBlocks, BatchNorm frozen."""

    timm_name = "resnet18"


# The EfficientNets under test are their families' generators at a quarter of the width
# (channels rounded to multiples of 8): the same layer kinds, strides, kernels, skips and
# squeeze-excite, so every layer the clipper handles is checked; the full widths only cost XLA
# time (B0's class took 126 s, Lite0's 104 s, on this 2-core machine). B0 keeps every block: a
# 1e-3 error in its 5 x 5 depthwise kernels' rule moves the sum by more than the 1e-5 the test
# allows (checked with such a wrong rule: it fails), and at half the depth it no longer did.
# Lite0 runs at half the depth (each stage's repeats halved, rounded up: 10 blocks of 16,
# every stage and a stride-1 residual block of each kernel size kept; 38 -> 25 s here), where
# the same wrong rule still fails it.
_NARROWER = {"channel_multiplier": 0.25}


class TestEfficientNetB0(ModelFamilyContract):
    """timm's efficientnet_b0 (its generator, narrower): depthwise convolutions,
    squeeze-excite, SiLU, BatchNorm frozen."""

    timm_name = "efficientnet_b0"

    @classmethod
    def timm_model(cls, timm):
        from timm.models.efficientnet import _gen_efficientnet

        return _gen_efficientnet(cls.timm_name, pretrained=False, num_classes=NUM_CLASSES,
                                 **_NARROWER)


class TestEfficientNetLite0(ModelFamilyContract):
    """timm's tf_efficientnet_lite0 (its generator, narrower, half the depth): TF "same"
    padding, ReLU6, no squeeze-excite."""

    timm_name = "tf_efficientnet_lite0"
    image_size = 33  # odd: the asymmetric "same" padding of its strided convolutions

    @classmethod
    def timm_model(cls, timm):
        from timm.models.efficientnet import BN_EPS_TF_DEFAULT, _gen_efficientnet_lite

        # tf_efficientnet_lite0's own settings: TF's BatchNorm epsilon and "same" padding.
        return _gen_efficientnet_lite(cls.timm_name, pretrained=False, num_classes=NUM_CLASSES,
                                      bn_eps=BN_EPS_TF_DEFAULT, pad_type="same",
                                      depth_multiplier=0.5, **_NARROWER)


# A tiny BEiT through timm's Beit class (the registry name's constructor, its size overridden).
_TINY_BEIT = {"img_size": 32, "patch_size": 8, "embed_dim": 64, "depth": 2, "num_heads": 2}


class TestBeit(ModelFamilyContract):
    """timm's beit_base_patch16_224 family, tiny: relative position tables per block, layer
    scale, q/v biases without a k bias, mean pooling and fc_norm; every parameter perturbed
    (timm zero-initializes the tables and biases)."""

    timm_name = "beit_base_patch16_224"
    timm_kwargs = _TINY_BEIT
    perturb_std = 0.05


class TestBeitSharedTable(ModelFamilyContract):
    """A BEiT with one relative position table shared by all blocks, an absolute position
    embedding and class-token pooling (timm's `use_shared_rel_pos_bias`)."""

    timm_name = "beit_base_patch16_224"
    timm_kwargs = _TINY_BEIT | {"use_rel_pos_bias": False, "use_shared_rel_pos_bias": True,
                                "use_abs_pos_emb": True, "global_pool": "token"}
    perturb_std = 0.05


class TestConvNeXtAtto(ModelFamilyContract):
    """timm's convnext_atto at 2/5 of its width, its four stages of 1, 1, 2, 1 blocks:
    depthwise 7 x 7, LayerNorm, 1 x 1-convolution MLP, the downsampling between stages, layer
    scales drawn near 1 (so every block's parameters carry gradient). Its own depths 2, 2, 6, 2
    repeat the same block code, and the 7 x 7 layers' 49 shifted windows are most of XLA's
    compile time: the class took 70 s at full depth, 31 s at this one, where a 1e-3 error in
    the 7 x 7 rule still fails it. The dense-MLP form is tests/finetune/test_convnext.py's
    TestSmallConvNeXt."""

    timm_name = "convnext_atto"
    # convnext_atto's own arguments: dims (40, 80, 160, 320), depths (2, 2, 6, 2).
    timm_kwargs = {"dims": (16, 32, 64, 128), "depths": (1, 1, 2, 1)}

    @classmethod
    def timm_model(cls, timm):
        model = super().timm_model(timm)
        perturb_layer_scales(model, 5)
        return model
