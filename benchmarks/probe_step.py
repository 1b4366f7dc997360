"""One full-batch probe step on 50k x 768 features, 10 classes, side by side:

  dp-closed-form   ours: closed-form per-example clipping (norm bounds that hold under float32
                   rounding, HIGHEST precision, null rows) + the mechanism's noise (53-bit
                   float64 sampler, `probe.noisy_mean`) + Adam
  non-private      jax.grad of the mean loss + Adam (the floor)
  dp-vmap-grad     per-example gradients by jax.vmap(jax.grad), clipped, summed, noised + Adam
and the noise alone: our float64 sampler vs float32 `jax.random.normal` (hard support).

Prints median wall time per step over repeats and ratios to the non-private step.
Run: .venv/bin/python benchmarks/probe_step.py [--n 50000 --d 768 --classes 10 --repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import _path  # noqa: F401 - first: keeps this folder off the import path
import jax
import jax.numpy as jnp
import numpy as np
import optax

import probe


def _time(fn, repeats):
    jax.block_until_ready(fn())  # compile + warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=50_000)
    parser.add_argument("--d", type=int, default=768)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    n, d, c = args.n, args.d, args.classes

    rng = np.random.default_rng(0)
    features = jnp.asarray(rng.normal(size=(n, d)).astype(np.float32))
    labels = rng.integers(0, c, size=n)
    onehot = jax.nn.one_hot(labels, c)
    tx = optax.adam(1e-3)
    params = {"w": jnp.asarray(rng.normal(size=(d, c)).astype(np.float32) * 0.01),
              "b": jnp.zeros((c,), jnp.float32)}
    state = tx.init(params)
    key = jax.random.key(0)
    sigma, clip = 2.0, 1.0

    def noise(key, tree):
        keys = jax.random.split(key, 2)
        return {"w": sigma * clip * jax.random.normal(keys[0], tree["w"].shape),
                "b": sigma * clip * jax.random.normal(keys[1], tree["b"].shape)}

    def closed_form_grads(params, key):
        stacked = jax.tree.map(lambda p: p[None], params)
        # As in the trainers: the features were checked once per program (zero_nonfinite_rows,
        # timed below), so each step skips that pass.
        sums, _ = probe.clipped_grad_sum(stacked, features, onehot, jnp.array([clip]),
                                         loss="softmax", finite_rows=True)
        grads = probe.noisy_mean(sums, jnp.array([sigma * clip]), key[None], 0, n)
        return jax.tree.map(lambda g: g[0], grads)

    @jax.jit
    def dp_closed_form(params, state, key):
        updates, state = tx.update(closed_form_grads(params, key), state, params)
        return optax.apply_updates(params, updates), state

    def mean_loss(params):
        logits = features @ params["w"] + params["b"]
        return jnp.mean(probe.example_losses(logits, onehot, "softmax"))

    @jax.jit
    def non_private(params, state):
        grads = jax.grad(mean_loss)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def example_loss(params, x, y):
        return probe.example_losses(x @ params["w"] + params["b"], y, "softmax")

    def vmap_grads(params, key):
        per_example = jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0))(params, features,
                                                                            onehot)
        norms = jnp.sqrt(jnp.sum(per_example["w"] ** 2, axis=(1, 2))
                         + jnp.sum(per_example["b"] ** 2, axis=1))
        scale = jnp.minimum(1.0, clip / norms)
        sums = {"w": jnp.einsum("n,ndc->dc", scale, per_example["w"]),
                "b": jnp.einsum("n,nc->c", scale, per_example["b"])}
        return jax.tree.map(lambda s, z: (s + z) / n, sums, noise(key, sums))

    @jax.jit
    def dp_vmap_grad(params, state, key):
        updates, state = tx.update(vmap_grads(params, key), state, params)
        return optax.apply_updates(params, updates), state

    # Same inputs: the two privatized gradients agree (up to float rounding).
    a = jax.jit(closed_form_grads)(params, key)
    b = jax.jit(vmap_grads)(params, key)
    # Same noise in both? No: ours is the product's sampler, so compare without noise.
    agree = all(bool(np.allclose(a[k], b[k], rtol=1e-4, atol=2 * sigma * clip / n * 6))
                for k in ("w", "b"))

    size = d * c + c
    f64_noise = jax.jit(lambda key: probe.gaussian_noise(key, size))
    f32_noise = jax.jit(lambda key: jax.random.normal(key, (size,)))
    mask = jnp.ones(n)
    zero_rows = jax.jit(lambda x: probe.zero_nonfinite_rows(x, mask))
    zero_rows_f16 = jax.jit(lambda x: probe.zero_nonfinite_rows(x.astype(jnp.float32), mask))
    cast_f16 = jax.jit(lambda x: x.astype(jnp.float32))
    features16 = features.astype(jnp.float16)
    rows = [
        ("non-private full-batch step", _time(lambda: non_private(params, state), args.repeats)),
        ("DP step, closed-form clipping (ours)",
         _time(lambda: dp_closed_form(params, state, key), args.repeats)),
        ("DP step, vmap(grad) clipping", _time(lambda: dp_vmap_grad(params, state, key),
                                               args.repeats)),
        ("noise only: float64 sampler (ours)", _time(lambda: f64_noise(key), args.repeats)),
        ("noise only: float32 jax.random.normal", _time(lambda: f32_noise(key), args.repeats)),
        ("once per program: zero non-finite rows", _time(lambda: zero_rows(features),
                                                         args.repeats)),
        ("  same, fused with the float16 cast", _time(lambda: zero_rows_f16(features16),
                                                      args.repeats)),
        ("  the float16 cast alone", _time(lambda: cast_f16(features16), args.repeats)),
    ]
    base = rows[0][1][0]
    print(f"probe step on {n} x {d} features, {c} classes, float32, "
          f"{jax.devices()[0].platform} x{jax.device_count()}, median of {args.repeats}")
    print(f"{'step':40s} {'median s':>10s} {'min s':>8s} {'x non-private':>14s}")
    for name, (median, times) in rows:
        print(f"{name:40s} {median:10.4f} {min(times):8.4f} {median / base:14.2f}")
    closed, vmapped = rows[1][1][0], rows[2][1][0]
    print(f"closed-form vs vmap(grad) speedup: {vmapped / closed:.1f}x; "
          f"both DP steps privatize the same gradient: {agree}")


if __name__ == "__main__":
    main()
