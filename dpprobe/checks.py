"""What the job configs share: their error, how a job gets its config, the value checks.

Every job takes one frozen config (`ExtractConfig`, `ProbeConfig`, ...), built once, by the CLI
from its parsed arguments or by a Python caller from keywords, and passed down unchanged. A
config checks its values in `__post_init__`, the one place they are checked: the CLI's
argument types only parse text. Names of things another package owns (an optimizer, a loss,
an accountant, a backbone) are checked by that package; the CLI offers them as `choices`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from dpprobe.accounting import validation

__all__ = [
    "MAX_STEPS",
    "ConfigError",
    "check_delta",
    "check_epsilon",
    "check_epsilons",
    "check_groups",
    "check_int",
    "check_ints",
    "check_optional_ints",
    "check_number",
    "check_processes",
    "check_unique",
    "make_config",
]

# Most steps of one run: beyond, counters overflow int32 and a run would never end anyway.
MAX_STEPS = 10_000_000


class ConfigError(ValueError):
    """A bad value of one config field; the CLI names its option (`--delta: must be ...`).
    Messages of this package name fields, quoted (`seeds`), never options: the CLI turns each
    into its option (`dpprobe.options.cli_words`)."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def make_config(cls, first=None, first_field: str | None = None, /, **options):
    """`first` if it is already a `cls`, else `cls(**options)` (with `first` as `first_field`):
    every job takes its config, or the config's fields as keywords."""
    if isinstance(first, cls):
        if options:
            raise TypeError(f"give a {cls.__name__} or keyword options, not both")
        return first
    if first is not None:
        options[first_field] = first
    return cls(**options)


def freeze(config, **values) -> None:
    """Set normalized values (lists made tuples) in a frozen config's `__post_init__`."""
    for name, value in values.items():
        object.__setattr__(config, name, value)


def _show(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def check_number(field: str, value, low: float | None = None, high: float | None = None, *,
                 low_open: bool = True, high_open: bool = False, finite: bool = True) -> float:
    """`value` as a float within (low, high] (by default), finite unless told."""
    value = float(value)
    if math.isnan(value) or (finite and math.isinf(value)):
        raise ConfigError(field, f"expected a finite number, got {_show(value)}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        if high is None:
            bounds = f"{'>' if low_open else '>='} {low:g}"
        else:
            bounds = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ConfigError(field, f"must be {bounds}, got {_show(value)}")
    return value


def check_int(field: str, value, low: int = 1, high: int | None = None) -> int:
    """`value` if it is an integer in [low, high]."""
    if isinstance(value, bool) or int(value) != value:
        raise ConfigError(field, f"expected an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigError(field, f"must be {bounds}, got {value}")
    return int(value)


def check_optional_ints(config, names: Iterable[str], low: int = 1,
                        high: int | None = None) -> None:
    """`check_int` on each field of `config` in `names` that is set (None: not given)."""
    for name in names:
        if getattr(config, name) is not None:
            check_int(name, getattr(config, name), low, high)


def check_ints(field: str, values: Iterable, low: int = 1, high: int = MAX_STEPS) -> tuple:
    """A non-empty tuple of integers, each in [low, high]."""
    values = tuple(values)
    if not values:
        raise ConfigError(field, "expected at least one integer")
    for value in values:
        try:
            check_int(field, value, low, high)
        except ConfigError as err:
            raise ConfigError(field, f"each {err.reason}") from None
    return tuple(int(v) for v in values)


def check_unique(field: str, values: tuple) -> tuple:
    """`values` if no value repeats: a sweep trains each value once, and a repeated one would
    merge its runs into one row of the table (more seeds than asked)."""
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise ConfigError(field, f"{', '.join(_show(v) for v in repeated)} given more than "
                          "once; give each value once (use `seeds` for more runs of one)")
    return values


def check_groups(config) -> None:
    """A config's `groups` and `normalization`: `groups` alone means group normalization (set
    in the frozen config), and groups are a setting of group normalization, and only of it."""
    if config.normalization is None and config.groups is not None:
        freeze(config, normalization="group")
    if config.normalization is not None and config.groups is not None:
        check_int("groups", config.groups)
        if config.normalization != "group":
            raise ValueError(f"`groups={config.groups}` needs `normalization=group` "
                             f"(got `normalization={config.normalization}`)")


def check_epsilons(field: str, epsilons: Iterable, *, allow_inf: bool = True) -> tuple:
    """A non-empty tuple of epsilons, each > 0 (`accounting.validation.check_epsilon`)."""
    epsilons = tuple(epsilons)
    if not epsilons:
        raise ConfigError(field, "expected at least one number")
    try:
        return tuple(validation.check_epsilon(e, allow_inf=allow_inf) for e in epsilons)
    except ValueError as err:
        raise ConfigError(field, f"each {err}") from None


def check_epsilon(field: str, epsilon, *, allow_inf: bool = True) -> float:
    """`accounting.validation.check_epsilon`, as an error of `field`."""
    return _checked(field, lambda: validation.check_epsilon(epsilon, allow_inf=allow_inf))


def check_delta(field: str, delta) -> float:
    """`accounting.validation.check_delta`, as an error of `field`."""
    return _checked(field, lambda: validation.check_delta(delta))


def _checked(field: str, check: Callable[[], float]) -> float:
    try:
        return check()
    except ValueError as err:  # "delta must be in (0, 1), got 0.0": the reason follows the name
        raise ConfigError(field, str(err).split(" ", 1)[1]) from None


def check_processes(config) -> None:
    """The checks of a config's process fields (in its `__post_init__`)."""
    if config.num_processes is not None:
        check_int("num_processes", config.num_processes)
    if config.process_id is not None:
        check_int("process_id", config.process_id, 0)
        if config.num_processes is not None and config.process_id >= config.num_processes:
            raise ConfigError("process_id", f"must be < `num_processes` "
                                  f"({config.num_processes}), got {config.process_id}")
    check_int("process_timeout", config.process_timeout)
    coordinator = config.coordinator
    if coordinator is not None:
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError("coordinator", f"expected HOST:PORT, got {coordinator!r}")
