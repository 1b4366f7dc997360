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
