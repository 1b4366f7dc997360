"""The `dpprobe` command line. Run `dpprobe COMMAND --help` for each command's options.

Each command parses its options into its job's frozen config (argparse destinations are the
config's field names; an option not given takes the config's default), runs the job through its
Python function (`dpprobe.jobs`: `dpprobe.probe(config)`, ...), and prints its table.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import warnings

from dpprobe import jobs, options
from dpprobe.accounting import records
from dpprobe.checks import ConfigError
from dpprobe.extract import store_summary
from dpprobe.multihost import processes
from dpprobe.pipelines import (
    _fast_exit,
    account_job,
    audit_job,
    demo_job,
    export_job,
    extract_job,
    finetune_job,
    predict_job,
    probe_job,
    reporting,
    store_jobs,
    tune_job,
)
from dpprobe.pipelines.account_job import AccountConfig, account
from dpprobe.pipelines.audit_job import AuditConfig
from dpprobe.pipelines.demo_job import DemoConfig, run_demo
from dpprobe.pipelines.export_job import ExportConfig, run_export
from dpprobe.pipelines.extract_job import ExtractConfig
from dpprobe.pipelines.finetune_job import FinetuneConfig
from dpprobe.pipelines.predict_job import PredictConfig
from dpprobe.pipelines.probe_job import ProbeConfig
from dpprobe.pipelines.store_jobs import InfoConfig, VerifyConfig, store_info, verify
from dpprobe.pipelines.tune_job import TuneConfig

# A hub miss retries for ~45 s unless offline mode is set before huggingface_hub is imported;
# users who want the hub set HF_HUB_OFFLINE=0 explicitly.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Exit status when stdout's reader has gone: as if killed by SIGPIPE (128 + 13), like `yes`.
EXIT_CLOSED_PIPE = 141


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (no usage block): `dpprobe probe: error: ...`."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ----------------------------------------------------------------------------------------------
# The commands: each runs its job on its config and prints (options: the config's fields).
# ----------------------------------------------------------------------------------------------


def _extract(config: ExtractConfig, args) -> int:
    result = jobs.extract(config)
    if not config.progress:  # --quiet: the final report only (else the job has said it)
        print(result.table)
    if config.shard is not None:
        return 0  # a shard finished its chunks; the split completes with the last shard
    return 0 if all(r.complete for r in result.results) else 1


def _verify(config: VerifyConfig, args) -> int:
    report = verify(config)
    if getattr(args, "json", False):
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        print(report.text())
    return 0 if report.ok else 1


def _info(config: InfoConfig, args) -> int:
    if getattr(args, "json", False):
        print(json.dumps(store_summary(config.store), indent=2, default=str))
    else:
        print(store_info(config))
    return 0


def _probe(config: ProbeConfig, args) -> int:
    result = jobs.probe(config)
    if processes.is_writer():  # process 0 of a multi-process job prints and writes
        print(result.table)
    return 0


def _tune(config: TuneConfig, args) -> int:
    print(jobs.tune(config).table)
    return 0


def _finetune(config: FinetuneConfig, args) -> int:
    result = jobs.finetune(config)
    if not processes.is_writer():  # process 0 of a multi-process job prints and writes
        return 0
    if result.results.get("already_complete"):
        print(f"already complete: {result.results['already_complete']}")
    print(result.table)
    return 1 if result.results.get("audit", {}).get("refuted") else 0


def _account(config: AccountConfig, args) -> int:
    result = account(config)
    print(json.dumps(result, indent=2) if getattr(args, "json", False)
          else account_job.account_line(result))
    return 0


def _audit(config: AuditConfig, args) -> int:
    result = jobs.audit(config)
    print(result.table)
    for path in (config.out, config.plot):
        if path:
            print(f"wrote {path}")
    return 1 if result.results["claim_refuted"] else 0


def _predict(config: PredictConfig, args) -> int:
    print(jobs.predict(config).table, file=sys.stderr)
    return 0


def _export(config: ExportConfig, args) -> int:
    result = run_export(config)
    print(f"load it with: {result['load']}", file=sys.stderr)
    return 0


def _demo(config: DemoConfig, args) -> int:
    print(demo_job.demo_report(run_demo(config)))
    return 0


# name: (its options besides its config's, its config, what runs it, its parser texts)
COMMANDS = {
    "extract": (None, ExtractConfig, _extract, extract_job.TEXTS),
    "probe": (None, ProbeConfig, _probe, probe_job.TEXTS),
    "tune": (None, TuneConfig, _tune, tune_job.TEXTS),
    "finetune": (None, FinetuneConfig, _finetune, finetune_job.TEXTS),
    "account": (account_job.add_output_options, AccountConfig, _account, account_job.TEXTS),
    "audit": (None, AuditConfig, _audit, audit_job.TEXTS),
    "verify": (store_jobs.add_verify_output, VerifyConfig, _verify, store_jobs.VERIFY_TEXTS),
    "info": (store_jobs.add_info_output, InfoConfig, _info, store_jobs.INFO_TEXTS),
    "demo": (None, DemoConfig, _demo, demo_job.TEXTS),
    "predict": (None, PredictConfig, _predict, predict_job.TEXTS),
    "export": (None, ExportConfig, _export, export_job.TEXTS),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, with the options of all (None) or only of the command
    `only`: the others' choices come from their packages, and importing probe loads JAX,
    extract's backbones torch."""
    parser = _Parser(
        prog="dpprobe",
        description="Differentially private transfer learning on images: extract frozen-"
        "backbone features once into a Zarr cache, then train DP linear probes on it.",
        epilog=reporting.PRIVACY_EPILOG.format(" (RDP on request)"),
    )
    parser.add_argument("--version", action="version", version=f"dpprobe {records.VERSION}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (add_output_options, config_class, run, texts) in COMMANDS.items():
        # Options not given stay unset, so that the config's defaults apply.
        p = sub.add_parser(name, argument_default=argparse.SUPPRESS, **texts)
        p.set_defaults(func=run, config_class=config_class, parser=p)
        if only in (None, name):
            options.add_options(p, config_class)
            if add_output_options is not None:
                add_output_options(p)
    return parser


def make_config(args: argparse.Namespace):
    """The command's config from its parsed options; a bad value is a usage error that names
    its option (`argument --delta: must be in (0, 1), got 0`), as do the fields quoted in its
    reason (`options.cli_words`)."""
    fields = {f.name for f in dataclasses.fields(args.config_class)}
    try:
        return args.config_class(**{k: v for k, v in vars(args).items() if k in fields})
    except ConfigError as err:
        flags = [flag for action in args.parser._actions if action.dest == err.field
                 for flag in action.option_strings or [action.dest]]
        reason = options.cli_words(err.reason, args.parser)
        args.parser.error(f"argument {'/'.join(flags) or err.field}: {reason}")


def _use_jax_compilation_cache() -> None:
    """JAX's persistent compilation cache in ~/.cache/dpprobe/jax, so that a repeated sweep
    skips XLA compilation (compiled code never changes results or privacy). JAX reads these
    variables when it is imported; a user's own setting wins, DPPROBE_JAX_CACHE=0 turns it off."""
    if os.environ.get("DPPROBE_JAX_CACHE", "1") == "0":
        return
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(base, "dpprobe", "jax"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
    # A cache entry that cannot be written (a full disk), or one cut short by it, only costs a
    # compile: not a warning beside the job's own one-line error, nor on the retry's stderr.
    warnings.filterwarnings("ignore", message="Error (writing|reading) persistent compilation "
                            "cache entry")


def _quiet_closed_stdout() -> None:
    """The reader of our stdout went away (`dpprobe info STORE | head`): stop writing, quietly."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    _use_jax_compilation_cache()
    command = next((a for a in argv if not a.startswith("-")), "")  # dpprobe has no top-level
    parser = build_parser(command)  # option with a value: the first word is the command
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # --help, --version, or a one-line usage error (status 2)
        return stop.code if isinstance(stop.code, int) else 2
    processes.name_command(args.command)  # named in a multi-process job's failure line
    try:
        config = make_config(args)
        code = args.func(config, args)
        sys.stdout.flush()
        return code
    except SystemExit as stop:  # a bad option value (status 2)
        return stop.code if isinstance(stop.code, int) else 2
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
        message = options.cli_words(_one_line(err), args.parser)  # fields named as options
        if processes.active():  # one line naming the process, and leave now (the others
            processes.fail(*processes.describe_failure(err, message), args.command)  # go too)
        print(f"dpprobe {args.command}: error: {message}", file=sys.stderr)
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
    """The `dpprobe` console script: `main`, then a fast exit (`pipelines._fast_exit`). Its
    probe programs are stored beside JAX's compilation cache (`probe.programs`: only here,
    where no function is patched in memory; DPPROBE_STORED_PROGRAMS=0 turns it off)."""
    os.environ.setdefault("DPPROBE_STORED_PROGRAMS", "1")
    # Collect young objects every 100,000 allocations, not every 700: the 40-run probe sweep
    # (importing JAX and optax: ~600 modules) ran ~285 collections, two of them full passes
    # over every object, 0.1-0.2 s of its ~1.6 CPU s (gc callbacks, 2-core VM). Cycles are
    # still collected, later; only this process (the command) is affected.
    gc.set_threshold(100_000, *gc.get_threshold()[1:])
    _fast_exit.leave(main())


if __name__ == "__main__":
    entry()
