"""The options of each `dpprobe` command: argparse types that turn text into values, and the
arguments, whose destinations are the command's config fields (`pipelines.cli` builds the
config; the config checks the values)."""

from __future__ import annotations

import argparse
import collections.abc
import functools
import importlib

from pipelines.demo_job import DEMO_DATA
from pipelines.tune_job import TuneConfig

EPILOG = """\
Privacy: every epsilon is for zero-out neighbours (one record replaced by a null record; the
dataset size N is public), computed from the DpEvent of what ran, with the PLD accountant{}.
Noise and batch sampling always draw from OS entropy."""

# ---- Types ---------------------------------------------------------------------------------------


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from err


def _numbers(text: str) -> list[float]:
    """Comma-separated numbers; inf is one, nan is not."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from err
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one number, got {text!r}")
    if any(v != v for v in values):
        raise argparse.ArgumentTypeError(f"nan is not a value, got {text!r}")
    return values


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from err


def _integers(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from err
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one integer, got {text!r}")
    return values


def _shard(text: str) -> tuple[int, int]:
    try:
        index, count = (int(v) for v in text.split("/"))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected K/N, e.g. 0/4, got {text!r}") from err
    return index, count


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


class _Choices(collections.abc.Sequence):
    """A package's constant as `choices`, imported when argparse first needs it (a value given,
    --help): importing `probe` loads JAX, which a probe job imports while it reads the store
    (`probe_job._read_splits`), not before."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    @functools.cached_property
    def values(self) -> tuple[str, ...]:
        return tuple(getattr(importlib.import_module(self.module), self.name))

    def __getitem__(self, index):
        return self.values[index]

    def __len__(self) -> int:
        return len(self.values)


OPTIMIZERS = _Choices("dp", "OPTIMIZERS")
LOSSES = _Choices("probe", "LOSSES")
NORMALIZATIONS = _Choices("probe", "NORMALIZATIONS")


