"""The `dpprobe` command line. Run `dpprobe COMMAND --help` for each command's options."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import math
import os
import sys
import threading

# A hub miss retries for ~45 s unless offline mode is set before huggingface_hub is imported;
# users who want the hub set HF_HUB_OFFLINE=0 explicitly.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

EPILOG = """\
Privacy: every epsilon is for zero-out neighbours (one record replaced by a null record; the
dataset size N is public), computed from the DpEvent of what ran, with the PLD accountant unless
--accountant rdp. Noise and batch sampling always draw from OS entropy.
"""


# Most steps of one run: beyond, counters overflow int32 and a run would never end anyway.
MAX_STEPS = 10_000_000


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (no usage block): `dpprobe probe: error: ...`."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _floats(text: str) -> list[float]:
    try:
        values = [math.inf if v.strip().lower() in ("inf", "infinity") else float(v)
                  for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from err
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one number, got {text!r}")
    if any(math.isnan(v) for v in values):
        raise argparse.ArgumentTypeError(f"nan is not a value, got {text!r}")
    return values


def _positive_floats(text: str) -> list[float]:
    values = _floats(text)
    if any(not (0 < v < math.inf) for v in values):
        raise argparse.ArgumentTypeError(f"expected finite numbers > 0, got {text!r}")
    return values


def _number(low: float | None = None, high: float | None = None, *, low_open=True,
            high_open=False, finite=True):
    """An argparse type: a float within (low, high] (by default), finite unless told."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from err
        if math.isnan(value) or (finite and math.isinf(value)):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        too_low = low is not None and (value <= low if low_open else value < low)
        too_high = high is not None and (value >= high if high_open else value > high)
        if too_low or too_high:
            if high is None:
                bounds = f"{'>' if low_open else '>='} {low:g}"
            else:
                bounds = (f"in {'(' if low_open else '['}{low:g}, {high:g}"
                          f"{')' if high_open else ']'}")
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text}")
        return value

    return parse


