"""Probe sweeps side by side: dpprobe vs Opacus, DP vs non-private, and an ImageNet-shaped
out-of-core run.

On 50k x 768 features, 10 classes, stored in Zarr (float16):
  1. 8 epsilons x 5 seeds, single-step DP-Adam: wall time from `dpprobe probe` start to
     results.json (cold and warm JAX compilation cache), and the same sweep in-process;
  2. the same 40 runs with Opacus (a DP nn.Linear, full batch: Poisson sampling with q = 1);
  3. T = 100 full-batch DP-SGD momentum steps, one run, dpprobe vs Opacus;
  4. one DP step vs one non-private full-batch step (dpprobe's jitted steps);
  5. ImageNet-shaped (1.28M x 1280 float16, 1000 classes) streamed out of core from Zarr:
     time per step and peak memory (a child process, so its peak RSS is its own).

Run: .venv/bin/python benchmarks/probe_sweep.py [--workdir /tmp/dpprobe-bench] [--skip-imagenet]
Medians over --repeats; this machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _path  # noqa: F401 - first: keeps this folder off the import path
import numpy as np

EPSILONS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, math.inf)
SEEDS = 5
DELTA = 1e-5


def make_store(path: Path, num_train: int, num_test: int, dim: int, classes: int,
               seed: int = 0) -> None:
    """A synthetic linearly-structured feature store (float16), written chunk by chunk."""
    import extract

    if (path / "zarr.json").exists():
        try:
            extract.open_split(str(path), "train"), extract.open_split(str(path), "test")
            return
        except Exception:  # incomplete or stale: rebuild
            shutil.rmtree(path)
    rng = np.random.default_rng(seed)
    weights = rng.normal(size=(dim, classes)).astype(np.float32) / math.sqrt(dim)
    for split, rows in (("train", num_train), ("test", num_test)):
        writer = extract.SplitWriter(
            str(path), split, num_rows=rows, feature_shape=(dim,), dtype="float16",
            provenance={"backbone": {"name": "synthetic"},
                        "dataset": {"name": f"synthetic-{dim}", "num_classes": classes}},
        )
        for chunk in writer.pending_chunks():
            start, stop = writer.chunk_rows(chunk)
            x = rng.normal(size=(stop - start, dim)).astype(np.float32)
            logits = x @ weights + 0.5 * rng.normal(size=(stop - start, classes))
            writer.write_chunk(chunk, x, logits.argmax(1))
        writer.finalize()


def time_cli(store: Path, out: Path, cache: Path, extra=()) -> float:
    env = dict(os.environ, XDG_CACHE_HOME=str(cache), HF_HUB_OFFLINE="1")
    cmd = [str(Path(sys.executable).parent / "dpprobe"), "probe", str(store),
           "--epsilons", ",".join(f"{e:g}" for e in EPSILONS), "--delta", f"{DELTA:g}",
           "--seeds", str(SEEDS), "--optimizer", "adam", "--steps", "1", "--out", str(out),
           "--quiet", *extra]
    out.unlink(missing_ok=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    elapsed = time.perf_counter() - start
    assert out.exists()
    return elapsed


def ours_in_process(store: Path, optimizer: str, steps: int, lr: float, epsilons, seeds,
                    repeats: int) -> tuple[float, dict]:
    from pipelines import run_probe

    kwargs = dict(epsilons=epsilons, delta=DELTA, seeds=seeds, optimizer=optimizer,
                  steps=(steps,), learning_rates=(lr,), quiet=True, stream=False)
    run_probe(str(store), **kwargs)  # compile
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run_probe(str(store), **kwargs)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def opacus_runs(store: Path, runs, optimizer: str, steps: int, lr: float) -> tuple[float, list]:
    """Each run: a fresh zero-init nn.Linear made private by Opacus, full batch (q = 1)."""
    import warnings

    import torch
    from opacus import PrivacyEngine

    import extract

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    x, y, _ = extract.load_split(str(store), "train")
    xt, yt, _ = extract.load_split(str(store), "test")
    x, y = torch.from_numpy(x), torch.from_numpy(y.astype(np.int64))
    xt, yt = torch.from_numpy(xt), torch.from_numpy(yt.astype(np.int64))
    dataset = torch.utils.data.TensorDataset(x, y)
    accuracies = []
    start = time.perf_counter()
    for sigma in runs:
        model = torch.nn.Linear(x.shape[1], int(y.max()) + 1)
        torch.nn.init.zeros_(model.weight)
        torch.nn.init.zeros_(model.bias)
        if optimizer == "adam":
            opt = torch.optim.Adam(model.parameters(), lr=lr)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        loader = torch.utils.data.DataLoader(dataset, batch_size=len(dataset))
        engine = PrivacyEngine(accountant="prv")
        model, opt, loader = engine.make_private(
            module=model, optimizer=opt, data_loader=loader, noise_multiplier=sigma,
            max_grad_norm=1.0 if sigma > 0 else 1e12, poisson_sampling=True,
        )
        loss_fn = torch.nn.CrossEntropyLoss()
        done = 0
        while done < steps:
            for xb, yb in loader:  # sample rate 1: every example, one batch per epoch
                opt.zero_grad()
                loss_fn(model(xb), yb).backward()
                opt.step()
                done += 1
                if done == steps:
                    break
        with torch.no_grad():
            accuracies.append(float((model(xt).argmax(1) == yt).float().mean()))
    return time.perf_counter() - start, accuracies


def step_ratio(repeats: int) -> tuple[float, float]:
    """Median time of one DP step (ours) and one non-private full-batch step, 50k x 768."""
    import jax
    import jax.numpy as jnp
    import optax

    import probe

    rng = np.random.default_rng(0)
    n, d, c = 50_000, 768, 10
    x = jnp.asarray(rng.normal(size=(n, d)).astype(np.float32))
    onehot = jax.nn.one_hot(rng.integers(0, c, size=n), c)
    tx = optax.adam(1e-3)
    params = {"w": jnp.zeros((d, c)), "b": jnp.zeros((c,))}
    state = tx.init(params)

    @jax.jit
    def dp(params, state, key):
        stacked = jax.tree.map(lambda p: p[None], params)
        sums, _ = probe.clipped_grad_sum(stacked, x, onehot, jnp.ones(1), loss="softmax")
        grads = jax.tree.map(lambda s: s[0], probe.noisy_mean(sums, jnp.ones(1), key[None], 0, n))
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    @jax.jit
    def plain(params, state):
        grads = jax.grad(lambda p: jnp.mean(
            probe.example_losses(x @ p["w"] + p["b"], onehot, "softmax")))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    key = jax.random.key(0)

    def median(fn):
        jax.block_until_ready(fn())
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return median(lambda: dp(params, state, key)), median(lambda: plain(params, state))


IMAGENET_CHILD = """
import json, sys, time, numpy as np
import accounting, extract, probe
store, steps = sys.argv[1], int(sys.argv[2])
attrs = extract.split_attrs(store, "train")
sigma = accounting.calibrate_noise_multiplier(8.0, 1e-6, steps=steps)
runs = [probe.RunSpec(accounting.DpPlan(sigma, steps, clip_norm=1.0), 1e-3)]
spec = probe.ProbeSpec(1000, optimizer="adam")
times = []
start = time.perf_counter()
result = probe.train_probe_streaming(
    lambda: extract.iter_split_chunks(store, "train", dtype=None), runs, probe.make_keys(1),
    spec, num_examples=attrs["num_examples"], dim=attrs["feature_dim"])