class _RangeEnd(argparse.Action):
    """`--r-min` / `--r-max`: one end of `TuneConfig.r_range`."""

    def __init__(self, *args, end: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.end = end

    def __call__(self, parser, namespace, value, option_string=None):
        bounds = list(getattr(namespace, self.dest, TuneConfig.r_range))
        bounds[self.end] = value
        setattr(namespace, self.dest, tuple(bounds))


# ---- Options of each command ---------------------------------------------------------------------


def extract(p) -> None:
    from extract import AUGMENTATIONS  # imports torch, as the job does
    from extract.store import FEATURE_DTYPES

    p.add_argument("--backbone", required=True,
                   help="timm model name (e.g. vit_base_patch16_224.augreg_in21k), "
                   "'scatternet', or 'none' for precomputed embeddings")
    p.add_argument("--data", required=True, help="data spec (see below)")
    p.add_argument("--out", required=True, help="output Zarr store path")
    p.add_argument("--split", choices=("train", "test", "all"),
                   help="split to write: for npz/imagefolder the name given to the data "
                   "(default train); for multi-split sources, restrict to one (default all)")
    p.add_argument("--data-dir",
                   help="directory of Fashion-MNIST's gzipped IDX files "
                   "(default /usr/share/datasets/fashion-mnist)")
    p.add_argument("--weights",
                   help="local .safetensors/.pth weights file for the timm model (no hub)")
    p.add_argument("--random-init", action="store_true",
                   help="random weights (seeded by --seed); for tests only")
    p.add_argument("--seed", type=_integer, help="seed of --random-init (default 0)")
    p.add_argument("--resize", type=_integer,
                   help="resize the short side to R before cropping (Mehta et al.: 384)")
    p.add_argument("--crop", type=_integer,
                   help="center-crop to S x S (Mehta et al.: 256); ViTs adapt their "
                   "position embeddings")
    p.add_argument("--batch-size", type=_integer, help="images per forward pass (default 256)")
    p.add_argument("--dtype", choices=FEATURE_DTYPES,
                   help="feature dtype in the store (default float16)")
    p.add_argument("--device", help="torch device (default: cuda if available)")
    p.add_argument("--rows-per-chunk", type=_integer,
                   help="rows per Zarr chunk (default: ~8 MiB chunks)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing split written by a different job")
    p.add_argument("--workers", dest="num_workers", type=_integer,
                   help="DataLoader worker processes (default: none on CPU, where the "
                   "backbone uses every core; up to 8 on GPU)")
    p.add_argument("--amp", choices=("auto", "off", "bf16", "fp16"),
                   help="autocast: auto = bf16 on CUDA, off on CPU (default auto)")
    p.add_argument("--channels-last", action="store_true", help="channels_last memory format")
    p.add_argument("--compile", action="store_true", help="torch.compile the backbone")
    p.add_argument("--shard", type=_shard, metavar="K/N",
                   help="extract only shard K of N (a chunk-aligned slice of rows) into the "
                   "same store, e.g. one process per GPU or a SLURM array task")
    p.add_argument("--ray", action="store_true",
                   help="run the shards as Ray tasks (one per GPU) on a Ray cluster")
    p.add_argument("--ray-address",
                   help="Ray cluster address (default: RAY_ADDRESS, or a local cluster)")
    p.add_argument("--ray-shards", type=_integer,
                   help="number of shards with --ray (default: one per GPU, else per CPU)")
    p.add_argument("--views", type=_integer,
                   help="store K augmented views per example, shape (N, K, d), for "
                   "augmentation multiplicity in the probe (train split only)")
    p.add_argument("--augment", type=_names,
                   help=f"augmentations of the views, from {','.join(AUGMENTATIONS)} "
                   "(De et al.)")
    p.add_argument("--augment-seed", type=_integer, help="seed of the augmentations (default 0)")
    p.add_argument("--num-classes", type=_integer, metavar="K",
                   help="declare K classes for a source without class names (an npz without "
                   "class_names); labels must lie in [0, K). Never inferred from the labels")
    p.add_argument("--quiet", dest="progress", action="store_false", help="no progress bar")


def verify(p) -> None:
    p.add_argument("store", nargs="?", help="feature store (omit it to check --data alone)")
    p.add_argument("--data",
                   help="also re-fingerprint this data spec and compare with the recorded one; "
                   "without STORE, list the records a publishing job would train as null "
                   "records, clamp or resize (for the data's owner, not a DP output)")
    p.add_argument("--data-dir", help="Fashion-MNIST directory for --data")
    p.add_argument("--quiet", dest="progress", action="store_false")


def info(p) -> None:
    p.add_argument("store")
    p.add_argument("--json", action="store_true", help="print all attributes as JSON")


def _model(p) -> None:
    """Loss, clipping and feature normalization: shared by `probe` and `tune`."""
    p.add_argument("--loss", choices=LOSSES, metavar="LOSS",
                   help="%(choices)s: softmax cross-entropy (default), or one-vs-all sigmoid "
                   "(bias init -10)")
    p.add_argument("--clip-norm", type=_number, help="per-example clip norm C (default 1)")
    p.add_argument("--normalize", dest="normalization", choices=NORMALIZATIONS, metavar="NORM",
                   help="%(choices)s: per-example feature normalization (costs no privacy; "
                   "default: from the store's backbone: group over ScatterNet's channel "
                   "groups, else none)")
    p.add_argument("--groups", type=_integer,
                   help="groups of --normalize group (default 1; on ScatterNet: 27); "
                   "--groups alone means --normalize group")


def probe(p) -> None:
    from accounting import ACCOUNTANTS

    p.add_argument("store", help="feature store written by `dpprobe extract`")
    p.add_argument("--epsilons", type=_numbers,
                   help="target epsilons, comma-separated (default 0.5,1,2,4,8); add inf for a "
                   "non-private reference: the same recipe without noise, no guarantee")
    p.add_argument("--delta", type=_number, help="target delta (default 1e-5)")
    p.add_argument("--seeds", type=_integer,
                   help="independent runs per config, each with fresh noise (default 3)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, metavar="NAME",
                   help="%(choices)s: update rule on the privatized gradient (default momentum)")
    p.add_argument("--steps", type=_integers, help="full-batch steps T, comma-separated to "
                   "sweep (default 300; 1 with --optimizer adam, sign or lamb)")
    p.add_argument("--lr", dest="learning_rates", type=_numbers, metavar="LR",
                   help="learning rate(s), comma-separated (default: momentum and sgd r / T per "
                   "epsilon, r by the linear scaling rule from epsilon, delta and N; 1e-3 else)")
    _model(p)
    p.add_argument("--bias-init", type=_number,
                   help="initial bias (default 0 for softmax, -10 for sigmoid)")
    p.add_argument("--accountant", choices=ACCOUNTANTS,
                   help="privacy accountant (default pld, tight)")
    p.add_argument("--sampling-probability", "-q", type=_number,
                   help="Poisson sampling rate q; q < 1 trains masked DP-SGD on Poisson-"
                   "sampled minibatches (Beltran et al.) instead of full batch (default 1)")
    p.add_argument("--physical-batch-size", type=_integer,
                   help="rows per compiled kernel call with q < 1 (default 256)")
    stream = p.add_mutually_exclusive_group()
    stream.add_argument("--stream", action="store_true",
                        help="stream the train split from disk chunk by chunk (default: when "
                        "it exceeds a quarter of RAM as float32)")
    stream.add_argument("--in-memory", dest="stream", action="store_false",
                        help="load the train split into memory")
    p.add_argument("--devices", type=_integer,
                   help="shard rows over this many local devices (data parallel)")
    p.add_argument("--out", help="write results JSON here")
    p.add_argument("--csv", help="write one CSV row per run here")
    p.add_argument("--plot", help="write a PNG of accuracy vs epsilon here")
    p.add_argument("--diagnostics", metavar="PATH",
                   help="write exact statistics of the private data (clipped fractions, batch "
                   "sizes, data fingerprint) to this local file for debugging: not DP, never "
                   "share it")
    p.add_argument("--quiet", action="store_true", help="print only the table")


def tune(p) -> None:
    from pipelines.search import EXTRAPOLATIONS, SEARCH_CHOICES, SELECTIONS

    p.add_argument("store", help="feature store written by `dpprobe extract`")
    p.add_argument("--epsilon", type=_number, required=True,
                   help="total epsilon, tuning included")
    p.add_argument("--delta", type=_number, help="delta (default 1e-5)")
    p.add_argument("--eps0", type=_number,
                   help="budget of the first search stage (default epsilon/20)")
    p.add_argument("--eps1", type=_number,
                   help="budget of the second search stage (default epsilon/10)")
    p.add_argument("--trials", type=_integer, help="trials per stage (default 5)")
    p.add_argument("--search", choices=SEARCH_CHOICES, help="auto: search when N and epsilon "
                   "let it tell r apart, else spend all on the default r (default); random "
                   "(log-uniform) or grid search over r; none: never search")
    p.add_argument("--r-min", dest="r_range", type=_number, action=_RangeEnd, end=0,
                   help="smallest r of stage 0 (default 1)")
    p.add_argument("--r-max", dest="r_range", type=_number, action=_RangeEnd, end=1,
                   help="largest r of stage 0 (default 1000)")
    p.add_argument("--extrapolation", choices=EXTRAPOLATIONS,
                   help="how r* is read off the two stages: Panda et al.'s line (linear), the "
                   "line clipped to the searched r range (clipped), or a power law (log)")
    p.add_argument("--steps-choices", type=_integers,
                   help="T values r is decomposed over, lr = r / T (default 25,50,100)")
    p.add_argument("--final-steps", type=_integer,
                   help="T of the final run (default 300)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, metavar="NAME",
                   help="%(choices)s: update rule (default momentum 0.9, as Panda et al.)")
    _model(p)
    p.add_argument("--standardize", action=argparse.BooleanOptionalAction,
                   help="standardize each feature with a privately released mean and scale "
                   "(Tramer & Boneh), paid from --eps-standardize (default: on after group or l2 "
                   "normalization)")
    p.add_argument("--eps-standardize", type=_number,
                   help="budget of the standardization (default epsilon/10)")
    p.add_argument("--selection", choices=[s for s in SELECTIONS if s != "public"],
                   help="how trials are scored, privately: noisy correct counts on the training "
                   "data, paid from --eps-select (train, default), or on a held-out part of train "
                   "that composes in parallel (holdout)")
    p.add_argument("--eps-select", type=_number,
                   help="budget of the noisy selection counts with --selection train "
                   "(default epsilon/20)")
    p.add_argument("--validation-fraction", type=_number,
                   help="share of train held out with --selection holdout (default 0.1)")
    p.add_argument("--public-validation", metavar="npz:PATH",
                   help="score trials exactly on this PUBLIC validation set (features in the "
                   "store's feature space, labels): costs no privacy")
    p.add_argument("--seed", type=_integer,
                   help="seed the r proposals and the holdout split (never the noise, which "
                   "always draws from OS entropy; the seed is not written to results)")
    p.add_argument("--out", help="write results JSON (with the ledger) here")
    p.add_argument("--save-model", "--model", dest="save_model", help="write the model file here")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def account(p) -> None:
    from accounting import ACCOUNTANTS

    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--epsilon", type=_number, help="target epsilon: print sigma")
    group.add_argument("--noise-multiplier", "--sigma", type=_number, dest="noise_multiplier",
                       help="noise multiplier: print epsilon")
    p.add_argument("--delta", type=_number, help="delta (default 1e-5)")
    p.add_argument("--steps", type=_integer, help="number of steps T (default 1)")
    p.add_argument("--sampling-probability", "-q", type=_number,
                   help="Poisson sampling rate q (default 1: full batch)")
    p.add_argument("--accountant", choices=ACCOUNTANTS, help="privacy accountant (default pld)")
    p.add_argument("--num-examples", type=_integer, metavar="N",
                   help="the dataset size N (public): warns when delta >= 1/N")
    p.add_argument("--json", action="store_true", help="print JSON")


def audit(p) -> None:
    p.add_argument("store", help="feature store written by `dpprobe extract`")
    p.add_argument("--epsilon", type=_number, required=True,
                   help="the claim audited: the noise is calibrated for it, as `dpprobe probe` "
                   "does")
    p.add_argument("--delta", type=_number, help="delta of the claim and the bounds (default 1e-5)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, metavar="NAME",
                   help="%(choices)s: update rule audited (default sgd, which releases the "
                   "noisy gradient itself: the tightest audit)")
    p.add_argument("--steps", type=_integer, help="full-batch steps T (default 1)")
    p.add_argument("--runs", type=_integer,
                   help="probes trained with the canary, and as many without (default 10000)")
    p.add_argument("--rows", type=_integer,
                   help="rows of the train split drawn at random to train on (default 1000)")
    p.add_argument("--loss", choices=LOSSES, metavar="LOSS", help="%(choices)s (default softmax)")
    p.add_argument("--clip-norm", type=_number, help="per-example clip norm C (default 1)")
    p.add_argument("--confidence", type=_number,
                   help="confidence of every lower bound (default 0.95)")
    p.add_argument("--runs-per-call", type=_integer,
                   help="runs per compiled call (speed and memory only)")
    p.add_argument("--out", help="write results JSON here")
    p.add_argument("--plot", help="write a PNG of the score histograms and trade-off curves here")
    p.add_argument("--quiet", action="store_true", help="print only the report")


def finetune(p) -> None:
    from accounting import ACCOUNTANTS
    from pipelines.finetune_job import DEFAULT_MODEL, FinetuneConfig

    d = FinetuneConfig  # the defaults shown in --help
    p.add_argument("--model", help=f"cnn (Tramer & Boneh's CNN), wrn16_4 (WRN-16-4 with "
                   f"GroupNorm + weight standardization), or a timm ViT name (vit_*, deit_*) "
                   f"(default {DEFAULT_MODEL})")
    p.add_argument("--data", help=f"data spec, as for extract (default {d.data})")
    p.add_argument("--test-data", help="the test split's data spec, for sources holding one "
                   "split (npz:PATH, imagefolder:PATH); public: its accuracy is published")
    p.add_argument("--data-dir", help="directory of Fashion-MNIST's gzipped IDX files")
    p.add_argument("--weights", help="local .safetensors/.pth weights of the timm model")
    p.add_argument("--random-init", action="store_true",
                   help="a timm model with random weights (seeded by --seed); for tests")
    p.add_argument("--resize", type=_integer,
                   help="resize each image's short side to R (default: the data's size)")
    p.add_argument("--crop", type=_integer,
                   help="center-crop S x S after --resize: the model's input side (default: "
                   "a square of the short side); ViTs adapt their position embeddings")
    p.add_argument("--epsilon", type=_number,
                   help=f"target epsilon; inf trains without noise (default {d.epsilon:g})")
    p.add_argument("--delta", type=_number, help=f"target delta (default {d.delta:g})")
    p.add_argument("--accountant", choices=ACCOUNTANTS, help="privacy accountant (default pld)")
    p.add_argument("--batch-size", type=_integer,
                   help="expected batch size B, q = B/N (default: largest 2^k <= N/5, <= 2048)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=_number,
                        help="length in epochs, T = epochs N / B (default: 30, or T >= 300)")
    length.add_argument("--steps", type=_integer, help="training length in steps T")
    p.add_argument("--lr", dest="learning_rate", type=_number,
                   help="learning rate (default 4 sqrt(B / 2048): 4 at B = 2048)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, metavar="NAME",
                   help=f"%(choices)s (default {d.optimizer})")
    p.add_argument("--momentum", type=_number, help=f"momentum (default {d.momentum:g})")
    p.add_argument("--schedule", choices=("constant", "cosine"),
                   help=f"learning-rate schedule (default {d.schedule})")
    p.add_argument("--warmup-steps", type=_integer, help="linear warm-up steps (default 0)")
    p.add_argument("--clip-norm", type=_number, help="per-example clip norm C "
                   "(default 0.1)")
    p.add_argument("--augmult", type=_integer, help=f"augmentation multiplicity K: views per "
                   f"example, averaged before clipping (default {d.augmult})")
    p.add_argument("--crop-padding", type=_integer,
                   help=f"random crops of the image padded by P pixels (default {d.crop_padding})")
    p.add_argument("--flip", action="store_true", help="random horizontal flips of the views")
    p.add_argument("--ema-decay", type=_number,
                   help=f"EMA of the parameters, 0 for none (default {d.ema_decay:g})")
    p.add_argument("--physical-batch-size", type=_integer,
                   help=f"examples per compiled call (default {d.physical_batch_size})")
    p.add_argument("--microbatch-size", type=_integer,
                   help="per-example gradients in microbatches of this size (less memory)")
    p.add_argument("--mixed-precision", action="store_true",
                   help="bfloat16 forward/backward; clipping and noise stay float32")
    p.add_argument("--devices", type=_integer, help="data parallel over N local devices")
    p.add_argument("--seed", type=_integer,
                   help="seed of the model's initialization only (default 0)")
    p.add_argument("--out", help="folder for results.json and model.safetensors; a rerun with "
                   "the same options resumes from its checkpoint")
    p.add_argument("--checkpoint-every", type=_integer,
                   help=f"steps between checkpoints (default {d.checkpoint_every})")
    p.add_argument("--audit-canaries", type=_integer, metavar="M",
                   help="one-run privacy audit (Steinke et al. 2023): add M canaries, each in "
                   "with probability 1/2 (seeded by --seed), and bound epsilon from below; the "
                   "model is then an audit model. Exit status 1 when the bound exceeds the "
                   "claim (default 0: off; 5000 gives a tight audit)")
    p.add_argument("--audit-kind", choices=("gradient", "image"),
                   help="gradient (default): white-box gradient canaries, a rigorous lower "
                   "bound and an estimate of epsilon; image: black-box noise images (loose)")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def demo(p) -> None:
    p.add_argument("--out", dest="out_dir", help="output directory (default runs/demo)")
    p.add_argument("--data", choices=DEMO_DATA,
                   help="force a dataset (default: fashion-mnist if installed, else digits)")
    p.add_argument("--seeds", type=_integer, help="runs per epsilon (default 1)")
    p.add_argument("--quiet", dest="progress", action="store_false", help="only the report")


# The parser texts of each command (help, description, epilog).
TEXTS = {
    "extract": dict(
        help="run a frozen backbone over a dataset into a Zarr feature store",
        description="Embed a dataset with a frozen backbone and write STORE/{train,test}. "
        "Rerunning an interrupted command resumes from the last complete chunk.",
        epilog="Data specs: fashion-mnist, digits, npz:PATH (images, labels), "
        "imagefolder:PATH (one folder per class), cifar10:PATH, cifar100:PATH. "
        "Backbones: any timm model name (optionally .tag), scatternet, or none (npz:PATH "
        "holding features and labels).",
    ),
    "finetune": dict(
        allow_abbrev=False,
        help="train every weight of a backbone with DP-SGD on images",
        description="DP-SGD on a whole model (Flax NNX): Poisson-sampled batches, per-example "
        "clipping, augmentation multiplicity, EMA (De et al.; Beltran et al.). Reports the "
        "test accuracy at the (epsilon, delta) it spent.",
        epilog=EPILOG.format(" unless --accountant rdp"),
    ),
    "probe": dict(
        allow_abbrev=False,  # `--seed` must not silently mean `--seeds`
        help="train DP linear probes on a feature store over a sweep of epsilons",
        description="Full-batch DP linear probe (zero init) for every epsilon x steps x lr x "
        "seed, in one compiled program; prints test accuracy mean ± std over seeds.",
        epilog=EPILOG.format(" unless --accountant rdp"),
    ),
    "tune": dict(
        allow_abbrev=False,  # `--seed` must not silently mean `--seeds`
        help="private hyperparameter search (linear scaling rule) + final probe",
        description="Panda et al.'s linear scaling rule: search r = lr x T at budgets eps0 "
        "and eps1, fit r = alpha * epsilon + b, extrapolate, train the final full-batch "
        "DP-SGD probe with the remaining budget. The total epsilon includes every trial.",
        epilog=EPILOG.format(""),
    ),
    "account": dict(
        help="epsilon from a noise multiplier, or the noise multiplier for an epsilon",
        description="Privacy accounting of T Gaussian steps (Poisson-sampled if q < 1).",
        epilog=EPILOG.format(" unless --accountant rdp"),
    ),
    "audit": dict(
        help="measure the privacy a probe's mechanism at least lacks, with canaries",
        description="Train probes with a crafted canary row and with a null record in its "
        "place (the production trainer and mechanism, noise calibrated for --epsilon), score "
        "each, and bound epsilon from below at --delta: the Gaussian-DP fit and the "
        "Clopper-Pearson bound, with the ratio to the claim. Exit status 1 when a lower bound "
        "exceeds the claim.",
        epilog="A lower bound for this canary and this threat model, not a proof of privacy. "
        "The claim is for zero-out neighbours (one record replaced by a null record; N public), "
        "computed with the PLD accountant; noise keys and the row sample draw from OS entropy.",
    ),
    "verify": dict(
        help="check a feature store: completeness, shapes, NaN/Inf, labels, checksums",
        description="Reads every chunk: reports missing or incomplete splits, shape and dtype "
        "mismatches, NaN/Inf, labels out of range, and chunks whose sha256 differs from the "
        "one recorded when they were written. Exit status 1 if anything is wrong.",
    ),
    "info": dict(
        help="print a feature store's provenance",
        description="Backbone, weights, preprocessing, dataset fingerprint, shapes and "
        "completion of every split.",
    ),
    "demo": dict(
        help="show the privacy/utility trade-off: extract, sweep epsilon, tune privately",
        description="Fashion-MNIST (or, when absent, digits) -> ScatterNet features (reused "
        "by later runs) -> dpprobe probe's defaults at epsilon 0.5, 1, 2, 4, 8 and without "
        "noise (table, plot) -> dpprobe tune at epsilon 3, every cost paid; delta 1e-5.",
        epilog=EPILOG.format(""),
    ),
}
