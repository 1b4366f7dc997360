"""Imported first by every benchmark: this folder (sys.path[0] when a benchmark runs as a script)
leaves the import path, so that a benchmark's name (`extract.py`, `predict.py`) never shadows a
module a library imports; `load_benchmark` loads a sibling script explicitly instead."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]


def load_benchmark(name: str):
    """Another benchmark script of this folder as a module (this folder is off the path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_benchmark_{name}",
                                                  os.path.join(_HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
