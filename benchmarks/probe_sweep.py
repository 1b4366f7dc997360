"""Probe sweeps side by side: dpprobe vs Opacus (per-sample and ghost clipping), DP vs
non-private, and an ImageNet-shaped out-of-core run.

On 50k x 768 features, 10 classes, stored in Zarr (float16):
  1. 8 epsilons x 5 seeds, single-step DP-Adam: wall time from `dpprobe probe` start to
     results.json (cold and warm caches), and the same sweep in process: `pipelines.run_probe`
     (store to results, as the CLI) and `probe.train_probe` (features in memory, training only);
     and a new process that only imports JAX and optax: with `train_probe`'s time, the least
     any sweep run as a new process can take here, so the ratio to Opacus it cannot pass;
  2. the same 40 runs with Opacus, a private nn.Linear, full batch (Poisson sampling, q = 1),
     in both of its modes: per-sample gradients (grad_sample_mode="hooks") and ghost clipping
     ("ghost": a linear layer's per-example norms in closed form, two backward passes);
  3. T = 100 full-batch DP-SGD momentum steps, one run: dpprobe (API and CLI) vs both Opacus modes;
  4. one DP step vs one non-private full-batch step, per step (`probe_step.py`'s measurement
     through `probe.train_probe`);
  5. ImageNet-shaped (1.28M x 1280 float16, 1000 classes) streamed out of core from Zarr:
     time per step and peak memory (a child process, so its peak RSS is its own).
  6. where the CLI sweep's time goes, phase by phase (`sweep_profile.py`).
Ends with one line per acceptance target (value, target, met).

dpprobe is used through its public API only: the CLI, `pipelines.run_probe`, `probe.train_probe`
/ `RunSpec` / `ProbeSpec` / `make_keys`, `accounting.DpPlan` / `calibrate_noise_multiplier`, and
`extract`'s store reader and writer.
Run: .venv/bin/python benchmarks/probe_sweep.py [--workdir /tmp/dpprobe-bench] [--skip-imagenet]
[--skip-t100] [--opacus-repeats 3]
Medians over --repeats (Opacus: medians over --opacus-repeats passes of the 40-run sweep, one
pass of T = 100; a pass takes minutes); this machine is shared and noisy. CPU seconds (user +
sys) of the CLI's children are reported beside their wall time.
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

import _path  # first: keeps this folder off the import path
import numpy as np

EPSILONS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, math.inf)
SEEDS = 5
DELTA = 1e-5
OPACUS_MODES = {"hooks": "per-sample", "ghost": "ghost clipping"}


def make_store(path: Path, num_train: int, num_test: int, dim: int, classes: int,
               seed: int = 0) -> None:
    """A synthetic linearly-structured feature store (float16), written chunk by chunk."""
    from dpprobe import extract

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


def cli_env(cache: Path) -> dict[str, str]:
    """A CLI child's environment: its caches under `cache`, JAX's compilation cache and stored
    programs (XDG_CACHE_HOME) and Python's bytecode cache (PYTHONPYCACHEPREFIX), so that "cold"
    (a fresh `cache`) and "warm" are both caches' states. An installed dpprobe has its bytecode
    compiled; PYTHONDONTWRITEBYTECODE=1 (set on this project's VMs) would make every child
    compile dpprobe's ~95 modules from source (0.09 s of the CLI's 0.23 s import, 2-core VM)."""
    env = dict(os.environ, XDG_CACHE_HOME=str(cache), HF_HUB_OFFLINE="1",
               PYTHONPYCACHEPREFIX=str(cache / "python"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def time_cli(store: Path, out: Path, cache: Path, *, epsilons=EPSILONS, seeds=SEEDS,
             optimizer="adam", steps=1, lr=None) -> float:
    """Seconds from `dpprobe probe` start to its results.json."""
    env = cli_env(cache)
    cmd = [str(Path(sys.executable).parent / "dpprobe"), "probe", str(store),
           "--epsilons", ",".join(f"{e:g}" for e in epsilons), "--delta", f"{DELTA:g}",
           "--seeds", str(seeds), "--optimizer", optimizer, "--steps", str(steps),
           "--out", str(out), "--quiet"]
    if lr is not None:
        cmd += ["--lr", f"{lr:g}"]
    out.unlink(missing_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    CLI_CPU.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    assert out.exists()
    return elapsed


CLI_CPU: list[float] = []  # CPU seconds of each `time_cli` child, in call order


def import_floor(cache: Path, repeats: int) -> float:
    """Median seconds of a fresh process that only imports JAX and optax (the CLI's
    environment): with the training alone (`train_probe` in memory) added, the least any sweep
    run as a new process can take here, whatever the rest of the CLI does."""
    env = cli_env(cache)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import jax, optax"], check=True, env=env)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_probe_in_process(store: Path, optimizer: str, steps: int, lr: float, epsilons, seeds,
                         repeats: int) -> tuple[float, dict]:
    """`pipelines.run_probe` (store to results, what the CLI runs), after one warm-up call."""
    from dpprobe.pipelines import run_probe

    kwargs = dict(epsilons=epsilons, delta=DELTA, seeds=seeds, optimizer=optimizer,
                  steps=(steps,), learning_rates=(lr,), quiet=True, stream=False)
    run_probe(str(store), **kwargs)  # compile
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run_probe(str(store), **kwargs)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def train_probe_in_memory(data, sigmas, optimizer: str, steps: int, lr: float,
                          repeats: int) -> tuple[float, float]:
    """`probe.train_probe` on features already in memory, all runs in one program (training
    only, like `opacus_runs` minus its evaluation); (median seconds, mean test accuracy)."""
    from dpprobe import accounting, dp, probe

    x, y, xt, yt = data
    spec = probe.ProbeSpec(int(y.max()) + 1, optimizer=optimizer)
    runs = [probe.RunSpec(accounting.DpPlan(s, steps, clip_norm=1.0), lr) for s in sigmas]

    def train():
        return probe.train_probe(x, y, runs, dp.make_keys(len(runs)), spec)

    train()  # compile
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = train()
        times.append(time.perf_counter() - start)
    logits = np.einsum("nd,pdc->pnc", xt, result.params["w"]) + result.params["b"][:, None]
    return statistics.median(times), float(np.mean(logits.argmax(-1) == yt[None]))


def opacus_runs(data, runs, optimizer: str, steps: int, lr: float,
                mode: str, device: str = "cpu") -> tuple[float, list]:
    """Each run: a fresh zero-init nn.Linear made private by Opacus, full batch (Poisson sampling
    with q = 1, Opacus's DP data loader), in `grad_sample_mode` `mode` ("hooks": per-sample
    gradients; "ghost": ghost clipping, whose criterion wrapper runs two backward passes), on
    torch device `device` (the loader's batches are copied there, as a real loader's are; the
    clock waits for a GPU)."""
    import warnings

    import torch
    from opacus import PrivacyEngine

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    x, y, xt, yt = (torch.from_numpy(np.asarray(a)) for a in data)
    y, yt = y.long(), yt.long()
    dataset = torch.utils.data.TensorDataset(x, y)
    accuracies = []
    start = time.perf_counter()
    for sigma in runs:
        model = torch.nn.Linear(x.shape[1], int(y.max()) + 1).to(device)
        torch.nn.init.zeros_(model.weight)
        torch.nn.init.zeros_(model.bias)
        if optimizer == "adam":
            opt = torch.optim.Adam(model.parameters(), lr=lr)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        loader = torch.utils.data.DataLoader(dataset, batch_size=len(dataset))
        criterion = torch.nn.CrossEntropyLoss()
        private = PrivacyEngine(accountant="prv").make_private(
            module=model, optimizer=opt, criterion=criterion, data_loader=loader,
            noise_multiplier=sigma, max_grad_norm=1.0 if sigma > 0 else 1e12,
            poisson_sampling=True, grad_sample_mode=mode,
        )
        if mode == "ghost":  # (module, optimizer, criterion wrapper, loader)
            model, opt, criterion, loader = private
        else:
            model, opt, loader = private
        done = 0
        while done < steps:
            for xb, yb in loader:  # sample rate 1: every example, one batch per epoch
                xb, yb = xb.to(device), yb.to(device)
                opt.zero_grad()
                criterion(model(xb), yb).backward()
                opt.step()
                done += 1
                if done == steps:
                    break
        with torch.no_grad():
            predicted = model(xt.to(device)).argmax(1).cpu()
            accuracies.append(float((predicted == yt).float().mean()))
    return time.perf_counter() - start, accuracies


def step_ratio(repeats: int, extra_steps: int = 20) -> tuple[float, float]:
    """Per-step time of a DP step through `probe.train_probe` and of a non-private full-batch
    step (jax.grad + Adam), 50k x 768, 10 classes: `probe_step.py`'s measurement."""
    import jax
    import jax.numpy as jnp

    step = _path.load_benchmark("probe_step")
    rng = np.random.default_rng(0)
    n, d, c = 50_000, 768, 10
    x = rng.normal(size=(n, d)).astype(np.float32)
    labels = rng.integers(0, c, size=n)
    params = {"w": jnp.zeros((d, c)), "b": jnp.zeros((c,))}
    (plain, _), _ = step.non_private_steps(jnp.asarray(x), jax.nn.one_hot(labels, c), params,
                                           extra_steps, repeats)
    (dp, _), _ = step.api_steps(x, labels, c, extra_steps, repeats)
    return dp, plain


