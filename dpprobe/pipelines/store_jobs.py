"""The data owner's checks: verify (a feature store's every chunk, optionally against the
source data; or raw data alone, `--data` without a store: the records a publishing job's rule
would change) and info (a store's provenance). Their output is private to the owner."""

from __future__ import annotations

import dataclasses
import sys

from dpprobe import checks, extract
from dpprobe.extract.verify import source_fingerprints
from dpprobe.options import num_classes_option, option

__all__ = ["InfoConfig", "VerifyConfig", "store_info", "verify"]


@dataclasses.dataclass(frozen=True)
class VerifyConfig:
    """The store to verify; `data` (with `data_dir` for fashion-mnist) re-fingerprints a data
    spec and compares it with the recorded one. Without a store, `data` is checked alone
    (`extract.check_data`: the records a publishing job would null, clamp or resize)."""

    store: str | None = option(None, positional=True, nargs="?",
                               help="feature store (omit it to check --data alone)")
    data: str | None = option(
        None, help="also re-fingerprint this data spec and compare with the recorded one; "
        "without STORE, list the records a publishing job would train as null records, clamp "
        "or resize (for the data's owner, not a DP output)")
    data_dir: str | None = option(None, help="Fashion-MNIST directory for --data")
    num_classes: int | None = num_classes_option()
    progress: bool = option(True, "--quiet", action="store_false")

    def __post_init__(self):
        if self.store is None and self.data is None:
            raise checks.ConfigError("store", "give a store to verify, or `data` to check raw data")
        checks.check_optional_ints(self, ("num_classes",))


@dataclasses.dataclass(frozen=True)
class InfoConfig:
    """The store whose provenance to show."""

    store: str = option(positional=True)


def verify(config: VerifyConfig | str | None = None, /,
           **options) -> extract.VerifyReport | extract.DataReport:
    """`extract.verify_store`, optionally re-fingerprinting the source data; or, without a
    store, `extract.check_data` on the data alone.

    Takes a `VerifyConfig`, or the store and the config's other fields as keywords. A source
    with its own splits (fashion-mnist, digits, cifar) is compared split by split. A
    single-split source (npz, imagefolder) is compared with the split it was extracted into:
    the one that recorded this data spec, else the one whose fingerprint it matches.

    Returns:
      the store's `VerifyReport`, or for data alone a `DataReport` (private to the data's
      owner: it names records and quotes their values). Either has `ok`.
    """
    config = checks.make_config(VerifyConfig, config, "store", **options)
    if config.store is None:
        return extract.check_data(config.data, data_dir=config.data_dir,
                                  num_classes=config.num_classes)
    fingerprints, extra_problems = None, []
    if config.data:
        fingerprints, extra_problems = source_fingerprints(config.store, config.data,
                                                          data_dir=config.data_dir)
    bar = None
    if config.progress:
        from tqdm.auto import tqdm  # imported when a bar is shown, not at the CLI's start

        bar = tqdm(unit="chunk", desc="verify", file=sys.stderr, dynamic_ncols=True,
                   leave=False)

    def tick(split, chunk, total):
        if bar is not None:
            bar.set_description(f"verify {split}")
            bar.update(1)

    try:
        report = extract.verify_store(config.store, fingerprints=fingerprints, progress=tick)
    finally:
        if bar is not None:
            bar.close()
    report.problems.extend(extra_problems)
    return report


def store_info(config: InfoConfig | str, /) -> str:
    """The provenance of a store, for people."""
    store = config.store if isinstance(config, InfoConfig) else config
    return extract.format_store_info(store, extract.store_summary(store))


# `dpprobe verify`'s parser texts (help, description, epilog).
VERIFY_TEXTS = dict(
    help="check a feature store: completeness, shapes, NaN/Inf, labels, checksums",
    description="Reads every chunk: reports missing or incomplete splits, shape and dtype "
    "mismatches, NaN/Inf, labels out of range, and chunks whose sha256 differs from the "
    "one recorded when they were written. Exit status 1 if anything is wrong.",
)


# `dpprobe info`'s parser texts (help, description, epilog).
INFO_TEXTS = dict(
    help="print a feature store's provenance",
    description="Backbone, weights, preprocessing, dataset fingerprint, shapes and "
    "completion of every split.",
)


def add_verify_output(p) -> None:
    """`--json`: how `dpprobe verify` prints."""
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def add_info_output(p) -> None:
    """`--json`: how `dpprobe info` prints."""
    p.add_argument("--json", action="store_true", help="print all attributes as JSON")
