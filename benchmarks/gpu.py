"""GPU figures as data: one script, about 8 minutes on one GPU, that writes
`benchmarks/results/<card>.json`; the docs' performance page renders every such file
(`docs/hooks/gpu_results.py`), so a card's figures are rerun and compared, never retyped.

Sections (`--sections`, default all), each on the card that JAX and PyTorch both see:
  probe_step  the probe's ImageNet-shaped DP step: 1.28M x 1280 float16 features, 1000 classes,
              one DP-Adam run through `probe.train_probe` (the public API): seconds per step,
              marginal ((T = 1 + K) - (T = 1)) / K, against its memory roofline. The step reads
              the features twice (the logits, then the clipped sum X^T R), 2 N d 2 bytes, at the
              bandwidth measured here by copying them (no vendor figure); the target is <= 2x.
  float64     what the rigorous float64 sums cost on this card: a float64 vs float32 product of
              X^T R's shape (the ratio a card with slow FP64 pays, 1/32-1/64 on most
              non-datacenter GPUs), and the DP step against the non-private full-batch step
              (`probe_step.non_private_steps`) on the same features.
  sweep       the 40-run sweep (8 epsilons x 5 seeds, one step, 50k x 768, 10 classes): all
              runs in one program (`probe_sweep.train_probe_in_memory`) vs Opacus per-sample
              (hooks) and ghost clipping (`probe_sweep.opacus_runs`) on the same card, medians.
  finetune    ViT-B/16 at 224 px: DP-SGD vs non-private images per second through
              `finetune.train_finetune` (`finetune.dpprobe_pair`, the target >= 0.9), and Opacus's
              fastest mode and plain PyTorch on the same model (`finetune.opacus_and_torch`).

Every section records its own wall time; a section that fails records its error and the
others still run. `--smoke` runs every section at toy shapes (on a CPU too: the test of this
script), which says nothing about speed.
Run: .venv/bin/python benchmarks/gpu.py [--sections probe_step,float64,sweep,finetune]
     [--out-dir benchmarks/results] [--smoke]
Let JAX leave room for PyTorch: XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 (set below if unset).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import statistics
import time
import traceback
from pathlib import Path

import _path  # noqa: F401 - first: keeps this folder off the import path

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")

SHAPES = {  # section: the real shapes, and the smoke test's
    "probe_step": {"full": dict(n=1_281_167, d=1280, classes=1000, extra_steps=10, repeats=3),
                   "smoke": dict(n=4096, d=64, classes=10, extra_steps=2, repeats=1)},
    "float64": {"full": dict(n=1_281_167, d=1280, classes=1000, repeats=5),
                "smoke": dict(n=2048, d=32, classes=10, repeats=1)},
    "sweep": {"full": dict(n=50_000, d=768, classes=10, seeds=5, repeats=3, opacus_repeats=3),
              "smoke": dict(n=1000, d=16, classes=10, seeds=1, repeats=1, opacus_repeats=1)},
    "finetune": {"full": dict(model="vit_base_patch16_224", side=224, p=32, steps=10,
                              repeats=3),
                 "smoke": dict(model="vit_tiny_patch16_224", side=32, p=4, steps=1,
                               repeats=1)},
}
SECTIONS = tuple(SHAPES)
EPSILONS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, math.inf)
DELTA = 1e-5


def card_name() -> str:
    """The file name of this card's results: JAX's device kind, lower case, [a-z0-9-]."""
    import jax

    return re.sub(r"[^a-z0-9]+", "-", jax.devices()[0].device_kind.lower()).strip("-")


def _features(n: int, d: int, classes: int, seed: int = 0):
    """Linearly structured float16 features and labels, made on the device in chunks (the
    ImageNet shape is 3.3 GB: no host copy)."""
    import jax
    import jax.numpy as jnp

    key_x, key_w, key_y = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(key_x, (n, d), jnp.float16)
    w = jax.random.normal(key_w, (d, classes), jnp.float32)
    y = jnp.argmax(x.astype(jnp.float32) @ w + jax.random.gumbel(key_y, (n, classes)), axis=1)
    return jax.block_until_ready((x, y.astype(jnp.int32)))


def _median_seconds(fn, repeats: int) -> float:
    """Median wall time of `fn()` (blocked until ready) after one warm-up call."""
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(x, repeats: int) -> float:
    """Bytes per second of reading and writing `x` once (x + 0 into a new buffer)."""
    import jax

    copy = jax.jit(lambda a: a + a.dtype.type(0))
    seconds = _median_seconds(lambda: copy(x), max(3, repeats))
    return 2 * x.size * x.dtype.itemsize / seconds


def probe_step(n: int, d: int, classes: int, extra_steps: int, repeats: int) -> dict:
    step = _path.load_benchmark("probe_step")
    x, y = _features(n, d, classes)
    bandwidth = copy_bandwidth(x, repeats)
    (per_step, per_step_min), _ = step.api_steps(x, y, classes, extra_steps, repeats)
    roofline = 2 * x.size * x.dtype.itemsize / bandwidth  # X read for the logits and for X^T R
    return {"shape": [n, d, classes], "dtype": "float16", "seconds_per_step": per_step,
            "seconds_per_step_min": per_step_min, "bandwidth_gb_s": bandwidth / 1e9,
            "roofline_seconds": roofline, "over_roofline": per_step / roofline,
            "target": "over_roofline <= 2", "met": per_step / roofline <= 2}


def float64_cost(n: int, d: int, classes: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    step = _path.load_benchmark("probe_step")
    x, y = _features(n, d, classes)
    residual = jax.random.normal(jax.random.key(1), (n, classes), jnp.float32)
    products = {}
    # the clipped sum's shape, X^T R: the float64 sums' extra work on this card (float64 is
    # scoped to the call, as the probe scopes it: `dp.accumulate.x64_jit`)
    with jax.enable_x64(True):
        for dtype in ("float32", "float64"):
            product = jax.jit(lambda a, r, t=dtype: a.astype(t).T @ r.astype(t))
            products[dtype] = _median_seconds(lambda p=product: p(x, residual), repeats)
    onehot = jax.nn.one_hot(y, classes, dtype=jnp.float32)
    params = {"w": jnp.zeros((d, classes), jnp.float32), "b": jnp.zeros((classes,), jnp.float32)}
    (plain, _), _ = step.non_private_steps(x.astype(jnp.float32), onehot, params, 2, repeats)
    (private, _), _ = step.api_steps(x, y, classes, 2, repeats)
    return {"shape": [n, d, classes], "xtr_float32_seconds": products["float32"],
            "xtr_float64_seconds": products["float64"],
            "float64_over_float32": products["float64"] / products["float32"],
            "dp_step_seconds": private, "non_private_step_seconds": plain,
            "dp_over_non_private": private / plain}


def sweep(n: int, d: int, classes: int, seeds: int, repeats: int, opacus_repeats: int) -> dict:
    import numpy as np
    import torch

    from dpprobe import accounting

    bench = _path.load_benchmark("probe_sweep")
    rng = np.random.default_rng(0)
    w = rng.normal(size=(d, classes))
    # float16 values (as a store holds them) in float32 arrays (as the store reader returns)
    x, xt = (rng.normal(size=(m, d)).astype(np.float16).astype(np.float32) for m in (n, n // 5))
    y, yt = ((a.astype(np.float32) @ w).argmax(1).astype(np.int64) for a in (x, xt))
    data = (x, y, xt, yt)
    sigmas = [accounting.calibrate_noise_multiplier(e, DELTA) for e in EPSILONS
              for _ in range(seeds)]
    ours, accuracy = bench.train_probe_in_memory(data, sigmas, "adam", 1, 1e-3, repeats)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = {"runs": len(sigmas), "shape": [n, d, classes], "dpprobe_seconds": ours,
              "dpprobe_accuracy": accuracy, "opacus_device": device}
    for mode in ("hooks", "ghost"):
        seconds = statistics.median(
            bench.opacus_runs(data, sigmas, "adam", 1, 1e-3, mode, device=device)[0]
            for _ in range(opacus_repeats))
        result[f"opacus_{mode}_seconds"] = seconds
        result[f"speedup_vs_opacus_{mode}"] = seconds / ours
    return result


def finetune(model: str, side: int, p: int, steps: int, repeats: int) -> dict:
    bench = _path.load_benchmark("finetune")
    dp, plain = bench.dpprobe_pair(model, side, 3, p, steps, repeats)
    opacus, mode, torch_rate = bench.opacus_and_torch(model, side, 3, p, steps * 4, repeats)
    return {"model": model, "image_size": side, "physical_batch": p,
            "dp_images_per_second": dp, "non_private_images_per_second": plain,
            "dp_over_non_private": dp / plain, "target": "dp_over_non_private >= 0.9",
            "met": dp / plain >= 0.9, "opacus_images_per_second": opacus, "opacus_mode": mode,
            "torch_images_per_second": torch_rate, "ours_over_opacus": dp / opacus}


RUNNERS = {"probe_step": probe_step, "float64": float64_cost, "sweep": sweep,
           "finetune": finetune}


def environment() -> dict:
    import jax
    import torch

    return {"card": jax.devices()[0].device_kind, "jax": jax.__version__,
            "jax_backend": jax.default_backend(), "torch": torch.__version__,
            "torch_device": (torch.cuda.get_device_name() if torch.cuda.is_available()
                             else "cpu"),
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")}


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--smoke", action="store_true",
                        help="toy shapes: checks that the script runs, times nothing useful")
    args = parser.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {unknown}; choose from {list(SECTIONS)}")
    shapes = "smoke" if args.smoke else "full"
    report = {"environment": environment(), "shapes": shapes, "sections": {}}
    print(json.dumps(report["environment"]), flush=True)
    for name in sections:
        start = time.perf_counter()
        try:
            result = RUNNERS[name](**SHAPES[name][shapes])
        except Exception as error:  # noqa: BLE001 - one section's failure is recorded, not fatal
            traceback.print_exc()
            result = {"error": f"{type(error).__name__}: {error}"}
        result["wall_seconds"] = time.perf_counter() - start
        report["sections"][name] = result
        print(f"{name}: {json.dumps(result)}", flush=True)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{card_name()}{'-smoke' if args.smoke else ''}.json"
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(report, indent=1) + "\n")
    temporary.replace(path)
    print(f"wrote {path}", flush=True)
    return path


if __name__ == "__main__":
    main()
