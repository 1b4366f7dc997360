"""Every clipper and every trainer meets the DP contract (tests/contract.py)."""

import jax
import jax.numpy as jnp
import numpy as np

import probe
from tests.contract import ClipperContract, TrainerContract


class TestClosedFormClipper(ClipperContract):
    """`probe.clipped_grad_sum`: the linear probe's per-example norms in closed form."""

    def clipped_sum(self, features, labels, clips, mask=None):
        params = probe.init_params(len(clips), features.shape[-1], self.spec)
        sums, _ = probe.clipped_grad_sum(
            params, jnp.asarray(features), jax.nn.one_hot(labels, 3), jnp.asarray(clips,
                                                                                   jnp.float32),
            loss=self.spec.loss, mask=None if mask is None else jnp.asarray(mask))
        return np.concatenate([np.asarray(sums["w"], np.float64).reshape(len(clips), -1),
                               np.asarray(sums["b"], np.float64)], axis=1)


class TestInMemoryTrainer(TrainerContract):
    def train(self, features, labels, runs, spec):
        return probe.train_probe(features, labels, runs, probe.make_keys(len(runs)), spec)


class TestShardedTrainer(TrainerContract):
    def train(self, features, labels, runs, spec):
        flags = probe.PerformanceFlags(mesh=probe.make_data_mesh(1))
        return probe.train_probe(features, labels, runs, probe.make_keys(len(runs)), spec,
                                 flags=flags)


class TestStreamedTrainer(TrainerContract):
    def train(self, features, labels, runs, spec):
        def chunks():
            for start in range(0, len(labels), 5):
                yield features[start:start + 5], labels[start:start + 5]

        return probe.train_probe_streaming(
            chunks, runs, probe.make_keys(len(runs)), spec, num_examples=len(labels),
            dim=features.shape[-1], flags=probe.PerformanceFlags(rows_per_chunk=5))


class TestPoissonTrainer(TrainerContract):
    sampled = True

    def train(self, features, labels, runs, spec):
        return probe.train_probe_poisson(features, labels, runs, probe.make_keys(len(runs)),
                                         spec, flags=probe.PerformanceFlags(physical_batch_size=7))


class TestJaxPrivacyClipper(ClipperContract):
    """`jax_privacy.clipped_grad` (per-example gradients of any loss, the clipper the
    full-finetuning path builds on) on the probe's loss, views averaged per example."""

    def clipped_sum(self, features, labels, clips, mask=None):
        from jax_privacy import clipped_grad

        spec = self.spec
        params = jax.tree.map(lambda p: p[0], probe.init_params(1, features.shape[-1], spec))
        x = jnp.asarray(features, jnp.float32)
        x = x if x.ndim == 3 else x[:, None, :]

        def loss(params, x, y):  # one example: x (1, V, d), y (1,)
            logits = jnp.einsum("nvd,dc->nvc", x, params["w"]) + params["b"]
            onehot = jax.nn.one_hot(y, 3)[:, None, :]
            return probe.example_losses(logits, onehot, spec.loss).mean()

        padding = None if mask is None else jnp.asarray(mask) == 0
        rows = []
        for clip in clips:
            grad_fn = clipped_grad(loss, l2_clip_norm=clip, batch_argnums=(1, 2))
            sums = grad_fn(params, x, jnp.asarray(labels), is_padding_example=padding)
            rows.append(np.concatenate([np.asarray(sums["w"], np.float64).ravel(),
                                        np.asarray(sums["b"], np.float64)]))
        return np.stack(rows)
