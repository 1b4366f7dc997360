"""The levers of the tune recipe, one at a time, on Fashion-MNIST ScatterNet features.

Each lever trains full-batch DP probes at a total epsilon (default 3, delta 1e-5) for a few
learning rates, `--reps` runs each (fresh noise), and prints the test accuracy per learning
rate (median over runs) with the selection free: what the lever can give at best, before the
linear scaling search pays for choosing r. A lever's own private mechanism (the DP
standardization) is paid from the same total epsilon; the rest goes to training.

Levers (name: what changes from "group27-T300", the tune default without standardization):
  none-T100, group27-T100, group9-T100, group81-T100: per-example normalization, T = 100;
  group27-T300: GroupNorm over 27 channel groups (Tramer & Boneh), momentum 0.9, clip 1;
  std-exact: + per-feature standardization with exact statistics (NOT private: an upper bound
    on what any private standardization can give);
  std-dp: + `probe.private_standardizer`, eps/10 (the tune default);
  adam: DP-Adam instead of momentum;  clip10, clip0.1: clip norm 10 or 0.1 (lr scaled by 1/C);
  wd: + weight decay 1e-3 (post-processing);  nonprivate: the recipe without noise (no
  guarantee; the ceiling of the recipe at T = 300);
  clip10-T300, clip30-T300: clip norm 10 or 30 at T = 300 (only the least confident examples
    clipped; lr scaled by 1/C);
  pool4: ScatterNet's 7 x 7 positions average-pooled to 4 x 4 before GroupNorm (d 3969 ->
    1296: less noise per useful direction?);
  pca1024-exact, whiten-exact: the GroupNorm features projected on their top 1024 principal
    directions, and those scaled by eigenvalue^-1/4 and L2-normalized (partial whitening),
    with the EXACT covariance (NOT private: an upper bound on what a private PCA could give);
  poisson-q0.1: Poisson minibatches of expected size N/10 (masked DP-SGD, Beltran et al.),
    T = 3000 (the same number of examples processed as T = 300 full batch), sigma calibrated
    with PLD for (q, T).

Run: .venv/bin/python benchmarks/tune_recipe.py --store STORE [--levers a,b] [--reps 3]
"""

from __future__ import annotations

import argparse
import math
import time

import _path  # noqa: F401 - first: keeps this folder off the import path
import numpy as np

DELTA = 1e-5
# name: (normalization, groups, steps, optimizer, clip, standardization, learning rates, extra)
LEVERS = {
    "none-T100": ("none", 1, 100, "momentum", 1.0, None, (30.0, 100.0, 300.0), {}),
    "group27-T100": ("group", 27, 100, "momentum", 1.0, None, (3.0, 6.0), {}),
    "group9-T100": ("group", 9, 100, "momentum", 1.0, None, (2.0, 4.0, 8.0), {}),
    "group81-T100": ("group", 81, 100, "momentum", 1.0, None, (2.0, 4.0, 8.0), {}),
    "group27-T300": ("group", 27, 300, "momentum", 1.0, None, (0.7, 1.0, 2.0), {}),
    "std-exact": ("group", 27, 300, "momentum", 1.0, "exact", (0.7, 1.0), {}),
    "std-dp": ("group", 27, 300, "momentum", 1.0, "dp", (0.7, 1.0, 1.4), {}),
    "adam": ("group", 27, 300, "adam", 1.0, None, (0.005, 0.012, 0.03), {}),
    "clip10": ("group", 27, 100, "momentum", 10.0, None, (0.3, 0.6), {}),
    "clip0.1": ("group", 27, 100, "momentum", 0.1, None, (30.0, 60.0), {}),
    "wd": ("group", 27, 300, "momentum", 1.0, None, (2.0, 4.0), {"weight_decay": 1e-3}),
    "nonprivate": ("group", 27, 300, "momentum", 1.0, None, (1.0, 3.0, 10.0), {"sigma": 0}),
    "clip10-T300": ("group", 27, 300, "momentum", 10.0, None, (0.05, 0.1), {}),
    "clip30-T300": ("group", 27, 300, "momentum", 30.0, None, (0.017, 0.033), {}),
    "pool4": ("group", 27, 300, "momentum", 1.0, "pool4", (2.0, 4.0, 8.0), {}),
    "pca1024-exact": ("group", 27, 300, "momentum", 1.0, "pca", (1.0, 2.0), {"dims": 1024}),
    "poisson-q0.1": ("group", 27, 3000, "momentum", 1.0, None, (0.05, 0.1, 0.2), {"q": 0.1}),
    "whiten-exact": ("group", 27, 300, "momentum", 1.0, "pca", (5.0, 10.0, 20.0),
                     {"dims": 1024, "power": 0.25}),
}


