"""Names of a package imported on first use (PEP 562), so that importing the package loads no
JAX: the command line imports `probe` and `finetune` to build its options."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_names(package: str, table: dict[str, str]) -> tuple[Callable, Callable]:
    """The package's `__getattr__` and `__dir__`.

    Args:
      package: the package's `__name__` (already in `sys.modules` while its `__init__` runs).
      table: each public name -> the module that defines it (a submodule's own name -> itself).

    Returns:
      (`__getattr__`, `__dir__`): a name is imported from its module on first use, then kept
      in the package's namespace.
    """
    namespace = vars(sys.modules[package])

    def __getattr__(name: str):
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(table[name])
        value = module if table[name].endswith("." + name) else getattr(module, name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