IMAGENET_CHILD = """
import json, sys, time, numpy as np
from dpprobe import accounting, dp, extract, probe
store, steps = sys.argv[1], int(sys.argv[2])
attrs = extract.split_attrs(store, "train")
sigma = accounting.calibrate_noise_multiplier(8.0, 1e-6, steps=steps)
runs = [probe.RunSpec(accounting.DpPlan(sigma, steps, clip_norm=1.0), 1e-3)]
spec = probe.ProbeSpec(1000, optimizer="adam")
times = []
start = time.perf_counter()
result = probe.train_probe_streaming(
    lambda: extract.iter_split_chunks(store, "train", dtype=None), runs, dp.make_keys(1),
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


def t100_section(args, store, data, cache, modes, rows, half):
    """T = 100 full-batch momentum steps, one run at epsilon 1: dpprobe (API, CLI), Opacus."""
    from dpprobe import accounting

    sigma100 = accounting.calibrate_noise_multiplier(1.0, DELTA, steps=100)
    t100 = dict(epsilons=(1.0,), seeds=1, optimizer="momentum", steps=100, lr=0.1)
    try:
        t100_api, _ = run_probe_in_process(store, "momentum", 100, 0.1, (1.0,), 1, half)
        rows.append(("3. T=100 momentum, 1 run", "dpprobe pipelines.run_probe", t100_api))
    except (ImportError, TypeError, KeyError) as error:
        t100_api = None
        print(f"skipped pipelines.run_probe: {type(error).__name__}: {error}")
    t100_train, _ = train_probe_in_memory(data, [sigma100], "momentum", 100, 0.1, half)
    rows.append(("3. T=100 momentum, 1 run" if t100_api is None else "",
                 "dpprobe probe.train_probe (in memory)", t100_train))
    out = Path(args.workdir) / "results-t100.json"
    time_cli(store, out, cache, **t100)  # warm its caches
    t100_cli = statistics.median(time_cli(store, out, cache, **t100) for _ in range(half))
    rows.append(("", "dpprobe CLI, warm caches", t100_cli))
    opacus_t100 = {}
    for mode in modes:
        opacus_t100[mode], _ = opacus_runs(data, [sigma100], "momentum", 100, 0.1, mode)
        rows.append(("", f"Opacus {OPACUS_MODES[mode]} ({mode})", opacus_t100[mode]))
    return t100_api, t100_train, t100_cli, opacus_t100


def _target(name: str, value: float | None, goal: str, met) -> None:
    if value is None:
        print(f"  {name:58s} {'n/a':>9s} {goal:>9s}  n/a")
        return
    unit = "x" if goal.endswith("x") else "s"
    print(f"  {name:58s} {value:7.2f} {unit} {goal:>9s}  {'yes' if met(value) else 'no'}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/dpprobe-bench",
                        help="stores, results and the CLI's caches go here")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-opacus", action="store_true")
    parser.add_argument("--opacus-modes", default="hooks,ghost",
                        help="comma-separated Opacus grad_sample_modes (default hooks,ghost)")
    parser.add_argument("--skip-imagenet", action="store_true")
    parser.add_argument("--imagenet-steps", type=int, default=2)
    parser.add_argument("--skip-t100", action="store_true", help="skip the T = 100 section")
    parser.add_argument("--opacus-repeats", type=int, default=1,
                        help="passes of Opacus's 40-run sweep per mode (median)")
    parser.add_argument("--skip-profile", action="store_true",
                        help="skip the phase-by-phase profile of the CLI sweep")
    args = parser.parse_args()
    modes = [] if args.skip_opacus else [m for m in args.opacus_modes.split(",") if m]
    for mode in modes:
        if mode not in OPACUS_MODES:
            parser.error(f"--opacus-modes: {mode!r} is not one of {sorted(OPACUS_MODES)}")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    store = workdir / "synthetic-50k-768.zarr"
    make_store(store, 50_000, 10_000, 768, 10)
    from dpprobe import accounting, extract

    x, y, _ = extract.load_split(str(store), "train")
    xt, yt, _ = extract.load_split(str(store), "test")
    data = (x, y.astype(np.int64), xt, yt.astype(np.int64))
    rows, acc = [], {}
    half = max(1, args.repeats // 2)

    # 1. The sweep through the CLI: cold cache once, then warm; then in process.
    cache = workdir / "jax-cache-cold"
    shutil.rmtree(cache, ignore_errors=True)
    cold = time_cli(store, workdir / "results.json", cache)
    warm = statistics.median(time_cli(store, workdir / "results.json", cache)
                             for _ in range(args.repeats))
    warm_cpu = statistics.median(CLI_CPU[1:])
    rows.append(("1. sweep 8 eps x 5 seeds, DP-Adam T=1", "dpprobe CLI, cold caches", cold))
    rows.append(("", f"dpprobe CLI, warm caches (CPU {warm_cpu:.2f} s)", warm))
    try:
        sweep_api, sweep_result = run_probe_in_process(store, "adam", 1, 1e-3, EPSILONS, SEEDS,
                                                       args.repeats)
        rows.append(("", "dpprobe pipelines.run_probe (in process)", sweep_api))
        acc["dpprobe"] = float(np.mean([r["test_accuracy"] for r in sweep_result["runs"]]))
    except (ImportError, TypeError, KeyError) as error:  # the pipelines API changed
        sweep_api = None
        print(f"skipped pipelines.run_probe: {type(error).__name__}: {error}")
    sigmas = [accounting.calibrate_noise_multiplier(e, DELTA) for e in EPSILONS
              for _ in range(SEEDS)]
    sweep_train, acc["dpprobe train_probe"] = train_probe_in_memory(data, sigmas, "adam", 1,
                                                                    1e-3, args.repeats)
    rows.append(("", "dpprobe probe.train_probe (in memory)", sweep_train))
    floor = import_floor(cache, args.repeats)
    rows.append(("", "a process importing JAX and optax only", floor))

    # 2. The same 40 runs with Opacus.
    opacus_sweep = {}
    for mode in modes:
        passes = [opacus_runs(data, sigmas, "adam", 1, 1e-3, mode)
                  for _ in range(max(1, args.opacus_repeats))]
        opacus_sweep[mode] = statistics.median(seconds for seconds, _ in passes)
        accuracies = passes[0][1]
        acc[f"Opacus {mode}"] = float(np.mean(accuracies))
        rows.append(("2. same 40 runs" if len(opacus_sweep) == 1 else "",
                     f"Opacus {OPACUS_MODES[mode]} ({mode}), Poisson q=1", opacus_sweep[mode]))

    # 3. T = 100 momentum steps, one run at epsilon = 1.
    t100_api = t100_train = t100_cli = None
    opacus_t100 = {}
    if not args.skip_t100:
        t100_api, t100_train, t100_cli, opacus_t100 = t100_section(args, store, data, cache,
                                                                   modes, rows, half)

    # 4. DP vs non-private step.
    dp_step, plain_step = step_ratio(max(5, args.repeats))
    rows.append(("4. one step, 50k x 768 (per step)", "DP step via probe.train_probe", dp_step))
    rows.append(("", "non-private step (jax.grad + Adam)", plain_step))

    print(f"\n50k x 768 float16 features in Zarr, 10 classes, delta={DELTA:g}; dpprobe: "
          f"medians of {args.repeats} (T=100: {half}), Opacus: median of {args.opacus_repeats} "
          f"passes of the 40 runs, one of T=100; CPU, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[1]:.1f} (5 min)")
    print(f"{'benchmark':38s} {'system':42s} {'seconds':>9s}")
    for bench, system, seconds in rows:
        print(f"{bench:38s} {system:42s} {seconds:9.3f}")

    print("\nratios (same run)")
    for mode, seconds in opacus_sweep.items():
        parts = [f"CLI warm {seconds / warm:.1f}x", f"CLI cold {seconds / cold:.1f}x",
                 f"train_probe {seconds / sweep_train:.1f}x",
                 f"at most {seconds / (floor + sweep_train):.1f}x for any new process "
                 "(its JAX and optax imports and the training alone)"]
        if sweep_api is not None:
            parts.insert(1, f"run_probe {seconds / sweep_api:.1f}x")
        print(f"  (2)/(1) Opacus {mode:5s} / dpprobe: " + ", ".join(parts))
    for mode, seconds in opacus_t100.items():
        parts = [f"CLI warm {seconds / t100_cli:.1f}x", f"train_probe {seconds / t100_train:.1f}x"]
        if t100_api is not None:
            parts.insert(0, f"run_probe {seconds / t100_api:.1f}x")
        print(f"  (3) Opacus {mode:5s} / dpprobe: " + ", ".join(parts))
    print(f"  (4) DP step / non-private step = {dp_step / plain_step:.2f}x")
    print("  accuracy check, mean over the 40 runs: "
          + ", ".join(f"{name} {value:.4f}" for name, value in acc.items()))

    print("\nacceptance")
    print(f"  {'target':58s} {'value':>9s} {'goal':>9s}  met")
    _target("DP step / non-private step", dp_step / plain_step, "<= 1.0x", lambda v: v <= 1.0)
    _target("40-run sweep in process (pipelines.run_probe)", sweep_api, "<= 0.5 s",
            lambda v: v <= 0.5)
    _target("40-run sweep from the CLI (warm caches)", warm, "<= 2 s", lambda v: v <= 2.0)
    ratio = opacus_sweep.get("ghost")
    _target("Opacus ghost 40 runs / dpprobe CLI warm", ratio and ratio / warm, ">= 15x",
            lambda v: v >= 15)
    ratio = opacus_sweep.get("hooks")
    _target("Opacus per-sample 40 runs / dpprobe CLI warm", ratio and ratio / warm, ">= 75x",
            lambda v: v >= 75)
    _target("CPU seconds of the CLI sweep (warm caches)", warm_cpu, "<= 2 s",
            lambda v: v <= 2.0)
    _target("T=100 momentum (pipelines.run_probe)", t100_api, "<= 3 s", lambda v: v <= 3.0)
    ratio = opacus_t100.get("ghost")
    _target("Opacus ghost T=100 / dpprobe T=100 (run_probe)",
            ratio and t100_api and ratio / t100_api, "~>= 20x", lambda v: v >= 20)

    if not args.skip_imagenet:
        report = imagenet(workdir, args.imagenet_steps)
        per_step = report["seconds"] / report["steps"]
        print(f"\n5. ImageNet-shaped, streamed out of core: 1,281,167 x 1280 float16 "
              f"({report['store_bytes'] / 2**30:.2f} GiB on disk), 1000 classes, DP-Adam")
        print(f"   {report['steps']} steps in {report['seconds']:.1f} s = {per_step:.1f} s/step; "
              f"peak RSS {report['peak_rss_bytes'] / 2**30:.2f} GiB "
              f"(features as float32 in memory would be {1_281_167 * 1280 * 4 / 2**30:.1f} GiB)")
    if not args.skip_profile:
        profiler = _path.load_benchmark("sweep_profile")
        profiler.print_profile(profiler.profile(store, workdir, args.repeats), args.repeats)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"benchmark process peak RSS: {peak:.2f} GiB")


if __name__ == "__main__":
    main()
