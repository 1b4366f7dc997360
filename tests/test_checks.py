"""The config checks the jobs share (`dpprobe.checks`): optional integer fields, and groups
that imply group normalization."""

from __future__ import annotations

import dataclasses

import pytest

from dpprobe import checks
from dpprobe.checks import ConfigError


@dataclasses.dataclass(frozen=True)
class _Sizes:
    resize: int | None = None
    workers: int | None = None


@dataclasses.dataclass(frozen=True)
class _Recipe:
    normalization: str | None = None
    groups: int | None = None


def test_optional_ints_skip_unset_fields_and_name_a_bad_one():
    checks.check_optional_ints(_Sizes(), ("resize", "workers"))  # None: not given
    checks.check_optional_ints(_Sizes(workers=0), ("workers",), 0)
    with pytest.raises(ConfigError, match="must be >= 1, got 0") as err:
        checks.check_optional_ints(_Sizes(resize=3, workers=0), ("resize", "workers"))
    assert err.value.field == "workers"
    with pytest.raises(ConfigError, match=r"must be in \[1, 4\], got 5"):
        checks.check_optional_ints(_Sizes(resize=5), ("resize",), high=4)
    with pytest.raises(ConfigError, match="expected an integer"):
        checks.check_optional_ints(_Sizes(resize=2.5), ("resize",))


def test_groups_alone_mean_group_normalization_and_need_it():
    alone = _Recipe(groups=27)
    checks.check_groups(alone)
    assert alone.normalization == "group"
    for unchanged in (_Recipe(), _Recipe(normalization="l2"), _Recipe("group", 4)):
        before = dataclasses.astuple(unchanged)
        checks.check_groups(unchanged)
        assert dataclasses.astuple(unchanged) == before
    with pytest.raises(ValueError, match="`groups=4` needs `normalization=group`"):
        checks.check_groups(_Recipe("l2", 4))
    with pytest.raises(ConfigError, match="must be >= 1, got 0"):
        checks.check_groups(_Recipe(groups=0))
