"""The DP contract, written once and reused by every clipper and every trainer.

Modelled on dp_accounting's abstract `PrivacyAccountantTest`: a subclass names its clipper
(`ClipperContract.clipper`, any `dp.Clipper`: the probe's closed form, per-example gradients,
book-keeping) or runs its trainer (`TrainerContract.train`), and inherits every test. A new
clipper or trainer plugs in by subclassing.

  * leave-one-out: removing any one example, or replacing it by a null record (NaN features,
    a label outside the class set, a masked row) moves the clipped sum by at most C, on rows
    built to break clipping (huge norms, overflow, cancelling views, float16);
  * C = inf and sigma = 0 give the plain (unclipped, noiseless) gradient, and a clipper's
    reported norms are the per-example gradients' (`jax.vmap(jax.grad)`);
  * the noise has std sigma C (KS test that rejects a scale off by x0.67 or x1.5);
  * no recompilation: a second call, and differently sized sampled batches, reuse the programs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from scipy import stats

from dpprobe import accounting, dp, probe

NUM_CLASSES = 3


def adversarial_rows(rng, views: int, dtype):
    """16 ordinary rows, then rows built to break clipping: huge norms, nearly antipodal large
    views (their gradients cancel in the view average), overflow to the dtype's max."""
    dim = 6
    base = rng.normal(size=(16, views, dim))
    scales = [1.0, 1e3, 1e4, 3e4, 1e18, 1e20] if dtype == np.float32 else [1.0, 3e3, 6e4]
    rows = []
    for scale in scales:
        row = rng.normal(size=(views, dim))
        if views > 1:
            row[1::2] = -row[0::2][: len(row[1::2])] * (1 + 1e-3)
        rows.append(row / np.linalg.norm(row[0]) * scale)
    features = np.concatenate([base, np.stack(rows)]).astype(dtype)
    features = np.where(np.isfinite(features), features, np.finfo(dtype).max)
    labels = np.arange(len(features)) % NUM_CLASSES
    return (features[:, 0] if views == 1 else features), labels, 16


def plain_gradient_sum(features, labels, spec: probe.ProbeSpec) -> np.ndarray:
    """The reference: sum over examples of jax.vmap(jax.grad) of the probe's loss at init,
    flattened as (w, b), float64."""
    params = jax.tree.map(lambda p: p[0], probe.init_params(1, features.shape[-1], spec))
    x = jnp.asarray(features, jnp.float32)

    def loss(params, x, y):
        logits = probe.linear_logits(jax.tree.map(lambda p: p[None], params), x[None])[0, 0]
        return probe.example_losses(logits[None], jax.nn.one_hot(y, NUM_CLASSES)[None],
                                    spec.loss)[0]

    grads = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(params, x, jnp.asarray(labels))
    return np.concatenate([np.asarray(grads["w"], np.float64).sum(0).ravel(),
                           np.asarray(grads["b"], np.float64).sum(0)])


def assert_leave_one_out_within_c(clipped_sum, nulled_sum, features, labels, first, clips):
    """Removing row 0 or any adversarial row (from `first` on), or making it a null record
    (`nulled_sum(features, labels, row, clips)`), moves each clip norm's sum by at most
    C (1 + 1e-6)."""
    full = clipped_sum(features, labels, clips)
    assert np.isfinite(full).all()
    for row in [0, *range(first, len(labels))]:
        keep = np.arange(len(labels)) != row
        for other in (clipped_sum(features[keep], labels[keep], clips),
                      nulled_sum(features, labels, row, clips)):
            moved = np.linalg.norm(full - other, axis=1)
            assert (moved <= np.array(clips) * (1 + 1e-6)).all(), (row, moved / clips)


def assert_plain_gradient(clipped_sum, spec, rng, rtol, n=24, d=6):
    """C = inf (and no noise) gives the plain sum of per-example gradients."""
    features = (rng.normal(size=(n, d)) * 3 / np.sqrt(d / 6)).astype(np.float32)
    labels = np.arange(n) % NUM_CLASSES
    np.testing.assert_allclose(clipped_sum(features, labels, [math.inf])[0],
                               plain_gradient_sum(features, labels, spec), rtol=rtol, atol=rtol)


