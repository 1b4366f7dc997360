"""Full-finetuning throughput side by side, in one run: DP-SGD vs non-private training of the
same model at the same physical batch, and Opacus 1.6 (PyTorch) in its fastest mode per model.

  dpprobe DP-SGD     `finetune.train_finetune` (public API), full batch over N = k p examples
                     (k physical batches of p per step, `--batches-per-step`, default 4,
                     book-keeping clipped sums added, one noise draw and update per step):
                     images per second over T steps after a compiling run of T steps. k = 4
                     draws the noise four times as often per image as a real run: the default
                     recipe's B = 2048 at p 64 is k = 32
  non-private        the same trainer, model and images with `DpPlan(0, T, 1, inf)` (what
                     `dpprobe finetune --non-private` runs: the plain batch gradient, no
                     noise), timed in turn with DP-SGD (ABAB) so that load hits both alike
  Opacus             the PyTorch counterpart (dpmodel/torch_models.py, or the timm model of the
                     name: ViT, ConvNeXt, BiT) made private by Opacus with Poisson sampling
                     (expected batch p), in its fastest mode:
                     ghost clipping where every layer supports it, per-sample hooks otherwise,
                     functorch for layers hooks do not know (the table says which)
  PyTorch            the same PyTorch model without Opacus (on the GPU when PyTorch sees one;
                     the loader's batches are copied there, the clock waits for the GPU)

Models: the small CNN (28 x 28 x 1), WRN-16-4 with GroupNorm and weight standardization
(28 x 28 x 1), ViT-tiny/16 at 32 px (3 channels); `--models convnext`: timm's convnext_atto at
32 px (3 channels, p 32); `--models bit`: timm's resnetv2_50x1_bit (BiT) at 32 px (3 channels,
p 32). Medians over repeats; the machine is shared.

Parameter-efficient modes (`--train bias,lora`, ViT-tiny only; `finetune.modes`): one more row
per mode, DP-SGD of that mode against the non-private reference of the same mode
(`train_finetune` with `DpPlan(0, T, 1, inf)`: plain batch gradient, no noise), both through
`train_finetune`, the same model, images and physical batches (LoRA rank `--lora-rank`).
Run: .venv/bin/python benchmarks/finetune.py [--repeats 3 --steps 3 --models cnn,wrn16_4,vit]
     [--train all,bias,lora] [--vit-px 224 --batch 16]
On a GPU, steps default to 40 per timed call (3 on a CPU): at 5 the call's set-up was most of
what was timed. Let JAX leave room for PyTorch: XLA_PYTHON_CLIENT_MEM_FRACTION=0.4 (the README's
H200 table ran so).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import warnings

import _path  # noqa: F401 - first: keeps this folder off the import path
import numpy as np

MODELS = {  # name: (finetune model, image side, channels, physical batch)
    "cnn": ("cnn", 28, 1, 256),
    "wrn16_4": ("wrn16_4", 28, 1, 32),
    "vit": ("vit_tiny_patch16_224", 32, 3, 64),
    "convnext": ("convnext_atto", 32, 3, 32),  # not in the default --models
    "bit": ("resnetv2_50x1_bit", 32, 3, 32),  # not in the default --models
    "lite0": ("tf_efficientnet_lite0", 64, 3, 64),  # not in the default --models
    "resnet": ("resnet18", 32, 3, 32),  # not in the default --models
    "beit": ("beit_base_patch16_224", 32, 3, 32),  # not in the default --models
}
CLASSES = 10


def _rate(value, width=9):
    """Images per second: whole numbers, one decimal below 100 (ViT-tiny at 224 px)."""
    return f"{value:{width}.1f}" if value < 100 else f"{value:{width}.0f}"


def _data(side, channels, n, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (n, side, side, channels), dtype=np.uint8),
            rng.integers(0, CLASSES, n))


def _jax_model(name, side, channels):
    from flax import nnx

    import dpprobe.finetune.models  # noqa: F401 (loads the submodule)
    from dpprobe import finetune

    return finetune.models.create_model(name, CLASSES, image_size=side, in_channels=channels,
                                        rngs=nnx.Rngs(0))


def dpprobe_pair(name, side, channels, p, steps, repeats, mode="all", lora_rank=8, k=4):
    """(DP img/s, non-private img/s) of `finetune.train_finetune` training `mode`'s parameters
    (`finetune.modes`), full batch over k p examples: DP-SGD (book-keeping clipping, noise)
    and the non-private reference (`DpPlan(0, T, 1, inf)`: the plain batch gradient, no
    noise, what `dpprobe finetune --non-private` runs). Both compiled first, then timed in
    turn (DP, non-private, DP, ...) so that the shared machine's load hits both alike; medians
    of wall time over `steps` steps."""
    from flax import nnx

    from dpprobe import accounting, finetune

    images, labels = _data(side, channels, k * p)
    spec = finetune.FinetuneSpec(CLASSES, optimizer="sgd", learning_rate=0.1, ema_decay=None,
                                 mean=(0.5,) * channels, std=(0.5,) * channels, train=mode)
    flags = finetune.FinetuneFlags(physical_batch_size=p)
    model = _jax_model(name, side, channels)
    if mode == "lora":
        finetune.add_lora(model, lora_rank, rngs=nnx.Rngs(1))

    def runner(private):
        def run(t):
            plan = (accounting.DpPlan(1.0, t, 1.0, 1.0) if private
                    else accounting.DpPlan(0.0, t, 1.0, math.inf))
            return finetune.train_finetune(model, images, labels, plan, spec, flags=flags)

        return run

    runs = [runner(True), runner(False)]
    for run in runs:
        # Compiles with the timed calls' step count: the update's program depends on it (its
        # learning-rate schedule, a static argument of `finetune.train.dp_update`); warmed at
        # one step, the first timed DP call compiled its noise and update again.
        run(steps)
    times = [[], []]
    for _ in range(repeats):
        for run, spent in zip(runs, times, strict=True):
            start = time.perf_counter()
            run(steps)
            spent.append(time.perf_counter() - start)
    return tuple(k * p * steps / statistics.median(spent) for spent in times)


def _torch_model(name, side, channels):
    import timm

    from dpprobe.model import torch_models  # the golden tests' PyTorch counterparts

    if name == "cnn":  # 28 px: the flattened map is 4 x 4
        return torch_models.TorchTemperedCNN(CLASSES, channels, side=4)
    if name == "wrn16_4":
        return torch_models.TorchWRN(CLASSES, depth=16, width=4, in_channels=channels)
    # "vit" rows are timm ViT names (gpu.py's ViT-B/16 too); a ConvNeXt takes any size
    size = {"img_size": side} if name.startswith(("vit", "deit", "beit")) else {}
    return timm.create_model(name, pretrained=False, num_classes=CLASSES, in_chans=channels,
                             **size)


def opacus_and_torch(name, side, channels, p, steps, repeats):
    """(Opacus img/s, its mode, PyTorch non-private img/s): Poisson sampling with expected
    batch p over 4 p examples."""
    import torch
    from opacus import PrivacyEngine

    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    images, labels = _data(side, channels, 4 * p)
    x = (torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.5
    y = torch.from_numpy(labels).long()
    dataset = torch.utils.data.TensorDataset(x, y)  # on the host, as a real loader's batches
    x, y = x.to(device), y.to(device)

    def timed(loop):
        loop(1)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            seen = loop(steps)
            if device.type == "cuda":
                torch.cuda.synchronize()  # the GPU runs behind the host
            times.append((time.perf_counter() - start) / seen)
        return 1.0 / statistics.median(times)

    model = _torch_model(name, side, channels).to(device)
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
        model = _torch_model(name, side, channels).to(device)
        frozen[0] = _freeze_batchnorm(model)
        opt = torch.optim.SGD([q for q in model.parameters() if q.requires_grad], lr=0.1)
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
                    xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
                    opt.zero_grad()
                    criterion(model(xb), yb).backward()
                    opt.step()
                    seen += len(yb)
                    done += 1
                    if done == t:
                        break
            return max(seen, 1)

        return timed(dp)

    rates, frozen = {}, [False]
    for mode in ("ghost", "hooks", "functorch"):  # functorch: layers hooks do not know
        try:
            rates[mode] = private_rate(mode)
        except Exception as err:  # noqa: BLE001 - Opacus refuses a model it cannot handle
            print(f"  Opacus {mode} mode fails on {name}: {type(err).__name__}: "
                  f"{str(err).splitlines()[0][:120]}", flush=True)
        if mode == "hooks" and rates:
            break  # functorch only when neither ghost nor hooks run
    if not rates:
        return None, "refuses", torch_rate
    mode = max(rates, key=rates.get)
    print(f"  Opacus {name}: " + ", ".join(f"{m} {r:.0f} img/s" for m, r in rates.items())
          + (" (BatchNorm frozen: Opacus refuses trainable BatchNorm)" if frozen[0] else ""),
          flush=True)
    return rates[mode], mode + ("+BNf" if frozen[0] else ""), torch_rate


def _freeze_batchnorm(model) -> bool:
    """Puts every BatchNorm of a torch model in eval mode with its scale and offset frozen:
    Opacus refuses a BatchNorm that trains (its batch statistics mix examples), and frozen at
    its running statistics it is what our finetune runs, less the scales and offsets we train.
    True when the model has one."""
    import torch

    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for norm in norms:
        norm.eval().requires_grad_(False)
    return bool(norms)


def _print_devices(skip_torch, k):
    """One line naming where each framework runs (JAX: its default device; PyTorch: CUDA when
    it sees a GPU), the float32 matmul settings that differ between them on a GPU, and k (our
    physical batches per DP step), which the table's rows depend on."""
    import jax

    line = f"JAX {jax.__version__} on {jax.devices()[0].device_kind}, k = {k}"
    if not skip_torch:
        import torch

        gpu = torch.cuda.is_available()
        where = torch.cuda.get_device_name() if gpu else "CPU"
        line += f"; PyTorch {torch.__version__} on {where}"
        if gpu:
            line += (f" (TF32 matmul {torch.backends.cuda.matmul.allow_tf32}, "
                     f"cuDNN {torch.backends.cudnn.allow_tf32})")
    print(line, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="cnn,wrn16_4,vit")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="DP steps per timed call "
                        "(default 3 on a CPU, 40 on a GPU, where a call's set-up outweighs "
                        "5 steps: README, 'The H100 again')")
    parser.add_argument("--skip-opacus", action="store_true")
    parser.add_argument("--train", default="all", help="comma-separated modes: all (the table "
                        "above), bias, lora (ViT-tiny rows, DP vs non-private of the mode)")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--vit-px", type=int, default=32, help="ViT-tiny's image side "
                        "(a multiple of 16; 224: the pretrained resolution, T = 197 tokens)")
    parser.add_argument("--batches-per-step", type=int, default=4, help="k: physical batches "
                        "per DP step of ours (N = k p, full batch; Opacus keeps its one batch "
                        "of p per step)")
    parser.add_argument("--batch", type=int, default=None, help="physical batch p of every "
                        "model (default: the model's own, table MODELS)")
    args = parser.parse_args()
    if args.steps is None:
        import jax

        args.steps = 3 if jax.default_backend() == "cpu" else 40
    for key, (name, side, channels, p) in MODELS.items():
        MODELS[key] = (name, args.vit_px if key == "vit" else side, channels, args.batch or p)
    modes = args.train.split(",")
    _print_devices(args.skip_opacus, args.batches_per_step)
    header = (f"{'model':9} {'px':>3} {'p':>4} {'DP img/s':>9} {'non-priv':>9} {'DP/np':>6} "
              f"{'Opacus':>8} {'mode':>10} {'torch':>8} {'ours/Opacus':>11} {'Opacus/torch':>12}")
    print(header, flush=True)
    for key in args.models.split(",") if "all" in modes else ():  # each row once measured
        name, side, channels, p = MODELS[key]
        dp, plain = dpprobe_pair(name, side, channels, p, args.steps, args.repeats,
                                 k=args.batches_per_step)
        opacus, mode, torch_rate = (None, "-", None) if args.skip_opacus else opacus_and_torch(
            name, side, channels, p, args.steps * 4, args.repeats)
        ratio = f"{dp / opacus:11.2f}" if opacus else f"{'-':>11}"
        own = f"{opacus / torch_rate:12.2f}" if opacus else f"{'-':>12}"
        opacus_text = f"{opacus:8.0f}" if opacus else f"{'-':>8}"
        torch_text = f"{torch_rate:8.0f}" if torch_rate else f"{'-':>8}"
        print(f"{key:9} {side:3d} {p:4d} {_rate(dp)} {_rate(plain)} {dp / plain:6.2f} "
              f"{opacus_text} {mode:>10} {torch_text} {ratio} {own}", flush=True)
    partial = [m for m in modes if m != "all"]
    if partial:
        print(f"\n{'mode':9} {'model':9} {'px':>3} {'p':>4} {'DP img/s':>9} {'non-priv':>9} "
              f"{'DP/np':>6}", flush=True)
    name, side, channels, p = MODELS["vit"]
    for mode in partial:
        dp, plain = dpprobe_pair(name, side, channels, p, args.steps, args.repeats, mode,
                                 args.lora_rank, args.batches_per_step)
        label = f"lora r{args.lora_rank}" if mode == "lora" else mode
        print(f"{label:9} {'vit':9} {side:3d} {p:4d} {_rate(dp)} {_rate(plain)} {dp / plain:6.2f}",
              flush=True)
    print("\ntargets (issue 25): DP / non-private >= 0.8 (--train bias/lora: >= 0.9); "
          "ours / Opacus >= 3; our non-private >= 0.8 PyTorch's")


if __name__ == "__main__":
    main()
