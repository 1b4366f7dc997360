"""An on-disk cache of compiled probe programs, so that a fresh process skips tracing them.

JAX's persistent compilation cache skips XLA compilation, but every new process still traces
and lowers each program to find its cache key: ~0.3 s for a sweep's first step on CPU, a
sixth of a whole `dpprobe probe` run. This cache stores the compiled executable itself
(`jax.experimental.serialize_executable`) under a key made of everything that determines
the program:

  * the function, its static arguments, and the abstract values and tree of its arguments;
  * the source of the `probe` package and the versions of Python, NumPy, JAX, jaxlib, optax;
  * every `jax.config` value, `XLA_FLAGS`, and the devices.

The program is the one `jax.jit` would run (same inputs, same keys, same noise): the cache
changes speed only. A new entry is written only after its deserialized form ran to completion
once, and an entry that fails to load is dropped and recompiled.

Enabled by the environment variable `DPPROBE_EXECUTABLE_CACHE` (a directory), which the CLI
sets next to the JAX cache (`DPPROBE_JAX_CACHE=0` turns both off). Like JAX's own cache,
entries are pickled executables: keep the directory private to the user.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

__all__ = ["ENV", "cached_call"]

ENV = "DPPROBE_EXECUTABLE_CACHE"


def cached_call(jitted, *args, **static):
    """`jitted(*args, **static)` through the executable cache (a plain call if it is off).

    For the `probe` package's own programs: the key covers this package's source, not the
    source of functions defined elsewhere. `jitted` must be a `jax.jit` function whose keyword
    arguments here are all static and which donates no argument. A cached call is waited for
    (XLA reports a broken deserialized executable only when it runs, e.g. "Function ... not
    found" in a process that already holds other executables); if it fails, the entry is
    dropped and the call falls back to `jitted`, so the cache never changes a result.
    """
    directory = os.environ.get(ENV)
    if not directory:
        return jitted(*args, **static)
    path = Path(directory) / f"{jitted.__name__}-{_key(jitted, args, static)}.pkl"
    compiled = _load(path)
    if compiled is not None:
        try:  # waited for: a deserialized executable may fail only when it runs
            return jax.block_until_ready(compiled(*args))
        except Exception:  # a broken entry: drop it, compile afresh below
            path.unlink(missing_ok=True)
    try:
        compiled = _compile_uncached(jitted, args, static)
        blob = _serialize(compiled)
        # The entry is kept only if its deserialized form runs (errors surface on completion).
        out = jax.block_until_ready(_deserialize(blob)(*args))
    except Exception:
        return jitted(*args, **static)
    _write_atomic(path, blob)
    return out


def _compile_uncached(jitted, args, static):
    """Compile without JAX's persistent cache: an executable loaded from that cache cannot
    always be serialized again (its CPU functions may be missing). One already compiled in
    this process may still come from it; the check in `cached_call` then rejects it."""
    lowered = jitted.trace(*args, **static).lower()
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        return lowered.compile()
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)


def _serialize(compiled) -> bytes:
    from jax.experimental.serialize_executable import serialize

    return pickle.dumps(serialize(compiled))


def _deserialize(blob: bytes):
    from jax.experimental.serialize_executable import deserialize_and_load

    payload, in_tree, out_tree = pickle.loads(blob)
    return deserialize_and_load(payload, in_tree, out_tree)


def _load(path: Path):
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    try:
        return _deserialize(blob)
    except Exception:
        path.unlink(missing_ok=True)
        return None


def _write_atomic(path: Path, blob: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as tmp:
            tmp.write(blob)
        os.replace(tmp.name, path)
    except OSError:  # a read-only or full cache only costs speed
        pass


def _key(jitted, args, static) -> str:
    leaves, tree = jax.tree.flatten(args)
    parts = [
        jitted.__module__, jitted.__qualname__, repr(sorted(static.items())), str(tree),
        *(repr(jax.typeof(leaf)) for leaf in leaves),
        _environment(),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


@functools.cache
def _environment() -> str:
    """Everything outside the call that can change the compiled program."""
    import importlib.metadata

    import jaxlib

    package = Path(__file__).parent
    sources = hashlib.sha256()
    for source in sorted(package.glob("*.py")):
        sources.update(source.name.encode() + b"\0" + source.read_bytes())
    config = sorted((name, repr(value)) for name, value in jax.config.values.items())
    devices = [(d.platform, d.device_kind, d.id) for d in jax.devices()]
    return repr((sys.version, np.__version__, jax.__version__, jaxlib.__version__,
                 importlib.metadata.version("optax"), sources.hexdigest(), config,
                 os.environ.get("XLA_FLAGS", ""), devices))
