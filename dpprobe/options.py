"""Command-line options written once, on the config fields they set.

A job's config field that is also a `dpprobe` option says so with `option(...)`: its flag (by
default `--field-name`), its help text and argparse's settings (`type`, `choices`, `action`, ...)
live in the field's metadata, next to its default, and `add_options` builds the command's parser
from them. A field without that metadata is for Python callers only. The types here only turn
text into values; the config checks the values (`dpprobe.checks`).

Library code names fields and parameters, not flags: an error says "`weights` and `random_init`
exclude each other", or "`crop=300` exceeds ...", and `cli_words` turns each quoted field of the
command into its flag ("--weights", "--crop 300") for the command line.
"""

from __future__ import annotations

import argparse
import collections.abc
import dataclasses
import functools
import importlib
import re
from collections.abc import Callable

from dpprobe import accounting

__all__ = [
    "AUGMENTATIONS",
    "LOSSES",
    "NORMALIZATIONS",
    "OPTIMIZERS",
    "TRAIN_MODES",
    "Choices",
    "Flag",
    "RangeEnd",
    "accountant_option",
    "add_options",
    "cli_fields",
    "cli_words",
    "delta_option",
    "flag",
    "integer",
    "integers",
    "names",
    "num_classes_option",
    "number",
    "numbers",
    "option",
    "process_fields",
    "shard",
]

_KEY = "dpprobe"  # the key of a field's metadata that holds its options


@dataclasses.dataclass(frozen=True)
class Flag:
    """One argparse argument that sets a config field: `add_argument(*names, help=help,
    **settings)` with the field as destination; `help` may be a callable, for a text that needs
    a package imported only when the command's parser is built (torch, JAX)."""

    names: tuple[str, ...]
    help: str | Callable[[], str] | None
    settings: dict


@dataclasses.dataclass(frozen=True)
class _Option:
    flags: tuple[Flag, ...]
    exclusive: str | None  # flags of one mutually exclusive group share its name
    positional: bool


def flag(*names: str, help: str | Callable[[], str] | None = None, **settings) -> Flag:
    """A further flag of an `option` (`--in-memory` besides `--stream`, `--r-max`)."""
    return Flag(names, help, settings)


def option(default=dataclasses.MISSING, /, *names: str, help=None, flags: tuple[Flag, ...] = (),
           exclusive: str | None = None, positional: bool = False,
           **settings) -> dataclasses.Field:
    """A config field with its command-line option(s).

    Args:
      default: the field's default; none makes the option required (or positional).
      names: the flag's names (default `--field-name`).
      help: its help text; `%(default)s` shows the field's default.
      flags: more flags that set the same field (`flag(...)`), after this one.
      exclusive: the name of a mutually exclusive group, shared by the fields of one config
        whose flags exclude each other; a `required=True` on one makes the group required.
      positional: a positional argument named by the field (`store`).
      settings: argparse's (`type`, `choices`, `metavar`, `action`, `nargs`, ...).
    """
    own = (Flag(names, help, settings),) if help is not None or settings or names else ()
    if positional and not own:
        own = (Flag((), None, {}),)
    metadata = {_KEY: _Option(own + tuple(flags), exclusive, positional)}
    return dataclasses.field(default=default, metadata=metadata)


def num_classes_option() -> dataclasses.Field:
    """`--num-classes K`, for every command that reads a data spec whose source may carry no
    class names (extract, finetune, verify --data)."""
    return option(None, type=integer, metavar="K", help="declare K classes for a source without "
                  "class names (an npz without class_names); labels must lie in [0, K). Never "
                  "inferred from the labels")


def delta_option(text: str = "target delta") -> dataclasses.Field:
    """`--delta`, with the one default of every job (`accounting.DEFAULT_DELTA`)."""
    return option(accounting.DEFAULT_DELTA, type=number, help=f"{text} (default %(default)s)")


