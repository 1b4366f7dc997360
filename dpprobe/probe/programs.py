"""The probe's compiled programs kept on disk beside JAX's compilation cache, so that a repeated
`dpprobe probe` skips tracing and lowering.

JAX's persistent cache keys a program by its lowered HLO, so every process traces and lowers
each program before it can look it up: 0.4-0.5 s of a warm 40-run sweep on a loaded 2-core CPU
(three programs), where loading the stored executable takes 0.07-0.08 s.

A stored program is found by a key that covers what its HLO is made from: the program's name,
the sha256 of every source file of the `dpprobe` package, the versions of Python, JAX, jaxlib,
optax and NumPy, JAX's configuration, XLA_FLAGS, the backend and the host's CPU flags, the
arguments' tree, shapes, dtypes and shardings, and the static arguments. It is the executable
that JAX compiles from that HLO, so results are bit-identical (tests/probe/test_programs.py);
the mechanism, its noise keys and its sensitivity bound are the program's, unchanged.

Only the `dpprobe` command turns it on (its console script sets DPPROBE_STORED_PROGRAMS=1 unless
it is set: 0 turns it off), and only where JAX's persistent cache is configured (the entries
live in its folder; DPPROBE_JAX_CACHE=0 turns both off). A process that patches functions in
memory (tests, notebooks) traces as usual: a patch does not change the source files the key
hashes. Arguments sharded over several devices always take the traced path. A stored entry is
trusted as JAX's own cache entries are (same folder, same owner); one that does not load is
compiled again and replaced.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import os
import pickle
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from jax.experimental import serialize_executable
from jax.experimental.compilation_cache import compilation_cache as jax_compilation_cache

__all__ = ["ENV", "enabled", "stored"]

# The switch: "1" (set by the `dpprobe` console script) turns stored programs on.
ENV = "DPPROBE_STORED_PROGRAMS"
# Compiled programs of this process, by key (the disk is read once per key).
_LOADED: dict[str, object] = {}


def enabled() -> bool:
    """Whether stored programs are in use: turned on (`ENV`), JAX's persistent cache
    configured, JIT on.

    Returns:
      True when a `stored` program is looked up on disk.
    """
    return (os.environ.get(ENV) == "1" and bool(jax.config.jax_compilation_cache_dir)
            and not jax.config.jax_disable_jit)


def stored(name: str, jitted: Callable, *, x64: bool = False) -> Callable:
    """`jitted` (a `jax.jit` or `dp.accumulate.x64_jit` function), its compiled programs stored
    on disk while `enabled()`.

    Args:
      name: the program's name in its key (unique in the package).
      jitted: the jitted function; its keyword arguments are its static ones.
      x64: whether `jitted` is traced and run with `jax.enable_x64` (`x64_jit`).

    Returns:
      A function with `jitted`'s signature; it is `jitted` itself while not `enabled()`.
    """

    @functools.wraps(jitted)
    def call(*args, **static):
        if not enabled() or not _single_device(args):
            return jitted(*args, **static)
        # x64 programs run in their own scope (`x64_jit`); the others in the caller's.
        with jax.enable_x64(True) if x64 else contextlib.nullcontext():
            key = _key(name, args, static, x64)
            compiled = _LOADED.get(key)
            if compiled is None:
                compiled = _LOADED[key] = _load_or_compile(key, jitted, args, static)
            return compiled(*args)

    for attr in ("_cache_size", "clear_cache", "lower"):
        if hasattr(jitted, attr):
            setattr(call, attr, getattr(jitted, attr))
    return call


def _single_device(args) -> bool:
    return all(len(leaf.sharding.device_set) == 1 for leaf in jax.tree.leaves(args)
               if isinstance(leaf, jax.Array))


def _leaf_key(leaf) -> tuple:
    if isinstance(leaf, jax.Array):
        return ("jax", leaf.shape, str(leaf.dtype), getattr(leaf, "weak_type", None),
                repr(leaf.sharding))
    if isinstance(leaf, np.ndarray | np.generic):
        return "numpy", leaf.shape, leaf.dtype.str
    return "python", type(leaf).__name__  # a traced Python scalar: weakly typed


def _key(name: str, args, static: dict, x64: bool) -> str:
    leaves, tree = jax.tree.flatten(args)
    parts = (name, _environment(), x64, str(tree), [_leaf_key(leaf) for leaf in leaves],
             sorted((k, repr(v)) for k, v in static.items()),
             sorted((k, repr(v)) for k, v in jax.config.values.items()))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


@functools.cache
def _environment() -> tuple:
    """What every program of this process is made from, besides its arguments."""
    package = Path(__file__).resolve().parents[1]
    sources = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        sources.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    versions = []
    for dist in ("jax", "jaxlib", "optax", "numpy", "ml_dtypes"):
        try:
            versions.append((dist, importlib.metadata.version(dist)))
        except importlib.metadata.PackageNotFoundError:
            versions.append((dist, None))
    client = jax.local_devices()[0].client
    devices = [(d.platform, d.device_kind) for d in jax.local_devices()]
    return (sources.hexdigest(), sys.version, versions, client.platform,
            client.platform_version, devices, os.environ.get("XLA_FLAGS", ""), _cpu_flags())


def _cpu_flags() -> str:
    """The host CPU's feature flags (XLA:CPU compiles for them)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith(("flags", "Features"))),
                        "")
    except OSError:
        return ""


def _compile_afresh(lowered):
    """`lowered.compile()`, never taken from JAX's persistent cache: XLA:CPU (jaxlib 0.10)
    re-serializes an executable it loaded from that cache without its kernels, and the stored
    copy then failed when it ran ("Function wrapped_is-finite not found", on the second
    `dpprobe probe` after any change to the package's sources: the first found its programs in
    JAX's cache and stored them). JAX decides once per process whether its cache is used, so
    turning it off only for this compile takes a reset before (the decision is made again, off)
    and after (on again for later compiles)."""
    was = jax.config.jax_enable_compilation_cache
    jax_compilation_cache.reset_cache()
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        return lowered.compile()
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        jax_compilation_cache.reset_cache()


def _load_or_compile(key: str, jitted: Callable, args, static: dict):
    path = Path(jax.config.jax_compilation_cache_dir) / "dpprobe-programs" / key
    try:
        with open(path, "rb") as file:
            return serialize_executable.deserialize_and_load(*pickle.load(file))
    except Exception:  # noqa: BLE001 - missing, cut short or stale: compile it again
        pass
    compiled = _compile_afresh(jitted.lower(*args, **static))
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as file:
            temporary = file.name
            pickle.dump(serialize_executable.serialize(compiled), file)
        os.replace(temporary, path)  # whole or absent, whoever else writes it
    except Exception:  # noqa: BLE001 - a full disk or a read-only cache only costs a compile
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
    return compiled