def _int(low: int = 1, high: int | None = None):
    """An argparse type: an integer in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from err
        if value < low or (high is not None and value > high):
            bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value

    return parse


def _ints(text: str, low: int = 1, high: int = MAX_STEPS) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from err
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one integer, got {text!r}")
    bad = [v for v in values if not low <= v <= high]
    if bad:
        raise argparse.ArgumentTypeError(f"each must be in [{low}, {high}], got {bad[0]}")
    return values


def _add_extract(sub) -> None:
    p = sub.add_parser(
        "extract",
        help="run a frozen backbone over a dataset into a Zarr feature store",
        description="Embed a dataset with a frozen backbone and write STORE/{train,test}. "
        "Rerunning an interrupted command resumes from the last complete chunk.",
        epilog="Data specs: fashion-mnist, digits, npz:PATH (images, labels), "
        "imagefolder:PATH (one folder per class), cifar10:PATH, cifar100:PATH. "
        "Backbones: any timm model name (optionally .tag), scatternet, or none (npz:PATH "
        "holding features and labels).",
    )
    p.add_argument("--backbone", required=True,
                   help="timm model name (e.g. vit_base_patch16_224.augreg_in21k), "
                   "'scatternet', or 'none' for precomputed embeddings")
    p.add_argument("--data", required=True, help="data spec (see below)")
    p.add_argument("--out", required=True, help="output Zarr store path")
    p.add_argument("--split", choices=("train", "test", "all"), default=None,
                   help="split to write: for npz/imagefolder the name given to the data "
                   "(default train); for multi-split sources, restrict to one (default all)")
    p.add_argument("--data-dir", default=None,
                   help="directory of Fashion-MNIST's gzipped IDX files "
                   "(default /usr/share/datasets/fashion-mnist)")
    p.add_argument("--weights", default=None,
                   help="local .safetensors/.pth weights file for the timm model (no hub)")
    p.add_argument("--random-init", action="store_true",
                   help="random weights (seeded by --seed); for tests only")
    p.add_argument("--seed", type=_int(0), default=0, help="seed of --random-init (default 0)")
    p.add_argument("--resize", type=_int(1), default=None,
                   help="resize the short side to R before cropping (Mehta et al.: 384)")
    p.add_argument("--crop", type=_int(1), default=None,
                   help="center-crop to S x S (Mehta et al.: 256); ViTs adapt their "
                   "position embeddings")
    p.add_argument("--batch-size", type=_int(1), default=256, help="images per forward pass")
    p.add_argument("--dtype", choices=("float16", "float32"), default="float16",
                   help="feature dtype in the store (default float16)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    p.add_argument("--rows-per-chunk", type=_int(1), default=None,
                   help="rows per Zarr chunk (default: ~8 MiB chunks)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing split written by a different job")
    p.add_argument("--workers", type=_int(0), default=None,
                   help="DataLoader worker processes (default: none on CPU, where the "
                   "backbone uses every core; up to 8 on GPU)")
    p.add_argument("--amp", choices=("auto", "off", "bf16", "fp16"), default="auto",
                   help="autocast: auto = bf16 on CUDA, off on CPU")
    p.add_argument("--channels-last", action="store_true", help="channels_last memory format")
    p.add_argument("--compile", action="store_true", help="torch.compile the backbone")
    p.add_argument("--shard", type=_shard, default=None, metavar="K/N",
                   help="extract only shard K of N (a chunk-aligned slice of rows) into the "
                   "same store, e.g. one process per GPU or a SLURM array task")
    p.add_argument("--ray", action="store_true",
                   help="run the shards as Ray tasks (one per GPU) on a Ray cluster")
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster address (default: RAY_ADDRESS, or a local cluster)")
    p.add_argument("--ray-shards", type=_int(1), default=None,
                   help="number of shards with --ray (default: one per GPU, else per CPU)")
    p.add_argument("--views", type=_int(1), default=None,
                   help="store K augmented views per example, shape (N, K, d), for "
                   "augmentation multiplicity in the probe (train split only)")
    p.add_argument("--augment", type=_names, default=(),
                   help="augmentations of the views: flip,crop (De et al.)")
    p.add_argument("--augment-seed", type=_int(0), default=0,
                   help="seed of the augmentations")
    p.add_argument("--num-classes", type=_int(1), default=None, metavar="K",
                   help="declare K classes for a source without class names (an npz without "
                   "class_names); labels must lie in [0, K). Never inferred from the labels")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _shard(text: str) -> tuple[int, int]:
    try:
        index, count = (int(v) for v in text.split("/"))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected K/N, e.g. 0/4, got {text!r}") from err
    if not (count >= 1 and 0 <= index < count):
        raise argparse.ArgumentTypeError(f"shard K/N needs 0 <= K < N, got {text!r}")
    return index, count


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _add_verify_info(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="check a feature store: completeness, shapes, NaN/Inf, labels, checksums",
        description="Reads every chunk: reports missing or incomplete splits, shape and dtype "
        "mismatches, NaN/Inf, labels out of range, and chunks whose sha256 differs from the "
        "one recorded when they were written. Exit status 1 if anything is wrong.",
    )
    p.add_argument("store")
    p.add_argument("--data", default=None,
                   help="also re-fingerprint this data spec and compare with the recorded one")
    p.add_argument("--data-dir", default=None, help="Fashion-MNIST directory for --data")
    p.add_argument("--quiet", action="store_true")
    p = sub.add_parser("info", help="print a feature store's provenance",
                       description="Backbone, weights, preprocessing, dataset fingerprint, "
                       "shapes and completion of every split.")
    p.add_argument("store")
    p.add_argument("--json", action="store_true", help="print all attributes as JSON")


def _add_model_options(p) -> None:
    """Loss, clipping and feature normalization: shared by `probe` and `tune`."""
    p.add_argument("--loss", choices=("softmax", "sigmoid"), default="softmax",
                   help="softmax cross-entropy, or one-vs-all sigmoid (bias init -10)")
    p.add_argument("--clip-norm", type=_number(0), default=1.0, help="per-example clip norm C")
    p.add_argument("--normalize", choices=("none", "l2", "group"), default="none",
                   help="per-example feature normalization (costs no privacy)")
    p.add_argument("--groups", type=_int(1), default=None,
                   help="groups of --normalize group (default 1)")


def _add_probe_options(p) -> None:
    p.add_argument("--delta", type=_number(0, 1, high_open=True), default=1e-5,
                   help="target delta (default 1e-5)")
    p.add_argument("--seeds", type=_int(1), default=3,
                   help="independent runs per config, each with fresh noise (default 3)")
    p.add_argument("--optimizer", choices=("adam", "sgd", "momentum", "sign", "lamb"),
                   default="adam", help="update rule on the privatized gradient (default adam)")
    p.add_argument("--steps", type=_ints, default=[1],
                   help="full-batch steps T, comma-separated to sweep (default 1)")
    p.add_argument("--lr", type=_positive_floats, default=None,
                   help="learning rate(s), comma-separated (default: adam/sign/lamb 1e-3, "
                   "sgd and momentum 1)")
    _add_model_options(p)
    p.add_argument("--bias-init", type=_number(finite=True), default=None,
                   help="initial bias (default 0 for softmax, -10 for sigmoid)")
    p.add_argument("--accountant", choices=("pld", "rdp"), default="pld",
                   help="privacy accountant (default pld, tight)")
    p.add_argument("--sampling-probability", "-q", type=_number(0, 1), default=1.0,
                   help="Poisson sampling rate q; q < 1 trains masked DP-SGD on Poisson-"
                   "sampled minibatches (Beltran et al.) instead of full batch (default 1)")
    p.add_argument("--physical-batch-size", type=_int(1), default=256,
                   help="rows per compiled kernel call with q < 1 (default 256)")
    stream = p.add_mutually_exclusive_group()
    stream.add_argument("--stream", dest="stream", action="store_true", default=None,
                        help="stream the train split from disk chunk by chunk (default: when "
                        "it exceeds a quarter of RAM as float32)")
    stream.add_argument("--in-memory", dest="stream", action="store_false",
                        help="load the train split into memory")
    p.add_argument("--devices", type=_int(1), default=None,
                   help="shard rows over this many local devices (data parallel)")
    p.add_argument("--out", default=None, help="write results JSON here")
    p.add_argument("--csv", default=None, help="write one CSV row per run here")
    p.add_argument("--plot", default=None, help="write a PNG of accuracy vs epsilon here")
    p.add_argument("--diagnostics", default=None, metavar="PATH",
                   help="write exact statistics of the private data (clipped fractions, batch "
                   "sizes, data fingerprint) to this local file for debugging: not DP, never "
                   "share it")
    p.add_argument("--quiet", action="store_true", help="print only the table")


def _add_probe(sub) -> None:
    p = sub.add_parser(
        "probe",
        allow_abbrev=False,  # `--seed` must not silently mean `--seeds`
        help="train DP linear probes on a feature store over a sweep of epsilons",
        description="Full-batch DP linear probe (zero init) for every epsilon x steps x lr x "
        "seed, in one compiled program; prints test accuracy mean ± std over seeds.",
        epilog=EPILOG,
    )
    p.add_argument("store", help="feature store written by `dpprobe extract`")
    p.add_argument("--epsilons", type=_floats, default=[0.5, 1, 2, 4, 8],
                   help="target epsilons, comma-separated (default 0.5,1,2,4,8); add inf for a "
                   "non-private reference: the same recipe without noise, no guarantee")
    _add_probe_options(p)


def _add_tune(sub) -> None:
    p = sub.add_parser(
        "tune",
        allow_abbrev=False,  # `--seed` must not silently mean `--seeds`
        help="private hyperparameter search (linear scaling rule) + final probe",
        description="Panda et al.'s linear scaling rule: search r = lr x T at budgets eps0 "
        "and eps1, fit r = alpha * epsilon + b, extrapolate, train the final full-batch "
        "DP-SGD probe with the remaining budget. The total epsilon includes every trial.",
        epilog=EPILOG,
    )
    p.add_argument("store", help="feature store written by `dpprobe extract`")
    p.add_argument("--epsilon", type=_number(0), required=True,
                   help="total epsilon, tuning included")
    p.add_argument("--delta", type=_number(0, 1, high_open=True), default=1e-5,
                   help="delta (default 1e-5)")
    p.add_argument("--eps0", type=_number(0), default=None,
                   help="budget of the first search stage (default epsilon/20)")
    p.add_argument("--eps1", type=_number(0), default=None,
                   help="budget of the second search stage (default epsilon/10)")
    p.add_argument("--trials", type=_int(1), default=5, help="trials per stage (default 5)")
    p.add_argument("--search", choices=("random", "grid"), default="random",
                   help="random (log-uniform) or grid search over r (default random)")
    p.add_argument("--r-min", type=_number(0), default=1.0,
                   help="smallest r of stage 0 (default 1)")
    p.add_argument("--r-max", type=_number(0), default=1000.0,
                   help="largest r of stage 0 (default 1000)")
    p.add_argument("--steps-choices", type=_ints, default=[25, 50, 100],
                   help="T values r is decomposed over, lr = r / T (default 25,50,100)")
    p.add_argument("--final-steps", type=_int(1, MAX_STEPS), default=None,
                   help="T of the final run (default: the largest --steps-choices)")
    p.add_argument("--optimizer", choices=("momentum", "sgd", "adam", "sign", "lamb"),
                   default="momentum", help="update rule (default momentum 0.9, as Panda et al.)")
    _add_model_options(p)
    p.add_argument("--selection", choices=("train", "holdout"), default=None,
                   help="how trials are scored, privately: noisy correct counts on the training "
                   "data, paid from --eps-select (train, default), or on a held-out part of train "
                   "that composes in parallel (holdout)")
    p.add_argument("--eps-select", type=_number(0), default=None,
                   help="budget of the noisy selection counts with --selection train "
                   "(default epsilon/20)")
    p.add_argument("--validation-fraction", type=_number(0, 1, high_open=True), default=0.1,
                   help="share of train held out with --selection holdout (default 0.1)")
    p.add_argument("--public-validation", default=None, metavar="npz:PATH",
                   help="score trials exactly on this PUBLIC validation set (features in the "
                   "store's feature space, labels): costs no privacy")
    p.add_argument("--seed", type=int, default=None,
                   help="seed the r proposals and the holdout split (never the noise, which "
                   "always draws from OS entropy; the seed is not written to results)")
    p.add_argument("--out", default=None, help="write results JSON (with the ledger) here")
    p.add_argument("--model", default=None, help="write the final probe (w, b) as .npz here")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def _add_account(sub) -> None:
    p = sub.add_parser(
        "account",
        help="epsilon from a noise multiplier, or the noise multiplier for an epsilon",
        description="Privacy accounting of T Gaussian steps (Poisson-sampled if q < 1).",
        epilog=EPILOG,
    )
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--epsilon", type=_number(0, finite=False),
                       help="target epsilon: print sigma")
    group.add_argument("--noise-multiplier", "--sigma", type=_number(0, low_open=False),
                       dest="noise_multiplier", help="noise multiplier: print epsilon")
    p.add_argument("--delta", type=_number(0, 1, high_open=True), default=1e-5,
                   help="delta (default 1e-5)")
    p.add_argument("--steps", type=_int(1, MAX_STEPS), default=1,
                   help="number of steps T (default 1)")
    p.add_argument("--sampling-probability", "-q", type=_number(0, 1), default=1.0,
                   help="Poisson sampling rate q (default 1: full batch)")
    p.add_argument("--accountant", choices=("pld", "rdp"), default="pld")
    p.add_argument("--json", action="store_true", help="print JSON")


def _add_demo(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="extract the embedded default data and run the epsilon sweep",
        description="Fashion-MNIST (Debian's dataset-fashion-mnist) or, when absent, "
        "scikit-learn digits -> ScatterNet features -> full-batch DP-SGD with momentum "
        "(T=20) over epsilon in {0.5, 1, 2, 4, 8, inf}, delta 1e-5, 3 seeds.",
        epilog=EPILOG,
    )
    p.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    p.add_argument("--data", choices=("fashion-mnist", "digits"), default=None,
                   help="force a dataset (default: fashion-mnist if installed, else digits)")
    p.add_argument("--seeds", type=_int(1), default=3)
    p.add_argument("--quiet", action="store_true")


def _selection(args) -> str:
    """tune's selection: "public" with --public-validation, which --selection cannot change."""
    if args.public_validation is None:
        return args.selection or "train"
    if args.selection is not None:
        raise ValueError(f"--public-validation scores trials exactly on public data; it does not "
                         f"combine with --selection {args.selection}")
    return "public"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dpprobe",
        description="Differentially private transfer learning on images: extract frozen-"
        "backbone features once into a Zarr cache, then train DP linear probes on it.",
        epilog=EPILOG,
    )
    parser.add_argument("--version", action="version", version="dpprobe 0.1.0")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_extract(sub)
    _add_probe(sub)
    _add_tune(sub)
    _add_account(sub)
    _add_verify_info(sub)
    _add_demo(sub)
    return parser


