"""Imported first by every benchmark: `benchmarks/extract.py` is named like the `extract`
package, so this folder (sys.path[0] when a benchmark runs as a script) leaves the import path
and `import extract` finds the package."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
