"""What a probe job is asked: `ProbeConfig`, its fields' checks and command-line options, and
the options of the probe's recipe that `dpprobe tune` shares (one text each)."""

from __future__ import annotations

import dataclasses
import math

from dpprobe import checks
from dpprobe.options import (
    LOSSES,
    NORMALIZATIONS,
    OPTIMIZERS,
    accountant_option,
    delta_option,
    flag,
    integer,
    integers,
    number,
    numbers,
    option,
    process_fields,
)

__all__ = [
    "MAX_RUNS", "ProbeConfig", "check_learning_rates", "clip_norm_option", "groups_option",
    "loss_option", "normalization_option", "store_option",
]

# Runs of one sweep (their weights, optimizer state and gradients live together in memory).
MAX_RUNS = 100_000


def store_option():
    return option(positional=True, help="feature store written by `dpprobe extract`")


def loss_option():
    return option("softmax", choices=LOSSES, metavar="LOSS", help="%(choices)s: softmax "
                  "cross-entropy (default), or one-vs-all sigmoid (bias init -10)")


def clip_norm_option():
    return option(1.0, type=number, help="per-example clip norm C (default %(default)s)")


def normalization_option():
    return option(None, "--normalize", choices=NORMALIZATIONS, metavar="NORM",
                  help="%(choices)s: per-example feature normalization (costs no privacy; "
                  "default: from the store's backbone: group over ScatterNet's channel groups, "
                  "else none)")


def groups_option():
    return option(None, type=integer, help="groups of --normalize group (default: 27 on "
                  "ScatterNet's channels, else 1); --groups alone means --normalize group")