total = time.perf_counter() - start
# VmHWM: this process's own peak RSS (ru_maxrss would include the parent's at fork time).
with open("/proc/self/status") as status:
    peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
print(json.dumps({"seconds": total, "steps": steps, "peak_rss_bytes": peak,
                  "finite": bool(np.isfinite(result.params["w"]).all())}))
"""


def imagenet(workdir: Path, steps: int) -> dict:
    store = workdir / "imagenet-shaped.zarr"
    start = time.perf_counter()
    make_store(store, 1_281_167, 1000, 1280, 1000, seed=1)
    build = time.perf_counter() - start
    du = sum(f.stat().st_size for f in (store / "train").rglob("*") if f.is_file())
    child = subprocess.run([sys.executable, "-c", IMAGENET_CHILD, str(store), str(steps)],
                           check=True, capture_output=True, text=True,
                           env=dict(os.environ, HF_HUB_OFFLINE="1"))
    report = json.loads(child.stdout.strip().splitlines()[-1])
    report |= {"store_bytes": du, "build_seconds": build}
    return report


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/dpprobe-bench")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-opacus", action="store_true")
    parser.add_argument("--skip-imagenet", action="store_true")
    parser.add_argument("--imagenet-steps", type=int, default=2)
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    store = workdir / "synthetic-50k-768.zarr"
    make_store(store, 50_000, 10_000, 768, 10)
    import accounting

    rows = []

    # 1. The sweep through the CLI: cold cache once, then warm.
    cold_cache = workdir / "jax-cache-cold"
    shutil.rmtree(cold_cache, ignore_errors=True)
    cold = time_cli(store, workdir / "results.json", cold_cache)
    warm = statistics.median(time_cli(store, workdir / "results.json", cold_cache)
                             for _ in range(args.repeats))
    sweep_api, sweep_result = ours_in_process(store, "adam", 1, 1e-3, EPSILONS, SEEDS,
                                              args.repeats)
    rows.append(("1. sweep 8 eps x 5 seeds, DP-Adam T=1", "dpprobe CLI, cold compile", cold))
    rows.append(("", "dpprobe CLI, warm compile cache", warm))
    rows.append(("", "dpprobe Python API (in process)", sweep_api))

    sigmas = [accounting.calibrate_noise_multiplier(e, DELTA) for e in EPSILONS
              for _ in range(SEEDS)]
    if not args.skip_opacus:
        opacus_sweep, opacus_acc = opacus_runs(store, sigmas, "adam", 1, 1e-3)
        rows.append(("2. same 40 runs", "Opacus (nn.Linear, Poisson q=1)", opacus_sweep))

    # 3. T = 100 momentum steps, one run at epsilon = 1.
    sigma100 = accounting.calibrate_noise_multiplier(1.0, DELTA, steps=100)
    t100_ours, _ = ours_in_process(store, "momentum", 100, 0.1, (1.0,), 1,
                                   max(1, args.repeats // 2))
    rows.append(("3. T=100 momentum, 1 run", "dpprobe Python API", t100_ours))
    if not args.skip_opacus:
        t100_opacus, _ = opacus_runs(store, [sigma100], "momentum", 100, 0.1)
        rows.append(("", "Opacus", t100_opacus))

    # 4. DP vs non-private step.
    dp_step, plain_step = step_ratio(max(7, args.repeats))
    rows.append(("4. one step, 50k x 768", "DP step (closed-form clip + noise + Adam)", dp_step))
    rows.append(("", "non-private full-batch step (+ Adam)", plain_step))

    print(f"\n50k x 768 float16 features in Zarr, 10 classes, delta={DELTA:g}; "
          f"medians of {args.repeats}; CPU, {os.cpu_count()} cores")
    print(f"{'benchmark':40s} {'system':45s} {'seconds':>9s}")
    for bench, system, seconds in rows:
        print(f"{bench:40s} {system:45s} {seconds:9.3f}")
    print()
    if not args.skip_opacus:
        print(f"(1) vs (2): Opacus / dpprobe CLI warm = {opacus_sweep / warm:.1f}x, "
              f"Opacus / dpprobe API = {opacus_sweep / sweep_api:.1f}x, "
              f"Opacus / dpprobe CLI cold = {opacus_sweep / cold:.1f}x")
        print(f"(3): Opacus / dpprobe = {t100_opacus / t100_ours:.1f}x")
        ours_acc = [r["test_accuracy"] for r in sweep_result["runs"]]
        print(f"accuracy check, mean over the 40 runs: dpprobe {np.mean(ours_acc):.4f}, "
              f"Opacus {np.mean(opacus_acc):.4f}")
    print(f"(4): DP step / non-private step = {dp_step / plain_step:.2f}x")

    if not args.skip_imagenet:
        report = imagenet(workdir, args.imagenet_steps)
        per_step = report["seconds"] / report["steps"]
        print(f"\n5. ImageNet-shaped, streamed out of core: 1,281,167 x 1280 float16 "
              f"({report['store_bytes'] / 2**30:.2f} GiB on disk), 1000 classes, DP-Adam")
        print(f"   {report['steps']} steps in {report['seconds']:.1f} s = {per_step:.1f} s/step; "
              f"peak RSS {report['peak_rss_bytes'] / 2**30:.2f} GiB "
              f"(features as float32 in memory would be {1_281_167 * 1280 * 4 / 2**30:.1f} GiB)")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"benchmark process peak RSS: {peak:.2f} GiB")


if __name__ == "__main__":
    main()
