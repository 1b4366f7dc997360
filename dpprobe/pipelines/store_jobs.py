"""The data owner's checks: verify (a feature store's every chunk, optionally against the
source data; or raw data alone, `--data` without a store: the records a publishing job's rule
would change) and info (a store's provenance). Their output is private to the owner."""

from __future__ import annotations

import dataclasses
import sys

from dpprobe import checks, extract
from dpprobe.extract.verify import source_fingerprints
from dpprobe.options import num_classes_option, option

__all__ = [
    "InfoConfig", "VerifyConfig", "format_store_info", "store_info", "verify", "verify_json",
    "verify_report",
]


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
        if self.num_classes is not None:
            checks.check_int("num_classes", self.num_classes)


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
    return format_store_info(store, extract.store_summary(store))


def verify_report(report) -> str:
    """What `dpprobe verify` prints: each split, each problem, and the verdict."""
    lines = [f"{split}: {_split_check(info)}" for split, info in report.splits.items()]
    lines += [f"PROBLEM {problem}" for problem in report.problems]
    lines.append("OK" if report.ok else f"{len(report.problems)} problem(s)")
    return "\n".join(lines)


def _split_check(info: dict) -> str:
    """'1438 examples, complete; 1 chunk checked, none bad' (what `verify_store` saw)."""
    parts = [f"{info.get('num_examples')} examples, "
             + ("complete" if info.get("complete") else "INCOMPLETE")]
    if "chunks_checked" in info:
        checked, bad = info["chunks_checked"], info.get("bad_chunks", 0)
        parts.append(f"{checked} chunk{'s' * (checked != 1)} checked, "
                     + (f"{bad} bad" if bad else "none bad"))
    parts += [f"{key.replace('_', ' ')} {value}" for key, value in info.items()
              if key not in ("num_examples", "complete", "chunks_checked", "bad_chunks")]
    return "; ".join(parts)


def verify_json(report) -> dict:
    """`dpprobe verify --json`: the verdict, the problems and each split's findings (of a
    store), or each record the rule would change (of `--data`: for the data's owner only)."""
    if hasattr(report, "problems"):
        return {"ok": report.ok, "problems": list(report.problems), "splits": report.splits}
    return {"ok": report.ok, "spec": report.spec, "for": "the data's owner only",
            "splits": {name: {"records": size, "changed": [
                {"record": where, "kind": defect.kind, "detail": defect.detail}
                for where, defect in found]} for name, (size, found) in report.splits.items()}}


def format_store_info(store, summary: dict) -> str:
    """The provenance of a store (`extract.store_summary`), for people."""
    lines = [f"{store}: {summary['root'].get('format')} v{summary['root'].get('format_version')}"]
    for name, attrs in summary["splits"].items():
        backbone, dataset = attrs.get("backbone", {}), attrs.get("dataset", {})
        pre = attrs.get("preprocessing", {})
        lines += [
            f"[{name}] {attrs.get('num_examples')} examples x {attrs.get('feature_shape')} "
            f"{attrs.get('dtype')}, {attrs['chunks_done']}/{attrs['num_chunks']} chunks of "
            f"{attrs.get('rows_per_chunk')} rows, complete={attrs.get('complete')}",
            f"  backbone: {backbone.get('name')} (weights: {backbone.get('weights_source')}"
            + (f", seed {backbone['seed']}" if backbone.get("seed") is not None else "")
            + (f", file {backbone['weights_file']}" if backbone.get("weights_file") else "")
            + (f", sha256 {backbone['weights_sha256']}" if backbone.get("weights_sha256")
               else "")
            + (f", tag {backbone['tag']}" if backbone.get("tag") else "") + ")"
            + "".join(f", {k} {backbone[k]}" for k in ("timm_version", "kymatio_version",
                                                      "torch_version") if backbone.get(k)),
            "  preprocessing: " + ", ".join(f"{k}={v}" for k, v in pre.items()
                                              if k != "transform" and v not in (None, [], ())),
            f"  dataset: {dataset.get('name')} ({dataset.get('spec')}), "
            f"{dataset.get('num_classes')} classes, fingerprint {dataset.get('fingerprint')}",
            "  classes: " + ", ".join(str(c) for c in (attrs.get("class_names")
                                                        or dataset.get("class_names") or [])),
            f"  created {attrs.get('created')}, completed {attrs.get('completed', '-')}",
        ]
    return "\n".join(lines)


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