def accountant_option(text: str = "") -> dataclasses.Field:
    """`--accountant`, with the one default of every job (`accounting.DEFAULT_ACCOUNTANT`)."""
    return option(accounting.DEFAULT_ACCOUNTANT, choices=accounting.ACCOUNTANTS,
                  help=f"privacy accountant (default %(default)s{text})")


def process_fields(cls):
    """Class decorator, under `@dataclasses.dataclass`: the process fields of a job that may
    run as several processes (`multihost.processes`), declared once for every such job's
    config, inserted before its `quiet` field (so that `--help` lists them there).

    Args:
      cls: the config class, whose body declares `quiet` and not these fields.

    Returns:
      `cls` with `coordinator`, `num_processes`, `process_id` and `process_timeout`.
    """
    fields = {
        "coordinator": ("str | None", option(
            None, metavar="HOST:PORT", help="run as one of --num-processes processes (one per "
            "host; jax.distributed): the address of process 0, which serves the job's "
            "coordinator there (default: JAX_COORDINATOR_ADDRESS, or Slurm's and Kubernetes' "
            "auto-detection when --num-processes is given)")),
        "num_processes": ("int | None", option(
            None, type=integer, metavar="N", help="processes of a multi-process job; each "
            "reads its own slice of the rows, only process 0 writes outputs")),
        "process_id": ("int | None", option(
            None, type=integer, metavar="I", help="this process's index in [0, N) (default: "
            "from Slurm's or Kubernetes' environment)")),
        "process_timeout": ("int", option(
            60, type=integer, metavar="SECONDS", help="multi-process: how long a process waits "
            "for the others to start, and after how many seconds without a heartbeat a "
            "process counts as dead and the job ends (default %(default)s)")),
    }
    annotations = {}
    for name, kind in cls.__dict__["__annotations__"].items():
        if name == "quiet":
            annotations |= {field: kind for field, (kind, _) in fields.items()}
        annotations[name] = kind
    for name, (_, field) in fields.items():
        setattr(cls, name, field)
    cls.__annotations__ = annotations
    return cls


def cli_fields(config_class) -> list[dataclasses.Field]:
    """The fields of a config that are command-line options, in order."""
    return [f for f in dataclasses.fields(config_class) if _KEY in f.metadata]


def _shown(value) -> str:
    """A default as people write it: 1e-5, 0.999, 3."""
    return re.sub(r"e([+-])0", r"e\1", f"{value:g}") if isinstance(value, float) else str(value)


def add_options(parser: argparse.ArgumentParser, config_class) -> None:
    """Add the option(s) of every field of `config_class` that has them, in field order. The
    parser's `argument_default` should be `argparse.SUPPRESS`, so that an option not given
    leaves the config's default."""
    groups: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for field in cli_fields(config_class):
        spec: _Option = field.metadata[_KEY]
        for one in spec.flags:
            settings = dict(one.settings)
            text = one.help() if callable(one.help) else one.help
            if text is not None:
                if field.default is not dataclasses.MISSING:
                    text = text.replace("%(default)s", _shown(field.default))
                settings["help"] = text
            if spec.positional:
                parser.add_argument(field.name, **settings)
                continue
            names = one.names or ("--" + field.name.replace("_", "-"),)
            target = parser
            if spec.exclusive is not None:
                required = settings.pop("required", False)
                if spec.exclusive not in groups:
                    groups[spec.exclusive] = parser.add_mutually_exclusive_group(
                        required=required)
                target = groups[spec.exclusive]
            elif field.default is dataclasses.MISSING:
                settings.setdefault("required", True)
            action = target.add_argument(*names, dest=field.name, **settings)
            if hasattr(action, "field_default"):
                action.field_default = field.default


