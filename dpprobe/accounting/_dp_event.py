"""dp_accounting's event classes without running dp_accounting's `__init__` (start-up only).

`import dp_accounting` imports its PLD and RDP accountants and through them SciPy's signal
and stats packages. A full-batch probe job only builds events and computes epsilon in closed
form (`accounting.plan.compute_epsilon`), so it needs just the module `dp_accounting.dp_event`,
which needs only `attrs`. Measured gain (`benchmarks/startup.py`: a 40-run full-batch
`dpprobe probe` on 50k x 768, 7 alternating runs, medians, 2-core CPU): 0.46 s wall, 0.49 s
CPU of 1.43 s wall in all. Kept while it saves at least 0.2 s.

While the package is not imported yet, that one module is loaded alone, under its own name. A
later `import dp_accounting` finds it in `sys.modules` and binds the same module, so the
classes are the same objects either way (`isinstance`, equality and pickling agree).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

__all__ = ["events"]

_NAME = "dp_accounting.dp_event"


def events():
    """The module `dp_accounting.dp_event`, loaded without the rest of dp_accounting if it is
    not imported yet."""
    if (module := sys.modules.get(_NAME)) is not None:
        return module
    if "dp_accounting" in sys.modules:
        return importlib.import_module(_NAME)
    package = importlib.util.find_spec("dp_accounting")  # locates it without running it
    if package is None or not package.submodule_search_locations:
        return importlib.import_module(_NAME)  # the usual ImportError
    path = os.path.join(list(package.submodule_search_locations)[0], "dp_event.py")
    spec = importlib.util.spec_from_file_location(_NAME, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_NAME]
        raise
    return module