@dataclasses.dataclass(frozen=True)
@process_fields
class ProbeConfig:
    """What `run_probe` does; `dpprobe probe --help` explains each option.

    Full batch by default: T steps of the Gaussian mechanism on the clipped gradient sum. With
    `sampling_probability` q < 1, masked DP-SGD with Poisson subsampling (Beltran et al.).
    `math.inf` in `epsilons` trains a non-private reference (no noise, no guarantee).

    Attributes:
      optimizer, steps, learning_rates, normalization: None (the defaults) chooses them from
        public quantities (`probe.recipe`: the store's backbone, N, epsilon, delta):
        GroupNorm on ScatterNet features, full-batch momentum, T = 300, lr = r / T per epsilon
        by the linear scaling rule. A given optimizer other than sgd/momentum takes T = 1 and
        its default learning rate unless told.
      stream: stream the train split from disk chunk by chunk (None: when it would take more
        than a quarter of the machine's memory as float32).
      devices: shard rows over this many local devices (default 1).
      groups: groups of `normalization="group"` (None: the backbone's, 27 on ScatterNet,
        else 1; given, it needs that normalization).
      out, csv, plot: write results JSON, a per-run CSV, an accuracy-vs-epsilon PNG (DP
        outputs and public inputs only, see `accounting.records`).
      diagnostics: write exact statistics of the private data (clipped fractions, sampled batch
        sizes, the data fingerprint) to this local file, for debugging; never share it.
      save_model: a folder for one model file per epsilon (its first seed's run;
        `dpprobe.model_files.probe_models`).
      coordinator, num_processes, process_id, process_timeout: run as one of several
        processes (`multihost.processes`: each reads its own rows, process 0 writes).
    """

    store: str = store_option()
    epsilons: tuple[float, ...] = option(
        (0.5, 1.0, 2.0, 4.0, 8.0), type=numbers, help="target epsilons, comma-separated "
        "(default 0.5,1,2,4,8); add inf for a non-private reference: the same recipe without "
        "noise, no guarantee")
    delta: float = delta_option()
    seeds: int = option(3, type=integer, help="independent runs per config, each with fresh "
                        "noise (default %(default)s)")
    optimizer: str | None = option(None, choices=OPTIMIZERS, metavar="NAME", help="%(choices)s: "
                                   "update rule on the privatized gradient (default momentum)")
    steps: tuple[int, ...] | None = option(
        None, type=integers, help="full-batch steps T, comma-separated to sweep (default 300; "
        "1 with --optimizer adam, sign or lamb)")
    learning_rates: tuple[float, ...] | None = option(
        None, "--lr", type=numbers, metavar="LR", help="learning rate(s), comma-separated "
        "(default: momentum and sgd r / T per epsilon, r by the linear scaling rule from "
        "epsilon, delta and N; 1e-3 else)")
    loss: str = loss_option()
    clip_norm: float = clip_norm_option()
    accountant: str = accountant_option(", tight")
    normalization: str | None = normalization_option()
    groups: int | None = groups_option()
    bias_init: float | None = option(
        None, type=number, help="initial bias (default 0 for softmax, -10 for sigmoid)")
    sampling_probability: float = option(
        1.0, "--sampling-probability", "-q", type=number, help="Poisson sampling rate q; q < 1 "
        "trains masked DP-SGD on Poisson-sampled minibatches (Beltran et al.) instead of full "
        "batch (default %(default)s)")
    physical_batch_size: int = option(
        256, type=integer, help="rows per compiled kernel call with q < 1 (default %(default)s)")
    stream: bool | None = option(
        None, action="store_true", exclusive="stream", help="stream the train split from disk "
        "chunk by chunk (default: when it exceeds a quarter of RAM as float32)",
        flags=(flag("--in-memory", action="store_false",
                    help="load the train split into memory"),))
    devices: int | None = option(
        None, type=integer, help="shard rows over this many local devices (data parallel)")
    out: str | None = option(None, help="write results JSON here")
    csv: str | None = option(None, help="write one CSV row per run here")
    plot: str | None = option(None, help="write a PNG of accuracy vs epsilon here")
    diagnostics: str | None = option(
        None, metavar="PATH", help="write exact statistics of the private data (clipped "
        "fractions, batch sizes, data fingerprint) to this local file for debugging: not DP, "
        "never share it")
    save_model: str | None = option(
        None, metavar="DIR", help="write one model file per epsilon (its first seed's run) "
        "into DIR, named by epsilon (eps1.safetensors), for `dpprobe predict` and `export`")
    quiet: bool = option(False, action="store_true", help="print only the table")

    def __post_init__(self):
        checks.check_processes(self)
        learning_rates = check_learning_rates(self.learning_rates)
        checks.freeze(
            self, store=str(self.store),
            epsilons=checks.check_unique("epsilons",
                                         checks.check_epsilons("epsilons", self.epsilons)),
            delta=checks.check_delta("delta", self.delta),
            steps=None if self.steps is None else checks.check_unique(
                "steps", checks.check_ints("steps", self.steps)),
            learning_rates=learning_rates and checks.check_unique("learning_rates", learning_rates),
            clip_norm=checks.check_number("clip_norm", self.clip_norm, 0),
            sampling_probability=checks.check_number("sampling_probability",
                                                  self.sampling_probability, 0, 1),
        )
        checks.check_int("seeds", self.seeds)
        checks.check_int("physical_batch_size", self.physical_batch_size)
        checks.check_groups(self)
        if self.bias_init is not None:
            checks.check_number("bias_init", self.bias_init)
        checks.check_optional_ints(self, ("devices",))
        runs = (len(self.epsilons) * len(self.steps or [1]) * len(self.learning_rates or [None])
                * self.seeds)
        if runs > MAX_RUNS:
            raise ValueError(f"the sweep has {runs} runs (`epsilons` x `steps` x "
                             f"`learning_rates` x `seeds`); at most {MAX_RUNS} train in one "
                             "program: use fewer `seeds`")


def check_learning_rates(values) -> tuple[float, ...] | None:
    """None (the optimizer's default), or finite learning rates > 0."""
    if values is None:
        return None
    values = tuple(float(v) for v in values)
    if not values or any(not 0 < v < math.inf for v in values):
        raise checks.ConfigError("learning_rates", f"expected finite numbers > 0, got "
                              f"{','.join(f'{v:g}' for v in values)}")
    return values


