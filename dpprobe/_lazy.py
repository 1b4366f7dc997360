"""Names of a package imported on first use (PEP 562), so that importing the package loads no
JAX: the command line imports `probe` and `finetune` to build its options.

Called, such a package runs its job: `dpprobe.probe(...)` is `dpprobe.jobs.probe` (installed by
`dpprobe/__init__.py`; the package never imports its job, which imports `pipelines`).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping


def lazy_names(package: str, names: Mapping[str, Iterable[str]],
               submodules: Iterable[str] = ()) -> tuple[Callable, Callable]:
    """The package's `__getattr__` and `__dir__`.

    Args:
      package: the package's `__name__` (already in `sys.modules` while its `__init__` runs).
      names: each submodule (its name inside `package`) -> the public names it defines.
      submodules: submodules that are public names themselves (`finetune.models`).

    Returns:
      (`__getattr__`, `__dir__`): a name is imported from its module on first use, then kept
      in the package's namespace.
    """
    namespace = vars(sys.modules[package])
    table = {name: f"{package}.{module}" for module, listed in names.items() for name in listed}
    table.update({module: f"{package}.{module}" for module in submodules})

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