def cli_words(text: str, parser: argparse.ArgumentParser) -> str:
    """`text` with each quoted field of the parser's command as its flag: `weights` ->
    --weights, `crop=300` -> --crop 300, `random_init=True` -> --random-init,
    `standardize=False` -> --no-standardize, `r_range` -> --r-min/--r-max. Other quoted
    names, and a switch's value that its flag does not set (`progress=True`), stay as they
    are."""
    flags: dict[str, list] = {}
    for action in parser._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if longs:
            flags.setdefault(action.dest, []).append((longs[0], action))

    def replace(match: re.Match) -> str:
        name, value = match.group(1), match.group(2)
        if name not in flags:
            return match.group(0)
        name_flag, action = flags[name][0]
        if value is None:
            return "/".join(flag for flag, _ in flags[name])
        if isinstance(action, argparse.BooleanOptionalAction):
            return name_flag if value == "True" else "--no-" + name_flag[2:]
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            # `random_init=True`, `progress=False`: the flag that sets it
            return name_flag if value == str(action.const) else match.group(0)
        return f"{name_flag} {value.strip(chr(39))}"  # `normalization='group'`: --normalize group

    return re.sub(r"`([a-z_][a-z0-9_]*)(?:=([^`]*))?`", replace, text)


# ---- Types: text to values -----------------------------------------------------------------------


def number(text: str) -> float:
    return _converted(text, float, "a number")


def numbers(text: str) -> list[float]:
    """Comma-separated numbers; inf is one, nan is not."""
    values = _comma_separated(text, float, "number")
    if any(v != v for v in values):
        raise argparse.ArgumentTypeError(f"nan is not a value, got {text!r}")
    return values


def integer(text: str) -> int:
    return _converted(text, int, "an integer")


def integers(text: str) -> list[int]:
    return _comma_separated(text, int, "integer")


def _converted(text: str, convert: Callable, what: str):
    """`convert(text)`, or the parser's error naming what was expected."""
    try:
        return convert(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from err


def _comma_separated(text: str, convert: Callable, what: str) -> list:
    """`convert` of each comma-separated value of `text`: at least one."""
    try:
        values = [convert(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}s, got {text!r}") from err
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one {what}, got {text!r}")
    return values


def shard(text: str) -> tuple[int, int]:
    try:
        index, count = (int(v) for v in text.split("/"))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected K/N, e.g. 0/4, got {text!r}") from err
    return index, count


def names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


class Choices(collections.abc.Sequence):
    """A package's constant as `choices`, imported when argparse first needs it (a value given,
    --help), for a package light enough to import for `--help` (JAX's and torch's vocabularies
    are written out below)."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    @functools.cached_property
    def values(self) -> tuple[str, ...]:
        return tuple(getattr(importlib.import_module(self.module), self.name))

    def __getitem__(self, index):
        return self.values[index]

    def __len__(self) -> int:
        return len(self.values)


# The library's vocabularies as the command line spells them, written out: `--help` shows them,
# and the modules that define them (`dp.optimizers`, `probe.clipping`, `probe.normalization`,
# `finetune.modes`, `extract.extractor`) load JAX or torch, seconds before any help is printed.
# tests/pipelines/test_cli.py keeps each equal to its library constant.
OPTIMIZERS = ("sgd", "momentum", "adam", "sign", "lamb")  # dp.OPTIMIZERS
LOSSES = ("softmax", "sigmoid")  # probe.LOSSES
NORMALIZATIONS = ("none", "l2", "group")  # probe.NORMALIZATIONS
TRAIN_MODES = ("all", "head", "bias", "lora")  # finetune.modes.TRAIN_MODES
AUGMENTATIONS = ("flip", "crop")  # extract.AUGMENTATIONS


class RangeEnd(argparse.Action):
    """One end of a (low, high) field (`--r-min`, `--r-max`); the other keeps its default."""

    field_default = None  # set by `add_options`

    def __init__(self, *args, end: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.end = end

    def __call__(self, parser, namespace, value, option_string=None):
        bounds = list(getattr(namespace, self.dest, self.field_default))
        bounds[self.end] = value
        setattr(namespace, self.dest, tuple(bounds))