def _pool4(features):
    """ScatterNet features (N, 81 * 7 * 7, channel-major) average-pooled 2 x 2 over the
    edge-padded 8 x 8 positions: (N, 81 * 4 * 4)."""
    v = np.asarray(features, np.float32).reshape(len(features), -1, 7, 7)
    v = np.pad(v, ((0, 0), (0, 0), (0, 1), (0, 1)), mode="edge")
    return v.reshape(len(v), v.shape[1], 4, 2, 4, 2).mean((3, 5)).reshape(len(v), -1)


def _exact_pca(features, test, dims: int, power: float):
    """Both splits on the top `dims` principal directions of the training features (exact
    covariance: not private), scaled by eigenvalue^-power; L2-normalized when power > 0."""
    values, vectors = np.linalg.eigh((features.T @ features).astype(np.float64) / len(features))
    order = np.argsort(values)[::-1][:dims]
    basis = (vectors[:, order] * values[order] ** -power).astype(np.float32)
    features, test = features @ basis, test @ basis
    if power > 0:
        features, test = (v / np.linalg.norm(v, axis=1, keepdims=True) for v in (features, test))
    return features, test


def _decayed_spec(num_classes: int, optimizer: str, decay: float):
    """A ProbeSpec whose update rule first adds decay * params to the noisy gradient (weight
    decay: post-processing, it costs no privacy)."""
    import dataclasses

    import optax

    from dpprobe import probe

    @dataclasses.dataclass(frozen=True)
    class DecayedSpec(probe.ProbeSpec):
        decay: float = 0.0

        def make_optimizer(self, learning_rate):
            return optax.chain(optax.add_decayed_weights(self.decay),
                               super().make_optimizer(learning_rate))

    return DecayedSpec(num_classes, optimizer=optimizer, decay=decay)


def lever(name: str, x, y, test_x, test_y, epsilon: float, reps: int) -> np.ndarray:
    """Test accuracy (learning rates x reps) of one lever."""
    from dpprobe import accounting, dp, probe
    from dpprobe.pipelines import tune_job

    normalization, groups, steps, optimizer, clip, std, rates, extra = LEVERS[name]
    spec = probe.ProbeSpec(10, optimizer=optimizer, normalization=normalization, groups=groups)
    if std == "pool4":
        x, test_x = _pool4(x), _pool4(test_x)
    features = probe.prepare_features(x, spec)
    test = np.asarray(probe.normalize_features(test_x, normalization, groups=groups))
    if std == "pca":
        features, test = _exact_pca(features, test, extra["dims"], extra.get("power", 0.0))
    mu = accounting.gdp_mu(epsilon, DELTA)
    if std == "exact":
        mean, scale = features.mean(0), features.std(0) + 1e-5
        features, test = (features - mean) / scale, (test - mean) / scale
    elif std == "dp":
        mu_std = accounting.gdp_mu(epsilon / 10, DELTA)
        standardizer, _ = tune_job.private_standardization(features, y, spec, mu_std)
        features, test = standardizer.apply(features), standardizer.apply(test)
        mu = math.sqrt(mu * mu - mu_std * mu_std)
    rate = extra.get("q", 1.0)
    if extra.get("sigma") == 0:
        sigma = 0.0
    elif rate < 1:  # Poisson: PLD calibration at the budget the full-batch levers get
        sigma = accounting.calibrate_noise_multiplier(accounting.gdp_epsilon(mu, DELTA), DELTA,
                                                      steps=steps, sampling_probability=rate)
    else:
        sigma = math.sqrt(steps) / mu
    plan = accounting.DpPlan(sigma, steps, rate, clip)
    runs = [probe.RunSpec(plan, lr) for lr in rates for _ in range(reps)]
    decay = extra.get("weight_decay", 0.0)
    train_spec = (_decayed_spec(10, optimizer, decay) if decay
                  else probe.ProbeSpec(10, optimizer=optimizer))
    trainer = probe.train_probe if rate == 1 else probe.train_probe_poisson
    result = trainer(np.asarray(features, np.float32), y, runs, dp.make_keys(len(runs)),
                     train_spec)
    accs = probe.evaluate(result.params, test, test_y)["top1"]
    return accs.reshape(len(rates), reps)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="Fashion-MNIST ScatterNet store")
    parser.add_argument("--levers", default=",".join(LEVERS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--epsilon", type=float, default=3.0)
    args = parser.parse_args()

    from dpprobe import extract

    x, y, _ = extract.load_split(args.store, "train", dtype=None)
    test_x, test_y, _ = extract.load_split(args.store, "test", dtype=None)
    print(f"epsilon {args.epsilon:g}, delta {DELTA:g}, free selection over lr; test accuracy % "
          f"per lr: median [runs]")
    for name in args.levers.split(","):
        start = time.perf_counter()
        accs = 100 * lever(name, x, y, test_x, test_y, args.epsilon, args.reps)
        cells = "  ".join(f"lr {lr:g}: {np.median(a):.2f} {np.round(a, 2).tolist()}"
                          for lr, a in zip(LEVERS[name][6], accs, strict=True))
        print(f"{name:>13s}  {cells}  ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
