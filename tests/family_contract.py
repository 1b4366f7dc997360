"""The model-family contract, written once and reused by every family the finetuner converts.

A subclass of `ModelFamilyContract` names a timm model (`timm_name`, `image_size`); it inherits
the tests that the family's NNX model gives timm's logits, that no example touches another's
forward pass, and that its book-keeping clipped sum is per-example clipping of
`jax.vmap(jax.grad)`'s gradients, moved by at most C when one example leaves. The contract of
every clipper and trainer is `tests/contract.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dpprobe import dp
from tests.contract import NUM_CLASSES


def randomize_batchnorm(timm_model, seed: int) -> None:
    """Running statistics, scales and offsets of every BatchNorm of a torch model drawn at
    random (timm's init makes them 0, 1, 1, 0 and zeroes each residual branch's last scale,
    which would hide a wrong statistic or branch)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in timm_model.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                c = module.num_features
                module.running_mean.copy_(0.1 * torch.randn(c, generator=gen))
                module.running_var.copy_(0.5 + torch.rand(c, generator=gen))
                module.weight.copy_(0.5 + torch.rand(c, generator=gen))
                module.bias.copy_(0.1 * torch.randn(c, generator=gen))


def perturb_layer_scales(timm_model, seed: int) -> None:
    """A ConvNeXt's layer scales (`gamma`) drawn in [0.5, 1.5]: timm's init of 1e-6 scales
    each block's output, and so every gradient inside the block, by 1e-6, far below the
    contract's 1e-5 relative tolerance (a wrong rule inside a block would pass)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in timm_model.named_parameters():
            if name.endswith("gamma"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))


class ModelFamilyContract:
    """Subclass and set `timm_name` (a timm model of a family `finetune.models` converts) and
    `image_size`: the family's NNX model (`model_from_timm`, timm's random init with random
    BatchNorm statistics, timm's head kept) gives timm's logits, no example touches another's
    forward pass, and its book-keeping clipped sum is per-example clipping of
    `jax.vmap(jax.grad)`'s gradients, moved by at most C when one example leaves."""

    timm_name = ""
    image_size = 32
    examples = 5
    timm_kwargs: dict = {}  # more `timm.create_model` arguments (a tiny config of the family)
    perturb_std = 0.0  # Gaussian noise added to every timm parameter (zero-initialized tables)

    @classmethod
    def timm_model(cls, timm):
        """The timm model under test, its classifier `NUM_CLASSES` wide; a subclass may build
        a smaller member of the family through timm's own generator."""
        return timm.create_model(cls.timm_name, pretrained=False, num_classes=NUM_CLASSES,
                                 **cls.timm_kwargs)

    @pytest.fixture(scope="class")
    @classmethod
    def family(cls):
        import timm
        import torch

        from dpprobe.finetune.models import model_from_timm

        torch.manual_seed(0)
        timm_model = cls.timm_model(timm).eval()
        randomize_batchnorm(timm_model, 1)
        with torch.no_grad():
            for param in timm_model.parameters():
                param.add_(cls.perturb_std * torch.randn_like(param))
        model = model_from_timm(timm_model, None, rngs=nnx.Rngs(0))
        rng = np.random.default_rng(2)
        images = rng.normal(size=(cls.examples, 3, cls.image_size, cls.image_size))
        return timm_model, model, images.astype(np.float32)

    @staticmethod
    def nhwc(images):
        return jnp.asarray(images.transpose(0, 2, 3, 1))

    @staticmethod
    @nnx.jit
    def logits(model, x):
        """The model's logits in one compiled program (run op by op, the narrow
        EfficientNet-B0's first forward compiled hundreds of small programs: 5.8 s, jitted
        1.3 s here)."""
        return model(x)

    @classmethod
    def image_logits(cls, model, images) -> np.ndarray:
        """`model`'s logits on NCHW `images`, as NumPy (one jitted program, `logits`)."""
        return np.asarray(cls.logits(model, cls.nhwc(images)))

    def test_logits_match_timm(self, family):
        import torch

        timm_model, model, images = family
        with torch.no_grad():
            expected = timm_model(torch.from_numpy(images)).numpy()
        np.testing.assert_allclose(self.image_logits(model, images), expected, rtol=0,
                                   atol=1e-4)

    def clippers(self, model, ghost=None):
        """(trained params, the book-keeping clipper in an x64 program, the jitted per-example
        gradients `jax.vmap(jax.grad)`) of `model`; `ghost` as `dp.bookkeeping_clipper`'s.
        Built once per class and `ghost` (each compile of a whole EfficientNet costs tens of
        seconds here)."""

        cache = type(self).__dict__.get("_compiled")
        if cache is None:
            cache = {}
            type(self)._compiled = cache
        if ghost in cache:
            return cache[ghost]
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(logits, label):
            # A temperature keeps the softmax of random weights' large logits unsaturated
            # (saturated, a gradient is 1e-9 of float32 cancellation in both computations).
            return optax.softmax_cross_entropy_with_integer_labels(logits / 100.0,
                                                                   label[None])[0]

        clipper = dp.x64_jit(dp.bookkeeping_clipper(
            lambda m, extra, x, y: loss(m(x[None]), y), graphdef, rest, ghost=ghost))

        def one(p, x, y):
            return loss(nnx.merge(graphdef, p, rest)(x[None]), y)

        grads = jax.jit(jax.vmap(jax.grad(one), in_axes=(None, 0, 0)))
        cache[ghost] = params, clipper, grads
        return cache[ghost]

    def per_example(self, family, ghost):
        """(x, labels, params, the clipper, per-example gradients as float64 rows)."""
        _, model, images = family
        params, clipper, per_example_grads = self.clippers(model, ghost)
        x, labels = self.nhwc(images), jnp.arange(self.examples) % NUM_CLASSES
        grads = per_example_grads(params, x, labels)
        rows = np.concatenate([np.asarray(g, np.float64).reshape(self.examples, -1)
                               for g in jax.tree.leaves(grads)], axis=1)
        return x, labels, params, clipper, rows

    @staticmethod
    def flat(grads) -> np.ndarray:
        return np.concatenate([np.asarray(g, np.float64).ravel() for g in jax.tree.leaves(grads)])

    @staticmethod
    def changed(images):
        """`images` with example 0 changed (scaled and shifted), the others as they were."""
        changed = images.copy()
        changed[0] = 5.0 * changed[0] + 1.0
        return changed

    @pytest.fixture(scope="class")
    @classmethod
    def sums(cls, family):
        """What the clipper tests check, each program compiled once for the class: the
        per-example gradients `rows` of `jax.vmap(jax.grad)`; the clipper as the trainer runs
        it (ghost=None) unclipped (C = inf) and at C = the median norm on the images, there on
        `changed` ones too, and there with each example masked out in turn (`left_out`); the
        clipper with every gradient instantiated (ghost=False) at the median and unclipped,
        each as (norms, flattened clipped sum).

        Where the two clippers lower to the same program (a family whose layers the cost
        choice all instantiates), that one program answers both. Computed in the tests, the
        programs were compiled 2-3 times per class: the suite drops a worker's programs
        between tests once its memory grew 3 GiB (tests/conftest.py), and a family's
        programs did, so the next test traced and loaded them again (ConvNeXt-Atto: 15 s). The
        four timm classes of tests/test_contract.py: 165 -> 107 s here, one process."""
        self = cls()
        _, model, images = family
        x, labels, params, _, rows = self.per_example(family, ghost=None)
        ones = np.ones(self.examples, np.float32)
        args = (params, (x, labels), jnp.float32(1.0), jnp.asarray(ones))
        programs = {}
        for ghost in (None, False):
            lowered = self.clippers(model, ghost)[1].lower(*args)
            text = lowered.as_text()
            same = [p for other, p in programs.values() if other == text]
            programs[ghost] = text, same[0] if same else lowered.compile()

        def run(ghost, clip, x=x, mask=ones):
            with jax.enable_x64(True):
                result = programs[ghost][1](params, (x, labels), jnp.float32(clip),
                                            jnp.asarray(mask))
            return np.asarray(result.norms, np.float64), self.flat(result.grads)

        median = float(np.median(np.linalg.norm(rows, axis=1)))
        return {
            "rows": rows,
            "median": median,
            "trainer": {clip: run(None, clip) for clip in (np.inf, median)},
            "changed": run(None, median, x=self.nhwc(self.changed(images))),
            "left_out": [run(None, median, mask=mask)[1] for mask in self.masks_leaving_out()],
            "instantiated": {clip: run(False, clip) for clip in (median, np.inf)},
        }

    def test_no_example_touches_another(self, family, sums):
        """Changing one example changes no other example's logits, nor (in the DP step's own
        forward and backward pass) its gradient norm: BatchNorm is frozen."""
        _, model, images = family
        changed = self.changed(images)
        before, after = (self.logits(model, self.nhwc(x)) for x in (images, changed))
        assert not np.allclose(before[0], after[0])
        np.testing.assert_array_equal(np.asarray(before[1:]), np.asarray(after[1:]))
        norms = [sums["trainer"][sums["median"]][0], sums["changed"][0]]
        assert norms[0][0] != norms[1][0]
        np.testing.assert_allclose(norms[0][1:], norms[1][1:], rtol=1e-6)

    def test_clipped_sum_is_per_example_clipping(self, sums):
        """Every gradient instantiated (no ghost norm): the clipped sum within 1e-5 relative of
        sum_i min(1, C / |g_i|) g_i with g_i from `jax.vmap(jax.grad)` and C the median norm
        (half the examples clipped), and at C = inf of the plain sum."""
        rows = sums["rows"]
        norms = np.linalg.norm(rows, axis=1)
        for clip in (sums["median"], np.inf):
            expected = (np.minimum(1.0, clip / norms)[:, None] * rows).sum(0)
            ours, clipped_sum = sums["instantiated"][clip]
            np.testing.assert_allclose(ours, norms, rtol=1e-5)
            assert np.linalg.norm(clipped_sum - expected) <= 1e-5 * np.linalg.norm(expected)

    def masks_leaving_out(self) -> list[np.ndarray]:
        """One float32 mask per example: every example but that one."""
        return [(np.arange(self.examples) != row).astype(np.float32)
                for row in range(self.examples)]

    @staticmethod
    def check_leave_one_out(rows, plain, full, left_out, clip):
        """The clipper's unclipped result `plain` (norms, sum): norms are upper bounds of the
        rows' within 1e-3 (the ghost norm's float32 rounding bound), the sum is the rows' within
        1e-5; each of `left_out` (the sum at `clip` without one example) is within
        C (1 + 1e-6) of `full` (the sum at `clip` of all)."""
        norms = np.linalg.norm(rows, axis=1)
        bounds, plain_sum = plain
        assert np.linalg.norm(plain_sum - rows.sum(0)) <= 1e-5 * np.linalg.norm(rows.sum(0))
        assert (bounds >= norms * (1 - 1e-6)).all() and (bounds <= norms * (1 + 1e-3)).all()
        for row, other in enumerate(left_out):
            moved = np.linalg.norm(full - other)
            assert moved <= clip * (1 + 1e-6), (row, moved / clip)

    def test_leave_one_out_moves_the_sum_by_at_most_c(self, sums):
        """The clipper as the trainer runs it (ghost norm or instantiation per layer by cost):
        its norms are upper bounds of `jax.vmap(jax.grad)`'s within 1e-3 (the ghost norm's
        float32 rounding bound), its unclipped sum is the plain sum within 1e-5, and removing
        any one example moves the clipped sum by at most C (1 + 1e-6)."""
        median = sums["median"]
        self.check_leave_one_out(sums["rows"], sums["trainer"][np.inf],
                                 sums["trainer"][median][1], sums["left_out"], median)
