"""The white-box audit of finetuning, measured on the real job (`run_finetune`): Dirac gradient
canaries on the model's own coordinates (`dp.canaries`).

  1. the CNN on digits at 16 px, epsilon 2, delta 1e-5, 5,000 gradient canaries:
     epsilon_lower and epsilon_estimate against the claim, over --repeats audited runs;
  2. the same run with a fault swapped into the production code in this process only (never a
     flag; as tests/dp/test_gradient_canaries.py does): the noise halved; the noise dropped on
     the model's coordinates (kept on any leaf that is not the model's: the patch that the
     separate canary block of the audit before passed); the noise skipped on one layer
     (conv1); the clipping skipped on one layer (conv2's clipped sum ignores the factors).
     Each must be refuted (epsilon_lower > 2);
  3. ViT-tiny (random init) at 16 px, epsilon 8, 50 steps of batch 64, 5,000 canaries;
  4. time: the CNN run with and without the audit, side by side (same steps and batch).

Run: .venv/bin/python benchmarks/finetune_audit.py [--repeats 3] [--skip-vit] [--skip-faults]
This machine is shared and noisy: medians; rerun on yours.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import _path  # noqa: F401 - first: keeps this folder off the import path

CANARIES = 5000
CNN = dict(data="digits", model="cnn", resize=16, epsilon=2.0, delta=1e-5, batch_size=256,
           epochs=30, learning_rate=2.0, clip_norm=0.1, quiet=True)
VIT = dict(data="digits", model="vit_tiny_patch16_224", random_init=True, resize=16, crop=16,
           epsilon=8.0, delta=1e-5, batch_size=64, steps=50, learning_rate=0.5,
           physical_batch_size=64, quiet=True)


@contextlib.contextmanager
def patched(module, name: str, make):
    """`module.name` replaced by `make(original)` in this process only (programs retraced)."""
    import jax

    original = getattr(module, name)
    jax.clear_caches()
    setattr(module, name, make(original))
    try:
        yield
    finally:
        setattr(module, name, original)
        jax.clear_caches()


def faults():
    """{name: context manager} of the faults of the module docstring."""
    import jax

    import dpprobe.dp.bookkeeping  # noqa: F401 (loads the submodule)
    import dpprobe.dp.noise  # noqa: F401 (loads the submodule)
    import dpprobe.dp.optimizers  # noqa: F401 (loads the submodule)
    from dpprobe import dp

    def off_the_model(original):
        def add_noise(tree, stddev, key):
            if isinstance(tree, tuple):  # (the model's sums, a block that is not the model's)
                return (tree[0], *original(tuple(tree[1:]), stddev, key))
            return tree
        return add_noise

    def skipped_on(layer):
        def make(original):
            def add_noise(tree, stddev, key):
                return jax.tree_util.tree_map_with_path(
                    lambda path, out, clean: clean.astype(out.dtype)
                    if layer in jax.tree_util.keystr(path) else out,
                    original(tree, stddev, key), tree)
            return add_noise
        return make

    def unclipped_conv2(original):  # at 16 px conv2 has 4 tokens: a ghost layer
        def ghost_sum(a, b, factor, keep, acc):
            if (a.shape[2], b.shape[2]) == (4 * 4 * 16, 32):  # conv2: every factor 1
                factor = keep.astype(factor.dtype)
            return original(a, b, factor, keep, acc)
        return ghost_sum

    return {
        "noise halved": lambda: patched(dp.noise, "gaussian_noise", lambda o: (
            lambda key, size, *dtype: 0.5 * o(key, size, *dtype))),
        "noise off the model": lambda: patched(dp.optimizers, "add_noise", off_the_model),
        "noise skipped on conv1": lambda: patched(dp.optimizers, "add_noise",
                                                  skipped_on("conv1")),
        "clipping skipped on conv2": lambda: patched(dp.bookkeeping, "ghost_sum",
                                                     unclipped_conv2),
    }


def audited(options: dict) -> dict:
    from dpprobe.pipelines import run_finetune

    start = time.perf_counter()
    results = run_finetune(**options, audit_canaries=CANARIES)
    return results["audit"] | {"seconds": time.perf_counter() - start,
                               "test_accuracy": results["test_accuracy"]}


def line(name: str, audits: list[dict]) -> str:
    claim = audits[0]["claimed_epsilon"]
    lower = [a["epsilon_lower"] for a in audits]
    estimate = [a["epsilon_estimate"] for a in audits]
    return (f"{name:34s} claim {claim:5.2f}  lower {statistics.median(lower):6.3f} "
            f"[{min(lower):.3f}, {max(lower):.3f}] ({statistics.median(lower) / claim:.2f}x)  "
            f"estimate {statistics.median(estimate):9.3f} [{min(estimate):.3f}, "
            f"{max(estimate):.3f}] ({statistics.median(estimate) / claim:.2f}x)  "
            f"refuted {sum(a['refuted'] for a in audits)}/{len(audits)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-vit", action="store_true")
    parser.add_argument("--skip-faults", action="store_true")
    args = parser.parse_args()
    from dpprobe.pipelines import run_finetune

    run_finetune(**CNN, steps=2)  # compile
    timing = {"audited": [], "plain": []}
    cnn = []
    for _ in range(args.repeats):
        cnn.append(audited(CNN))
        timing["audited"].append(cnn[-1]["seconds"])
        start = time.perf_counter()
        run_finetune(**CNN)
        timing["plain"].append(time.perf_counter() - start)
        print(line("CNN digits 16 px, eps 2", cnn[-1:]), flush=True)
    broken = {}
    for name, fault in ({} if args.skip_faults else faults()).items():
        with fault():
            broken[name] = [audited(CNN) for _ in range(args.repeats)]
        print(line(f"  {name}", broken[name]), flush=True)
    vit = [] if args.skip_vit else [audited(VIT) for _ in range(args.repeats)]

    print(f"\n{CANARIES} gradient canaries on the model's coordinates, delta 1e-5, 95% "
          f"confidence; medians [min, max] over {args.repeats} runs")
    print(line("CNN digits 16 px, eps 2", cnn))
    for name, audits in broken.items():
        print(line(f"  {name}", audits))
    if vit:
        print(line("ViT-tiny 16 px, eps 8, 50 steps", vit))
    audited_s, plain_s = statistics.median(timing["audited"]), statistics.median(timing["plain"])
    print(f"time, CNN run with / without the audit: {audited_s:.1f} s / {plain_s:.1f} s = "
          f"{audited_s / plain_s:.2f}x (target <= 1.5x)")


if __name__ == "__main__":
    main()
