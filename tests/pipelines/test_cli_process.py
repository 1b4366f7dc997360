"""The `dpprobe` console script's own process settings (`cli.entry`): a process is what is
tested, so these run one."""

import os
import subprocess
import sys

CHILD = """
import atexit, gc, sys
atexit.register(lambda: print("threshold", *gc.get_threshold()))
sys.argv = ["dpprobe", "--version"]
from dpprobe.pipelines.cli import entry
entry()
"""


def test_the_console_script_collects_young_objects_every_100000_allocations():
    # Python's default (700) made importing JAX cost ~280 collections, two of them full.
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    child = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    lines = child.stdout.splitlines()
    assert lines[0].startswith("dpprobe ")
    # The older generations keep Python's defaults: only young collections are rarer.
    default = subprocess.run([sys.executable, "-c", "import gc; print(*gc.get_threshold())"],
                             capture_output=True, text=True, timeout=60).stdout.split()
    assert lines[-1].split() == ["threshold", "100000", *default[1:]]