def _probe_kwargs(args) -> dict:
    return {
        "delta": args.delta,
        "seeds": args.seeds,
        "optimizer": args.optimizer,
        "steps": args.steps,
        "learning_rates": args.lr,
        "loss": args.loss,
        "clip_norm": args.clip_norm,
        "accountant": args.accountant,
        "normalization": args.normalize,
        "groups": args.groups or 1,
        "bias_init": args.bias_init,
        "sampling_probability": args.sampling_probability,
        "physical_batch_size": args.physical_batch_size,
        "stream": args.stream,
        "devices": args.devices,
        "out": args.out,
        "csv": args.csv,
        "plot": args.plot,
        "diagnostics": args.diagnostics,
        "quiet": args.quiet,
    }


def _enable_jax_cache() -> None:
    """Persist compiled programs across CLI runs (a repeated sweep skips XLA compilation).

    Compiled code never changes results or privacy; DPPROBE_JAX_CACHE=0 turns this off.
    """
    if os.environ.get("DPPROBE_JAX_CACHE", "1") == "0":
        return
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    settings = {"jax_compilation_cache_dir": os.path.join(base, "dpprobe", "jax"),
                "jax_persistent_cache_min_compile_time_secs": 0.1}
    # Compiled probe programs, which a fresh process need not even trace (probe.executables).
    os.environ.setdefault("DPPROBE_EXECUTABLE_CACHE",
                          os.path.join(base, "dpprobe", "executables"))
    if "jax" in sys.modules:
        import jax

        for name, value in settings.items():
            jax.config.update(name, value)
    else:  # read by JAX when it is imported; not importing it here lets the job import it
        # while it reads the store (see `jobs.run_probe`). A user's own JAX_* setting wins.
        for name, value in settings.items():
            os.environ.setdefault(name.upper(), str(value))


