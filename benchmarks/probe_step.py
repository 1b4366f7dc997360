"""One full-batch DP probe step on 50k x 768 features, 10 classes, side by side with Opacus.

  non-private      jax.grad of the mean softmax loss + Adam, in a jitted loop (the floor)
  dpprobe API      `probe.train_probe` (public API), one DP-Adam run: the cost of one more
                   step, (time(T = 1 + K) - time(T = 1)) / K, and the whole T = 1 call
  dpprobe step     one jitted step from `probe.clipped_grad_sum` + `dp.gaussian_noise` +
                   `dp.make_optimizer` (the only internals used, all in `internal_rows`)
  vmap(grad)       per-example gradients by jax.vmap(jax.grad), clipped, summed, noised + Adam
  Opacus           one full-batch DP-Adam step of a private nn.Linear, per-sample gradients
                   (grad_sample_mode="hooks") and ghost clipping ("ghost": per-example norms
                   of a linear layer in closed form, two backward passes)
and the noise alone: dpprobe's float64 sampler vs float32 `jax.random.normal`.

Prints median wall times over repeats, ratios to the non-private step and to both Opacus
modes, and one line per acceptance target (issue 11).
Run: .venv/bin/python benchmarks/probe_step.py [--n 50000 --d 768 --classes 10 --repeats 7]
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import time

import _path  # noqa: F401 - first: keeps this folder off the import path
import jax
import jax.numpy as jnp
import numpy as np
import optax

SIGMA, CLIP, LR = 2.0, 1.0, 1e-3


def _time(fn, repeats, block=jax.block_until_ready):
    """(median, all times) of `fn()` over `repeats` calls, after one warm-up call."""
    block(fn())  # compile + warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        block(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def _marginal(run, extra_steps, repeats):
    """Per-step cost of `run(steps)`: (median t(1 + K) - median t(1)) / K, interleaved."""
    run(1), run(1 + extra_steps)  # compile + warm up
    short, long = [], []
    for _ in range(repeats):
        for steps, times in ((1, short), (1 + extra_steps, long)):
            start = time.perf_counter()
            run(steps)
            times.append(time.perf_counter() - start)
    per_step = (statistics.median(long) - statistics.median(short)) / extra_steps
    per_step_min = (min(long) - min(short)) / extra_steps
    return per_step, per_step_min, short


def _softmax_loss(logits, onehot):
    return -jnp.sum(onehot * jax.nn.log_softmax(logits), axis=-1)


def non_private_steps(features, onehot, params, extra_steps, repeats):
    """The floor: full-batch jax.grad + Adam in a jitted loop; per-step cost and one call."""
    tx = optax.adam(LR)
    state = tx.init(params)

    def mean_loss(p):
        return jnp.mean(_softmax_loss(features @ p["w"] + p["b"], onehot))

    def step(carry):
        p, s = carry
        updates, s = tx.update(jax.grad(mean_loss)(p), s, p)
        return optax.apply_updates(p, updates), s

    loop = jax.jit(lambda p, s, n: jax.lax.fori_loop(0, n, lambda _, c: step(c), (p, s)))
    one = jax.jit(lambda p, s: step((p, s)))
    per_step, per_step_min, _ = _marginal(
        lambda steps: jax.block_until_ready(loop(params, state, steps)), extra_steps, repeats)
    return (per_step, per_step_min), _time(lambda: one(params, state), repeats)


def api_steps(features, labels, classes, extra_steps, repeats):
    """dpprobe through its public API: one DP-Adam run of `probe.train_probe`."""
    from dpprobe import accounting, dp, probe

    spec = probe.ProbeSpec(classes, optimizer="adam")
    keys = dp.make_keys(1)

    def run(steps):
        runs = [probe.RunSpec(accounting.DpPlan(SIGMA, steps, clip_norm=CLIP), LR)]
        return probe.train_probe(features, labels, runs, keys, spec)

    per_step, per_step_min, whole = _marginal(run, extra_steps, repeats)
    return (per_step, per_step_min), (statistics.median(whole), whole)


def internal_rows(features, onehot, params, key, repeats):
    """The only use of dpprobe internals: one jitted DP step built from `probe.clipped_grad_sum`,
    `dp.gaussian_noise` and `dp.make_optimizer`, and the noise alone. Returns
    (rows, noise-free clipped sums) for the agreement check with vmap(grad)."""
    from dpprobe import dp, probe

    n = features.shape[0]
    tx = dp.make_optimizer("adam", LR)
    state = tx.init(params)
    size = params["w"].size + params["b"].size
    # As in the trainers, where the features are checked once per program.
    kwargs = {"loss": "softmax"}
    if "finite_rows" in inspect.signature(probe.clipped_grad_sum).parameters:
        kwargs["finite_rows"] = True

    def clipped_sums(params):
        stacked = jax.tree.map(lambda p: p[None], params)
        sums, _ = probe.clipped_grad_sum(stacked, features, onehot, jnp.array([CLIP]), **kwargs)
        return jax.tree.map(lambda s: s[0], sums)

    @jax.jit
    def dp_step(params, state, key):
        sums = clipped_sums(params)
        noise = dp.gaussian_noise(key, size)
        grads = {"w": (sums["w"] + SIGMA * CLIP * noise[: sums["w"].size].reshape(
                     sums["w"].shape)) / n,
                 "b": (sums["b"] + SIGMA * CLIP * noise[sums["w"].size:]) / n}
        updates, state = tx.update(grads, state, params)
        return jax.tree.map(lambda p, u: p + u, params, updates), state

    noise = jax.jit(lambda key: dp.gaussian_noise(key, size))
    rows = [("DP step, one jitted call (probe internals)",
             _time(lambda: dp_step(params, state, key), repeats)),
            ("noise only: float64 sampler (dpprobe)", _time(lambda: noise(key), repeats))]
    return rows, jax.jit(clipped_sums)(params)


def vmap_grad_rows(features, onehot, params, key, repeats):
    """Per-example gradients by jax.vmap(jax.grad), clipped, summed, noised + Adam."""
    n = features.shape[0]
    tx = optax.adam(LR)
    state = tx.init(params)

    def example_loss(params, x, y):
        return _softmax_loss(x @ params["w"] + params["b"], y)

    def clipped_sums(params):
        per_example = jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0))(params, features,
                                                                            onehot)
        norms = jnp.sqrt(jnp.sum(per_example["w"] ** 2, axis=(1, 2))
                         + jnp.sum(per_example["b"] ** 2, axis=1))
        scale = jnp.minimum(1.0, CLIP / norms)
        return {"w": jnp.einsum("n,ndc->dc", scale, per_example["w"]),
                "b": jnp.einsum("n,nc->c", scale, per_example["b"])}

    @jax.jit
    def dp_step(params, state, key):
        sums = clipped_sums(params)
        keys = jax.random.split(key)
        grads = {k: (sums[k] + SIGMA * CLIP * jax.random.normal(keys[i], sums[k].shape)) / n
                 for i, k in enumerate(("w", "b"))}
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    size = params["w"].size + params["b"].size
    noise = jax.jit(lambda key: jax.random.normal(key, (size,)))
    rows = [("DP step, vmap(grad) clipping (one call)",
             _time(lambda: dp_step(params, state, key), repeats)),
            ("noise only: float32 jax.random.normal", _time(lambda: noise(key), repeats))]
    return rows, jax.jit(clipped_sums)(params)


def opacus_step(features, labels, classes, mode, repeats):
    """One full-batch DP-Adam step of Opacus on a private nn.Linear (data already in tensors,
    no data loader): zero_grad, forward, backward (two passes in ghost mode), step."""
    import warnings

    import torch
    from opacus import PrivacyEngine

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    x = torch.from_numpy(np.asarray(features, np.float32))
    y = torch.from_numpy(np.asarray(labels, np.int64))
    model = torch.nn.Linear(x.shape[1], classes)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                         batch_size=len(x))
    criterion = torch.nn.CrossEntropyLoss()
    private = PrivacyEngine(accountant="prv").make_private(
        module=model, optimizer=opt, criterion=criterion, data_loader=loader,
        noise_multiplier=SIGMA, max_grad_norm=CLIP, poisson_sampling=False,
        grad_sample_mode=mode)
    if mode == "ghost":
        model, opt, criterion, _ = private
    else:
        model, opt, _ = private

    def step():
        opt.zero_grad()
        criterion(model(x), y).backward()
        opt.step()

    return _time(step, repeats, block=lambda _: None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=50_000)
    parser.add_argument("--d", type=int, default=768)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--extra-steps", type=int, default=20,
                        help="K: the per-step cost is (t(T = 1 + K) - t(T = 1)) / K")
    parser.add_argument("--opacus-repeats", type=int, default=3)
    parser.add_argument("--skip-opacus", action="store_true")
    parser.add_argument("--skip-vmap", action="store_true", help="skip the vmap(grad) step")
    args = parser.parse_args()
    n, d, c, repeats = args.n, args.d, args.classes, args.repeats

    rng = np.random.default_rng(0)
    features_np = rng.normal(size=(n, d)).astype(np.float32)
    labels_np = rng.integers(0, c, size=n)
    features = jnp.asarray(features_np)
    onehot = jax.nn.one_hot(labels_np, c)
    params = {"w": jnp.asarray(rng.normal(size=(d, c)).astype(np.float32) * 0.01),
              "b": jnp.zeros((c,), jnp.float32)}
    key = jax.random.key(0)

    (plain, plain_min), plain_call = non_private_steps(features, onehot, params,
                                                       args.extra_steps, repeats)
    (api, api_min), api_whole = api_steps(features_np, labels_np, c, args.extra_steps, repeats)
    rows = [("non-private step (jax.grad + Adam, in a loop)", (plain, [plain_min])),
            ("DP step, dpprobe public API (train_probe)", (api, [api_min])),
            ("  whole train_probe call, T = 1", api_whole),
            ("non-private step, one jitted call", plain_call)]
    internal, ours_sums = None, None
    try:
        internal, ours_sums = internal_rows(features, onehot, params, key, repeats)
        rows[3:3] = internal[:1]
    except (AttributeError, TypeError, ValueError) as error:  # internals renamed or changed
        print(f"skipped the step from probe internals: {type(error).__name__}: {error}")
    vmap_sums = None
    if not args.skip_vmap:
        vmap, vmap_sums = vmap_grad_rows(features, onehot, params, key, repeats)
        rows.append(vmap[0])
    opacus = {}
    if not args.skip_opacus:
        for mode, label in (("hooks", "per-sample"), ("ghost", "ghost clipping")):
            opacus[mode] = opacus_step(features_np, labels_np, c, mode, args.opacus_repeats)
            rows.append((f"Opacus DP step, {label} ({mode})", opacus[mode]))
    if internal:
        rows.append(internal[1])
    if not args.skip_vmap:
        rows.append(vmap[1])

    print(f"\nprobe step on {n} x {d} features, {c} classes, float32, DP-Adam (sigma {SIGMA}, "
          f"C {CLIP}); {jax.devices()[0].platform} x{jax.device_count()}, {os.cpu_count()} "
          f"cores, load average {os.getloadavg()[1]:.1f} (5 min); median of {repeats} "
          f"(Opacus {args.opacus_repeats}); per-step rows "
          f"(loop, API): (t(T = 1 + {args.extra_steps}) - t(T = 1)) / {args.extra_steps}")
    print(f"{'step':48s} {'median s':>10s} {'min s':>8s} {'x non-private':>14s}")
    for name, (median, times) in rows:
        print(f"{name:48s} {median:10.4f} {min(times):8.4f} {median / plain:14.2f}")
    if ours_sums is not None and vmap_sums is not None:
        agree = all(bool(np.allclose(ours_sums[k], vmap_sums[k], rtol=1e-4, atol=1e-3))
                    for k in ("w", "b"))
        print(f"closed-form and vmap(grad) clipped sums agree: {agree}")

    print("\nratios (same run)")
    print(f"  DP step (train_probe) / non-private step:            {api / plain:6.2f}x")
    if internal:
        dp_call = internal[0][1][0]
        print(f"  DP step (one jitted call) / non-private jitted call: "
              f"{dp_call / plain_call[0]:6.2f}x")
    for mode, (median, _) in opacus.items():
        print(f"  Opacus {mode:5s} step / dpprobe DP step (train_probe):  {median / api:6.1f}x")
    print("\nacceptance (issue 11)")
    print(f"  {'target':52s} {'value':>8s} {'goal':>8s}  met")
    ratio = api / plain
    print(f"  {'DP step / non-private step (train_probe)':52s} {ratio:7.2f}x {'<= 1.0x':>8s}  "
          f"{'yes' if ratio <= 1.0 else 'no'}")
    if internal:
        ratio = internal[0][1][0] / plain_call[0]
        print(f"  {'DP step / non-private step (one jitted call)':52s} {ratio:7.2f}x "
              f"{'<= 1.0x':>8s}  {'yes' if ratio <= 1.0 else 'no'}")


if __name__ == "__main__":
    main()
