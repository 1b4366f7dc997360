"""The one-run audit of the finetuning trainer (`finetune.canaries`, Steinke, Nasr & Jagielski
2023): sound on the production mechanism, and it catches a mechanism without noise; the
`dpprobe finetune --audit-canaries` record."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dpprobe.finetune.train  # noqa: F401 (loads the submodule)
from dpprobe import accounting, finetune, pipelines
from dpprobe.finetune import job as finetune_job
from dpprobe.finetune.canaries import insert_canaries, make_canaries
from dpprobe.pipelines import cli
from dpprobe.pipelines.finetune_job import finetune_audit_line

DELTA = 1e-5
CLASSES = 4


class TinyMLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(64, 64, rngs=rngs)
        self.head = nnx.Linear(64, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.head(jnp.tanh(self.hidden(x.reshape(x.shape[0], -1))))


def _data(rng, n=64, side=8):
    labels = rng.integers(0, CLASSES, n)
    images = rng.integers(0, 60, (n, side, side, 1)).astype(np.uint8)
    images[labels == 1, : side // 2] += 150
    return images, labels


def _audit(rng, epsilon, confidence):
    """m = 200 canaries on 64 rows, 100 Poisson steps (q = 1/2) of sgd at lr 4: strong enough
    to memorize most included canaries when there is no noise."""
    steps, q = 100, 0.5
    sigma = accounting.calibrate_noise_multiplier(epsilon, DELTA, steps=steps,
                                                  sampling_probability=q)
    plan = accounting.DpPlan(sigma, steps, q, 1.0)
    spec = finetune.FinetuneSpec(CLASSES, optimizer="sgd", learning_rate=4.0, ema_decay=None,
                                 mean=(0.5,), std=(0.5,))
    return finetune.audit_finetune(
        TinyMLP(nnx.Rngs(0)), *_data(rng), plan, spec, canaries=200, delta=DELTA,
        confidence=confidence, seed=int(rng.integers(2**31)),
        flags=finetune.FinetuneFlags(physical_batch_size=128))


def test_the_bound_stays_below_the_claim_of_the_production_mechanism(rng):
    """At confidence 0.999 a sound mechanism's bound exceeds its claim with probability
    <= 1e-3 (Steinke et al. Thm. 3.1; the threshold by MultiSplit)."""
    result, audit = _audit(rng, epsilon=2.0, confidence=0.999)
    assert audit.epsilon_lower <= audit.claimed_epsilon
    assert not audit.refuted
    assert abs(audit.claimed_epsilon - 2.0) < 1e-3
    assert audit.canaries == 200 and 0 < audit.included < 200
    assert audit.ratio == audit.epsilon_lower / audit.claimed_epsilon
    assert result.steps == 100


def test_the_bound_catches_a_mechanism_without_noise(rng, monkeypatch):
    """The noise dropped (claim epsilon 0.5): the model memorizes the included canaries and
    the bound (measured 0.99 to 1.2 over repetitions, at most ~1.5 with 200 canaries) exceeds
    the claim."""
    monkeypatch.setattr(finetune.train, "noise_stddev", lambda plan: 0.0)
    _, audit = _audit(rng, epsilon=0.5, confidence=0.95)
    assert audit.epsilon_lower > 0.5 and audit.refuted
    assert audit.auroc > 0.85


def test_canaries_are_public_noise_and_excluded_ones_are_null_records():
    images, labels, included = make_canaries((8, 8, 1), np.uint8, CLASSES, 50,
                                             np.random.default_rng(1))
    again = make_canaries((8, 8, 1), np.uint8, CLASSES, 50, np.random.default_rng(1))
    assert all(np.array_equal(a, b) for a, b in zip((images, labels, included), again, strict=True))
    assert images.dtype == np.uint8 and images.shape == (50, 8, 8, 1)
    assert labels.min() >= 0 and labels.max() < CLASSES
    data = np.zeros((10, 8, 8, 1), np.uint8), np.arange(10) % CLASSES
    train_images, train_labels = insert_canaries(*data, images, labels, included)
    assert len(train_labels) == 60  # N + m whatever the coins: zero-out neighbours
    assert np.array_equal(train_labels[10:], np.where(included, labels, -1))
    assert np.array_equal(train_images[10:], images)


@pytest.mark.parametrize("kind", ["image", "gradient"])
def test_finetune_audit_option_records_and_prints_the_bound(rng, tmp_path, monkeypatch, kind):
    """The job's wiring, on the tiny model (the CNN's compilation alone takes ~25 s here;
    `tests/pipelines/test_finetune_job.py` runs it), for both kinds of canaries."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(finetune_job, "_build_model", lambda config, *shape: (
        TinyMLP(nnx.Rngs(0)), (0.5,), (0.5,), {"name": "tiny"}))
    for name, n in (("train", 40), ("test", 20)):
        images, labels = _data(rng, n)
        np.savez(f"{name}.npz", images=images[..., 0], labels=labels,
                 class_names=np.array(list("abcd")))
    parser = cli.build_parser("finetune")
    config = cli.make_config(parser.parse_args([
        "finetune", "--data", "npz:train.npz", "--test-data", "npz:test.npz", "--model", "cnn",
        "--batch-size", "40", "--steps", "2", "--augmult", "1", "--physical-batch-size", "64",
        "--epsilon", "2", "--audit-canaries", "20", "--audit-kind", kind, "--quiet"]))
    assert config.audit_canaries == 20 and config.audit_kind == kind
    results = json.loads(json.dumps(pipelines.run_finetune(config)))
    audit = results["audit"]
    assert audit["canaries"] == 20 and audit["epsilon_lower"] <= audit["claimed_epsilon"]
    assert audit["claimed_epsilon"] == pytest.approx(results["privacy"]["epsilon"])
    assert "audit artefact" in audit["model"] and results["model"]["audit_artefact"] is True
    assert results["data"]["num_train"] == 40 and results["privacy"]["num_canaries"] == 20
    assert results["privacy"]["plan"]["sampling_probability"] == pytest.approx(40 / 60)
    assert results["privacy"]["plan"]["steps"] == 2
    line = finetune_audit_line(audit)
    if kind == "image":
        assert "weak by construction" in audit["note"] and "never prove" in audit["note"]
        assert line.startswith("audit (one run, 20 canaries")
    else:
        assert audit["kind"] == "gradient" and audit["epsilon_estimate"] >= 0
        assert "not a bound" in audit["epsilon_estimate_method"]
        assert line.startswith("audit (white box, 20 gradient canaries")
    assert "claimed 2.000" in line
    assert "CLAIM REFUTED" in finetune_audit_line(audit | {"refuted": True})
    with pytest.raises(SystemExit):
        cli.make_config(parser.parse_args(["finetune", "--audit-canaries", "1"]))