def _run(args) -> int:
    from pipelines import jobs

    if args.command in ("probe", "tune", "demo"):
        _enable_jax_cache()

    if args.command == "extract":
        reports = jobs.run_extract(
            backbone=args.backbone,
            data=args.data,
            out=args.out,
            split=args.split,
            data_dir=args.data_dir,
            weights=args.weights,
            random_init=args.random_init,
            seed=args.seed,
            resize=args.resize,
            crop=args.crop,
            batch_size=args.batch_size,
            dtype=args.dtype,
            device=args.device,
            rows_per_chunk=args.rows_per_chunk,
            overwrite=args.overwrite,
            progress=not args.quiet,
            num_workers=args.workers,
            amp=args.amp,
            channels_last=args.channels_last,
            compile=args.compile,
            shard=args.shard,
            views=args.views,
            augment=args.augment,
            augment_seed=args.augment_seed,
            num_classes=args.num_classes,
            ray=args.ray,
            ray_address=args.ray_address,
            ray_shards=args.ray_shards,
        )
        if args.shard is not None:
            return 0  # a shard finished its chunks; the split completes with the last shard
        return 0 if all(r.complete for r in reports) else 1
    if args.command == "verify":
        report = jobs.verify(args.store, data=args.data, data_dir=args.data_dir,
                             progress=not args.quiet)
        for split, info in report.splits.items():
            print(f"{split}: {info}")
        for problem in report.problems:
            print(f"PROBLEM {problem}")
        print("OK" if report.ok else f"{len(report.problems)} problem(s)")
        return 0 if report.ok else 1
    if args.command == "info":
        if args.json:
            from extract import store_summary

            print(json.dumps(store_summary(args.store), indent=2, default=str))
        else:
            print(jobs.store_info(args.store))
        return 0
    if args.command == "probe":
        results = jobs.run_probe(args.store, epsilons=args.epsilons, **_probe_kwargs(args))
        print(jobs.probe_table(results))
        if args.out and not args.quiet:
            print(f"wrote {args.out} ({results['wall_seconds']:.2f} s)", file=sys.stderr)
        return 0
    if args.command == "tune":
        results = jobs.run_tune(
            args.store,
            epsilon=args.epsilon,
            delta=args.delta,
            out=args.out,
            model=args.model,
            eps0=args.eps0,
            eps1=args.eps1,
            trials=args.trials,
            search=args.search,
            r_range=(args.r_min, args.r_max),
            steps_choices=args.steps_choices,
            final_steps=args.final_steps,
            optimizer=args.optimizer,
            loss=args.loss,
            clip_norm=args.clip_norm,
            normalization=args.normalize,
            groups=args.groups or 1,
            selection=_selection(args),
            eps_select=args.eps_select,
            validation_fraction=args.validation_fraction,
            public_validation=args.public_validation,
            seed=args.seed,
            quiet=args.quiet,
        )
        print(jobs.tune_report(results))
        return 0
    if args.command == "account":
        result = jobs.account(
            delta=args.delta,
            epsilon=args.epsilon,
            noise_multiplier=args.noise_multiplier,
            steps=args.steps,
            sampling_probability=args.sampling_probability,
            accountant=args.accountant,
        )
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            q = args.sampling_probability
            sampling = "full batch" if q == 1 else f"Poisson q={q:g}"
            print(f"noise multiplier {result['noise_multiplier']:.6g}, {args.steps} step(s), "
                  f"{sampling} -> epsilon {result['epsilon']:.6g} at delta {args.delta:g} "
                  f"({args.accountant.upper()}, zero-out neighbours)")
        return 0
    if args.command == "demo":
        results = jobs.run_demo(args.out, data=args.data, seeds=args.seeds,
                                progress=not args.quiet)
        print(jobs.probe_table(results))
        print(f"wrote {args.out}/results.json", file=sys.stderr)
        return 0
    raise AssertionError(args.command)


