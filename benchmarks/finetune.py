"""Full-finetuning throughput side by side, in one run: DP-SGD vs non-private training of the
same model at the same physical batch, and Opacus 1.6 (PyTorch) in its fastest mode per model.

  dpprobe DP-SGD     `finetune.train_finetune` (public API), full batch over N = 4 p examples
                     (4 physical batches of p per step, clipped sums added, one noise draw and
                     update per step): images per second over T steps after a warm-up run
  non-private        the same model: jax.grad of the summed loss per physical batch, the 4
                     gradients added, one SGD update per step (jitted), the same images
  Opacus             the PyTorch counterpart (dpmodel/torch_models.py, or timm's ViT) made private
                     by Opacus with Poisson sampling (expected batch p), in its fastest mode:
                     ghost clipping where every layer supports it, per-sample hooks otherwise,
                     functorch for layers hooks do not know (the table says which)
  PyTorch            the same PyTorch model without Opacus

Models: the small CNN (28 x 28 x 1), WRN-16-4 with GroupNorm and weight standardization
(28 x 28 x 1), ViT-tiny/16 at 32 px (3 channels). Medians over repeats; the machine is shared.

Parameter-efficient modes (`--train bias,lora`, ViT-tiny only; `finetune.modes`): one more row
per mode, DP-SGD of that mode against the non-private reference of the same mode
(`train_finetune` with `DpPlan(0, T, 1, inf)`: plain batch gradient, no noise), both through
`train_finetune`, the same model, images and physical batches (LoRA rank `--lora-rank`), timed
by the trainer's own clock (results.json's images_per_second: the steps after the first).
Run: .venv/bin/python benchmarks/finetune.py [--repeats 3 --steps 3 --models cnn,wrn16_4,vit]
     [--train all,bias,lora]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import warnings

import _path  # noqa: F401 - first: keeps this folder off the import path
import jax
import jax.numpy as jnp
import numpy as np
import optax

MODELS = {  # name: (finetune model, image side, channels, physical batch)
    "cnn": ("cnn", 28, 1, 256),
    "wrn16_4": ("wrn16_4", 28, 1, 32),
    "vit": ("vit_tiny_patch16_224", 32, 3, 64),
}
CLASSES = 10


def _data(side, channels, n, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (n, side, side, channels), dtype=np.uint8),
            rng.integers(0, CLASSES, n))


def _images_per_second(run, images_per_step, steps, repeats):
    """`run(steps)` after a compiling `run(1)`: images per second, median over repeats."""
    run(1)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(steps)
        times.append(time.perf_counter() - start)
    return images_per_step * steps / statistics.median(times)


def _jax_model(name, side, channels):
    from flax import nnx

    import finetune.models

    return finetune.models.create_model(name, CLASSES, image_size=side, in_channels=channels,
                                        rngs=nnx.Rngs(0))


def dpprobe_dp(name, side, channels, p, steps, repeats, mixed_precision=False):
    """Images per second of `finetune.train_finetune`, full batch over 4 p examples."""
    import accounting
    import finetune

    images, labels = _data(side, channels, 4 * p)
    spec = finetune.FinetuneSpec(CLASSES, optimizer="sgd", learning_rate=0.1, ema_decay=None,
                                 mean=(0.5,) * channels, std=(0.5,) * channels)
    flags = finetune.FinetuneFlags(physical_batch_size=p, mixed_precision=mixed_precision)
    model = _jax_model(name, side, channels)

    def run(t):
        return finetune.train_finetune(model, images, labels, accounting.DpPlan(1.0, t, 1.0, 1.0),
                                       spec, flags=flags)

    return _images_per_second(run, 4 * p, steps, repeats)


def dpprobe_mode(name, side, channels, p, steps, repeats, mode, lora_rank, private):
    """Images per second of `finetune.train_finetune` training the parameters of `mode`
    (`finetune.modes`), DP-SGD or the non-private reference (clip_norm = inf: the plain batch
    gradient, no noise), full batch over 4 p examples."""
    from flax import nnx

    import accounting
    import finetune

    images, labels = _data(side, channels, 4 * p)
    spec = finetune.FinetuneSpec(CLASSES, optimizer="sgd", learning_rate=0.1, ema_decay=None,
                                 mean=(0.5,) * channels, std=(0.5,) * channels, train=mode)
    flags = finetune.FinetuneFlags(physical_batch_size=p)
    model = _jax_model(name, side, channels)
    if mode == "lora":
        finetune.add_lora(model, lora_rank, rngs=nnx.Rngs(1))

    plan = (accounting.DpPlan(1.0, steps + 1, 1.0, 1.0) if private
            else accounting.DpPlan(0.0, steps + 1, 1.0, math.inf))
    # The trainer's own clock (`finetune.timing`): the steps after the first (which compiles).
    return statistics.median(
        finetune.train_finetune(model, images, labels, plan, spec, flags=flags).images_per_second
        for _ in range(repeats))


def dpprobe_non_private(name, side, channels, p, steps, repeats, mixed_precision=False):
    """The same model and images without privacy: per physical batch jax.grad of the summed
    loss, added over the 4 batches of a step, one SGD update."""
    from flax import nnx

    images, labels = _data(side, channels, 4 * p)
    graphdef, params, rest = nnx.split(_jax_model(name, side, channels), nnx.Param, ...)

    @jax.jit
    def grads(params, x, y):
        def loss(params):
            xs = (x.astype(jnp.float32) / 255.0 - 0.5) / 0.5
            ps = params
            if mixed_precision:
                ps = jax.tree.map(lambda v: v.astype(jnp.bfloat16), params)
                xs = xs.astype(jnp.bfloat16)
            logits = nnx.merge(graphdef, ps, rest)(xs).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).sum()

        return jax.grad(loss)(params)

    @jax.jit
    def update(params, total):
        return jax.tree.map(lambda w, g: w - 0.1 * g / (4 * p), params, total)

    def run(t, params=params):
        for _ in range(t):
            total = None
            for b in range(4):
                g = grads(params, images[b * p:(b + 1) * p], labels[b * p:(b + 1) * p])
                total = g if total is None else jax.tree.map(jnp.add, total, g)
            params = update(params, total)
        return jax.block_until_ready(params)

    return _images_per_second(run, 4 * p, steps, repeats)


def _torch_model(name, side, channels):
    import timm

    from dpmodel import torch_models  # the golden tests' PyTorch counterparts

    if name == "cnn":  # 28 px: the flattened map is 4 x 4
        return torch_models.TorchTemperedCNN(CLASSES, channels, side=4)
    if name == "wrn16_4":
        return torch_models.TorchWRN(CLASSES, depth=16, width=4, in_channels=channels)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=CLASSES,
                             img_size=side, in_chans=channels)


def opacus_and_torch(name, side, channels, p, steps, repeats):
    """(Opacus img/s, its mode, PyTorch non-private img/s): Poisson sampling with expected
    batch p over 4 p examples."""
    import torch
    from opacus import PrivacyEngine

    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    images, labels = _data(side, channels, 4 * p)
    x = (torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.5
    y = torch.from_numpy(labels).long()
    dataset = torch.utils.data.TensorDataset(x, y)

    def timed(loop):
        loop(1)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            seen = loop(steps)
            times.append((time.perf_counter() - start) / seen)
        return 1.0 / statistics.median(times)

    model = _torch_model(name, side, channels)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    criterion = torch.nn.CrossEntropyLoss()

    def plain(t):  # the same steps without Opacus: 4 physical batches, one update
        seen = 0
        for _ in range(t):
            for b in range(4):
                opt.zero_grad()
                criterion(model(x[b * p:(b + 1) * p]), y[b * p:(b + 1) * p]).backward()
                seen += p
            opt.step()
        return seen

    torch_rate = timed(plain)

    def private_rate(mode):
        model = _torch_model(name, side, channels)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = torch.utils.data.DataLoader(dataset, batch_size=p)
        private = PrivacyEngine(accountant="prv").make_private(
            module=model, optimizer=opt, criterion=torch.nn.CrossEntropyLoss(),
            data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=True,
            grad_sample_mode=mode)
        if mode == "ghost":
            model, opt, criterion, loader = private
        else:
            model, opt, loader = private
            criterion = torch.nn.CrossEntropyLoss()

        def dp(t):
            seen, done = 0, 0
            while done < t:
                for xb, yb in loader:
                    opt.zero_grad()
                    criterion(model(xb), yb).backward()
                    opt.step()
                    seen += len(yb)
                    done += 1
                    if done == t:
                        break
            return max(seen, 1)

        return timed(dp)

    rates = {}
    for mode in ("ghost", "hooks", "functorch"):  # functorch: layers hooks do not know
        try:
            rates[mode] = private_rate(mode)
        except Exception as err:  # noqa: BLE001 - Opacus refuses a model it cannot handle
            print(f"  Opacus {mode} mode fails on {name}: {type(err).__name__}: "
                  f"{str(err).splitlines()[0][:120]}", flush=True)
        if mode == "hooks" and rates:
            break  # functorch only when neither ghost nor hooks run
    mode = max(rates, key=rates.get)
    print(f"  Opacus {name}: " + ", ".join(f"{m} {r:.0f} img/s" for m, r in rates.items()),
          flush=True)
    return rates[mode], mode, torch_rate


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="cnn,wrn16_4,vit")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--skip-opacus", action="store_true")
    parser.add_argument("--train", default="all", help="comma-separated modes: all (the table "
                        "above), bias, lora (ViT-tiny rows, DP vs non-private of the mode)")
    parser.add_argument("--lora-rank", type=int, default=8)
    args = parser.parse_args()
    modes = args.train.split(",")
    header = (f"{'model':9} {'px':>3} {'p':>4} {'DP img/s':>9} {'non-priv':>9} {'DP/np':>6} "
              f"{'Opacus':>8} {'mode':>9} {'torch':>8} {'ours/Opacus':>11} {'Opacus/torch':>12}")
    print(header, flush=True)
    for key in args.models.split(",") if "all" in modes else ():  # each row once measured
        name, side, channels, p = MODELS[key]
        dp = dpprobe_dp(name, side, channels, p, args.steps, args.repeats)
        plain = dpprobe_non_private(name, side, channels, p, args.steps, args.repeats)
        opacus, mode, torch_rate = (None, "-", None) if args.skip_opacus else opacus_and_torch(
            name, side, channels, p, args.steps * 4, args.repeats)
        ratio = f"{dp / opacus:11.2f}" if opacus else f"{'-':>11}"
        own = f"{opacus / torch_rate:12.2f}" if opacus else f"{'-':>12}"
        opacus_text = f"{opacus:8.0f}" if opacus else f"{'-':>8}"
        torch_text = f"{torch_rate:8.0f}" if torch_rate else f"{'-':>8}"
        print(f"{key:9} {side:3d} {p:4d} {dp:9.0f} {plain:9.0f} {dp / plain:6.2f} "
              f"{opacus_text} {mode:>9} {torch_text} {ratio} {own}", flush=True)
    partial = [m for m in modes if m != "all"]
    if partial:
        print(f"\n{'mode':9} {'model':9} {'px':>3} {'p':>4} {'DP img/s':>9} {'non-priv':>9} "
              f"{'DP/np':>6}", flush=True)
    name, side, channels, p = MODELS["vit"]
    for mode in partial:
        dp = dpprobe_mode(name, side, channels, p, args.steps, args.repeats, mode,
                          args.lora_rank, private=True)
        plain = dpprobe_mode(name, side, channels, p, args.steps, args.repeats, mode,
                             args.lora_rank, private=False)
        label = f"lora r{args.lora_rank}" if mode == "lora" else mode
        print(f"{label:9} {'vit':9} {side:3d} {p:4d} {dp:9.0f} {plain:9.0f} {dp / plain:6.2f}",
              flush=True)
    print("\ntargets: --train bias/lora DP / non-private of the same mode >= 0.9")
    print("\ntargets: DP / non-private >= 0.7 (Beltran et al.: 0.51-0.69 JAX FP32 on GPU); "
          "ours / Opacus >= 2")


if __name__ == "__main__":
    main()