def probe_loss(spec: probe.ProbeSpec):
    """The probe's loss of one example for a generic clipper: params {"w": (d, C), "b": (C,)},
    x (1, V, d) (the views, averaged), y (1,)."""

    def loss(params, x, y):
        logits = jnp.einsum("nvd,dc->nvc", x, params["w"], precision="highest") + params["b"]
        return probe.example_losses(logits, jax.nn.one_hot(y, NUM_CLASSES)[:, None, :],
                                    spec.loss).mean()

    return loss


def flat(grads) -> np.ndarray:
    """A clipped sum {"w", "b"} (one config, with or without its leading axis of 1) as one
    float64 vector (w, then b)."""
    return np.concatenate([np.asarray(grads["w"], np.float64).ravel(),
                           np.asarray(grads["b"], np.float64).ravel()])


_COMPILED: dict[type, dp.Clipper] = {}  # ClipperContract.compiled's, by test class


class ClipperContract:
    """Subclass and define `clipper()`, a `dp.Clipper` of the probe's loss, and
    `inputs(features, labels, clip_norm)` -> (params at zero init, batch, clip_norm) in the
    form that clipper takes. Every test runs the clipper through the `dp.Clipper` interface."""

    spec = probe.ProbeSpec(NUM_CLASSES, optimizer="sgd")

    def clipper(self) -> dp.Clipper:
        raise NotImplementedError  # abstract: each subclass names its clipper

    def inputs(self, features, labels, clip_norm):
        raise NotImplementedError  # abstract: each subclass lays out its inputs

    def run(self, features, labels, clip_norm, mask=None) -> dp.ClippedSum:
        params, batch, clip = self.inputs(features, labels, clip_norm)
        mask = np.ones(len(labels), np.float32) if mask is None else mask
        return self.compiled()(params, batch, clip, jnp.asarray(mask, jnp.float32))

    def compiled(self) -> dp.Clipper:
        """The clipper under `jax.jit`, as a training step calls it: one program per input
        shape for the class's tests (run op by op, a call cost ~0.2 s of dispatch, and a
        leave-one-out test makes 45 calls on two shapes)."""
        if type(self) not in _COMPILED:
            _COMPILED[type(self)] = jax.jit(self.clipper())
        return _COMPILED[type(self)]

    def clipped_sum(self, features, labels, clips, mask=None) -> np.ndarray:
        """(P, k) float64: each clip norm's clipped sum, flattened."""
        return np.stack([flat(self.run(features, labels, clip, mask).grads) for clip in clips])

    @pytest.mark.parametrize("case,views,dtype", [(0, 1, np.float32), (1, 1, np.float16),
                                                  (2, 2, np.float32), (3, 2, np.float16)])
    def test_leave_one_out_moves_the_sum_by_at_most_c(self, case, views, dtype):
        features, labels, first = adversarial_rows(np.random.default_rng(case), views, dtype)

        def masked_sum(features, labels, row, clips):
            mask = (np.arange(len(labels)) != row).astype(np.float32)
            return self.clipped_sum(features, labels, clips, mask)

        assert_leave_one_out_within_c(self.clipped_sum, masked_sum, features, labels, first,
                                      [0.5, 1.0, 2.0])

    def test_masked_rows_contribute_zero(self, rng):
        features = rng.normal(size=(12, 6)).astype(np.float32)
        labels = np.arange(12) % NUM_CLASSES
        mask = np.ones(12, np.float32)
        mask[[2, 7]] = 0
        keep = mask > 0
        np.testing.assert_allclose(self.clipped_sum(features, labels, [1.0], mask),
                                   self.clipped_sum(features[keep], labels[keep], [1.0]),
                                   rtol=1e-5, atol=1e-6)

    def test_infinite_clip_gives_the_plain_gradient(self, rng):
        assert_plain_gradient(self.clipped_sum, self.spec, rng, rtol=1e-5)

    def test_norms_are_the_per_example_gradient_norms(self, rng):
        """The norms a clipper reports are those of `jax.vmap(jax.grad)`'s gradients (the
        closed form's upper bounds are within a relative 1e-4 of them)."""
        features = rng.normal(size=(10, 2, 6)).astype(np.float32) * 3
        labels = np.arange(10) % NUM_CLASSES
        params = jax.tree.map(lambda p: p[0], probe.init_params(1, 6, self.spec))
        params = jax.tree.map(lambda p: p + 0.3, params)  # away from init: unequal residuals
        loss = probe_loss(self.spec)
        grads = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(
            params, jnp.asarray(features)[:, None], jnp.asarray(labels)[:, None])
        exact = np.sqrt(sum(np.square(np.asarray(g, np.float64)).reshape(10, -1).sum(1)
                            for g in jax.tree.leaves(grads)))
        ours, batch, clip = self.inputs(features, labels, 1.0)
        ours = jax.tree.map(lambda mine, p: (p + 0.3).reshape(np.shape(mine)).astype(mine.dtype),
                            ours, jax.tree.map(lambda p: p[0], probe.init_params(1, 6, self.spec)))
        norms = self.clipper()(ours, batch, clip, jnp.ones(10, jnp.float32)).norms
        np.testing.assert_allclose(np.asarray(norms, np.float64).ravel(), exact, rtol=1e-4)

    def test_noise_of_the_privatized_sum_is_sigma_times_c(self, rng):
        """The clipped sum through `dp.private_optimizer` (SGD, lr 1): with zero features the
        weight gradient is exactly 0, so the update is noise / N of std sigma C / N."""
        n, d, sigma, clip_norm = 16, 128, 2.0, 0.7
        features, labels = np.zeros((n, d), np.float32), np.arange(n) % NUM_CLASSES
        params, batch, clip = self.inputs(features, labels, clip_norm)
        tx = dp.private_optimizer(optax.sgd(1.0), stddev=sigma * clip_norm,
                                  key=dp.make_keys(1)[0], expected_batch_size=n)
        samples = []
        for _ in range(8):
            grads = self.compiled()(params, batch, clip, jnp.ones(n, jnp.float32)).grads
            updates, _ = tx.update(grads, tx.init(params), params)
            samples.append(np.asarray(updates["w"], np.float64).ravel())
            tx = dp.private_optimizer(optax.sgd(1.0), stddev=sigma * clip_norm,
                                      key=dp.make_keys(1)[0], expected_batch_size=n)
        samples = np.concatenate(samples)
        expected = sigma * clip_norm / n
        assert stats.kstest(samples, stats.norm(scale=expected).cdf).pvalue > 1e-4
        for wrong in (0.67, 1.5):
            assert stats.kstest(samples, stats.norm(scale=wrong * expected).cdf).pvalue < 1e-6

    def test_no_recompilation_across_batch_sizes(self, rng):
        """One compiled program for a physical batch whatever the number of real rows in it
        (the mask) and the data."""
        features = rng.normal(size=(16, 6)).astype(np.float32)
        labels = np.arange(16) % NUM_CLASSES
        params, batch, clip = self.inputs(features, labels, 1.0)
        clipped = jax.jit(self.clipper())
        clipped(params, batch, clip, jnp.ones(16, jnp.float32))
        params2, batch2, clip2 = self.inputs(features * 2, labels[::-1].copy(), 0.5)
        fewer = jnp.asarray((np.arange(16) < 5).astype(np.float32))
        again = count_compilations(lambda: jax.block_until_ready(clipped(
            params2, batch2, clip2, fewer)))
        assert again == 0