def _check_combinations(args) -> None:
    """Options that only mean something together: refuse them apart, never ignore them."""
    command = args.command
    if command == "extract":
        if args.views is not None and args.views > 1 and not args.augment:
            raise ValueError(f"--views {args.views} without --augment would store identical "
                             "views; add --augment flip,crop")
        if args.augment and args.views is None:
            raise ValueError("--augment needs --views K (K augmented views per example)")
        if args.ray and args.shard is not None:
            raise ValueError("--ray launches the shards itself; drop --shard")
        if (args.ray_shards is not None or args.ray_address) and not args.ray:
            raise ValueError("--ray-shards/--ray-address need --ray")
        if args.weights is not None and args.random_init:
            raise ValueError("--weights and --random-init exclude each other")
    if command in ("probe", "tune"):
        if args.groups is not None and args.normalize != "group":
            raise ValueError(f"--groups {args.groups} needs --normalize group "
                             f"(got --normalize {args.normalize})")
    if command == "tune":
        if args.r_min >= args.r_max:
            raise ValueError(f"--r-min ({args.r_min:g}) must be below --r-max ({args.r_max:g})")


def _quiet_closed_stdout() -> None:
    """The reader of our stdout went away (`dpprobe info STORE | head`): stop writing, quietly."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


# Exit status when stdout's reader has gone: as if killed by SIGPIPE (128 + 13), like `yes`.
EXIT_CLOSED_PIPE = 141


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # --help, --version, or a one-line usage error (status 2)
        return stop.code if isinstance(stop.code, int) else 2
    try:
        _check_combinations(args)
        code = _run(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        _quiet_closed_stdout()
        return EXIT_CLOSED_PIPE
    except KeyboardInterrupt:
        print(f"dpprobe {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        # Bad input: a clear one-line error, no traceback (set DPPROBE_DEBUG=1 for one).
        if os.environ.get("DPPROBE_DEBUG"):
            raise
        print(f"dpprobe {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2


def _one_line(err: BaseException) -> str:
    """The message of an error, on one line, naming the file of an OS error."""
    if isinstance(err, KeyError) and err.args:
        text = str(err.args[0])
    elif isinstance(err, OSError) and err.filename is not None and err.strerror:
        text = f"{err.filename}: {err.strerror}"
    elif isinstance(err, MemoryError):
        text = "out of memory; use fewer runs (--seeds, --epsilons, --steps, --lr) or --stream"
    elif isinstance(err, (ValueError, FileNotFoundError, RuntimeError)):
        text = str(err)
    else:  # not an anticipated input error: say what it is
        text = f"unexpected {type(err).__name__}: {err} (DPPROBE_DEBUG=1 shows the traceback)"
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " ".join(lines) if len(lines) <= 3 else lines[0]


def entry() -> None:
    """The `dpprobe` console script: `main`, then a fast exit once every output is written.

    Tearing down an interpreter that has loaded JAX (its CPU client, thousands of modules) takes
    ~0.3 s, a sixth of a whole probe sweep. So once the command has returned, stdout/stderr are
    flushed, the atexit handlers run (JAX's, Ray's shutdown, multiprocessing's), and the process
    leaves with `os._exit`. If a non-daemon thread is still alive, the normal exit joins it.
    """
    code = main()
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _quiet_closed_stdout()
        code = EXIT_CLOSED_PIPE
    sys.stderr.flush()
    if any(t.is_alive() and not t.daemon for t in threading.enumerate()
           if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()
    with contextlib.suppress(BrokenPipeError):
        sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
