"""The white-box audit of finetuning (issue 28), measured on the real job (`run_finetune`):

  1. the CNN on digits at 16 px, epsilon 2, delta 1e-5, 5,000 gradient canaries:
     epsilon_lower and epsilon_estimate against the claim, over --repeats audited runs;
  2. the same run with the noise halved (swapped into the production code in this process only,
     as tests/dp/test_gradient_canaries.py does; never a flag): epsilon_lower must exceed 2;
  3. ViT-tiny (random init) at 16 px, epsilon 8, 50 steps of batch 64, 5,000 canaries:
     epsilon_estimate against the claim;
  4. time: the CNN run with and without the audit, side by side (same steps and batch).

Run: .venv/bin/python benchmarks/finetune_audit.py [--repeats 3] [--skip-vit]
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
def halved_noise():
    """The noise of every privatized sum halved, in this process only."""
    import jax

    import dpprobe.dp.noise  # noqa: F401 (loads the submodule)
    from dpprobe import dp

    original = dp.noise.gaussian_noise
    jax.clear_caches()
    dp.noise.gaussian_noise = lambda key, size, *dtype: 0.5 * original(key, size, *dtype)
    try:
        yield
    finally:
        dp.noise.gaussian_noise = original
        jax.clear_caches()


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
            f"estimate {statistics.median(estimate):7.3f} [{min(estimate):.3f}, "
            f"{max(estimate):.3f}] ({statistics.median(estimate) / claim:.2f}x)  "
            f"refuted {sum(a['refuted'] for a in audits)}/{len(audits)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-vit", action="store_true")
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
    with halved_noise():
        broken = [audited(CNN) for _ in range(args.repeats)]
    vit = [] if args.skip_vit else [audited(VIT) for _ in range(args.repeats)]

    print(f"\n{CANARIES} gradient canaries, delta 1e-5, 95% confidence; medians [min, max] over "
          f"{args.repeats} runs")
    print(line("CNN digits 16 px, eps 2", cnn))
    print(line("  the same, noise halved", broken))
    if vit:
        print(line("ViT-tiny 16 px, eps 8, 50 steps", vit))
    audited_s, plain_s = statistics.median(timing["audited"]), statistics.median(timing["plain"])
    print(f"time, CNN run with / without the audit: {audited_s:.1f} s / {plain_s:.1f} s = "
          f"{audited_s / plain_s:.2f}x (target <= 1.5x)")


if __name__ == "__main__":
    main()