def count_compilations(fn) -> int:
    """How many XLA compilations `fn()` triggers."""
    events = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        fn()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return len(events)


class TrainerContract:
    """Subclass and define `train(features, labels, runs, spec) -> probe.TrainResult` (keys
    from `dp.make_keys`). `sampled` trainers get plans with `sampling_probability`."""

    sampled = False
    spec = probe.ProbeSpec(NUM_CLASSES, optimizer="sgd")

    def train(self, features, labels, runs, spec) -> probe.TrainResult:
        raise NotImplementedError  # abstract: each subclass runs its trainer

    def plan(self, sigma, steps, clip, q=1.0) -> accounting.DpPlan:
        return accounting.DpPlan(sigma, steps, q if self.sampled else 1.0, clip)

    def clipped_sum(self, features, labels, clips, spec=None) -> np.ndarray:
        """The clipped sum the trainer privatizes, read off one noiseless SGD step (lr 1) from
        zero init: params_1 = params_0 - sum / N."""
        spec = spec or self.spec
        runs = [probe.RunSpec(self.plan(0.0, 1, c), 1.0) for c in clips]
        result = self.train(features, labels, runs, spec)
        n = len(labels)
        w = -np.asarray(result.params["w"], np.float64) * n
        b = (spec.initial_bias - np.asarray(result.params["b"], np.float64)) * n
        return np.concatenate([w.reshape(len(clips), -1), b], axis=1)

    @pytest.mark.parametrize("views,dtype", [(1, np.float32), (1, np.float16), (2, np.float32),
                                             (4, np.float32), (2, np.float16)])
    def test_leave_one_out_moves_the_clipped_sum_by_at_most_c(self, views, dtype):
        """Removing any one example, or replacing it by a null record (a label outside the
        class set), moves every run's clipped sum by at most its C (1 + 1e-6)."""
        features, labels, first = adversarial_rows(np.random.default_rng(views), views, dtype)

        def nulled_sum(features, labels, row, clips):
            nulled = labels.copy()
            nulled[row] = -1
            return self.clipped_sum(features, nulled, clips)

        assert_leave_one_out_within_c(self.clipped_sum, nulled_sum, features, labels, first,
                                      [0.5, 1.0, 2.0])

    def test_null_records_contribute_nothing(self, rng):
        """Rows with NaN/Inf features, or that normalize to NaN, are null records: the same sum
        as with their labels nulled, and no error."""
        features = rng.normal(size=(20, 6)).astype(np.float32)
        labels = np.arange(20) % NUM_CLASSES
        bad = features.copy()
        bad[4, 2], bad[9], bad[13] = np.nan, np.inf, 3e38  # the last overflows "group"
        nulled = labels.copy()
        nulled[[4, 9, 13]] = -1
        for spec in (self.spec, probe.ProbeSpec(NUM_CLASSES, optimizer="sgd",
                                                normalization="group", groups=2)):
            expected = self.clipped_sum(features, nulled, [1.0], spec)
            np.testing.assert_allclose(self.clipped_sum(bad, labels, [1.0], spec), expected,
                                       rtol=1e-5, atol=1e-5)

    def test_unclipped_noiseless_step_is_the_plain_gradient(self, rng):
        assert_plain_gradient(self.clipped_sum, self.spec, rng, rtol=1e-4)

    def test_plain_gradient_at_a_realistic_width(self, rng):
        """d = 768 (a ViT's width), thousands of rows: the compiled programs XLA emits at this
        size differ from the small tests' (an XLA CPU fusion once returned NaN there)."""
        assert_plain_gradient(self.clipped_sum, self.spec, rng, rtol=1e-3, n=3000, d=768)

    def test_noise_std_is_sigma_times_c(self):
        """With zero features the weight gradient is exactly 0, so after one step from zero
        w = -lr (noise / denominator): its std must be sigma C lr / denominator."""
        n, d, sigma, clip, lr = 40, 256, 2.0, 0.7, 0.5
        features = np.zeros((n, d), np.float32)
        labels = np.arange(n) % NUM_CLASSES
        q = 0.5 if self.sampled else 1.0
        runs = [probe.RunSpec(self.plan(sigma, 1, clip, q), lr) for _ in range(8)]
        result = self.train(features, labels, runs, self.spec)
        samples = np.asarray(result.params["w"], np.float64).ravel()
        expected = sigma * clip * lr / (q * n)
        assert samples.size == 8 * d * NUM_CLASSES  # enough to reject x0.67 and x1.5
        assert stats.kstest(samples, stats.norm(scale=expected).cdf).pvalue > 1e-4
        for wrong in (0.67, 1.5):
            assert stats.kstest(samples, stats.norm(scale=wrong * expected).cdf).pvalue < 1e-6

    def test_no_recompilation(self, rng):
        """A second call with other data (and, sampled, other batch sizes) compiles nothing."""
        features = rng.normal(size=(40, 6)).astype(np.float32)
        labels = np.arange(40) % NUM_CLASSES
        runs = [probe.RunSpec(self.plan(1.0, 6, 1.0, 0.3), 0.1) for _ in range(2)]
        self.train(features, labels, runs, self.spec)
        again = count_compilations(lambda: self.train(features * 2, labels[::-1].copy(), runs,
                                                      self.spec))
        assert again == 0


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

    def test_logits_match_timm(self, family):
        import torch

        timm_model, model, images = family
        with torch.no_grad():
            expected = timm_model(torch.from_numpy(images)).numpy()
        np.testing.assert_allclose(np.asarray(self.logits(model, self.nhwc(images))), expected,
                                   rtol=0, atol=1e-4)

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
