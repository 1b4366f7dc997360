"""The one way a recipe fills an option the user left out: the default, with the reason
recorded for the report (the probe's and the finetune's recipes share it)."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def given_or_default(chosen: dict[str, str], name: str, given: T | None, default: T,
                     why: str) -> T:
    """`given`, or `default` when it is None (then `chosen[name] = why`).

    Args:
      chosen: the recipe's record of what it chose and why (updated in place).
      name: the option's name in that record.
      given: what the config says (None: left to the recipe).
      default: the recipe's value.
      why: the reason shown for the default.

    Returns:
      the value to use.
    """
    if given is not None:
        return given
    chosen[name] = why
    return default
