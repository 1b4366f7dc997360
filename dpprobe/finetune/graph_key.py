"""A model's `GraphDef` as a static argument of `jax.jit`, hashed once (`graph_key`).

`jax.jit` hashes its static arguments on every call, and an NNX `GraphDef` has no cached hash:
hashing it walks the model's whole node tree, 1.1-1.8 ms for ViT-tiny and 0.75 ms for WRN-16-4
on the development CPU, paid on every compiled call of the trainer (`stacked_sums`, one
per physical batch on a CPU) and of an evaluation. On a GPU that is host time the device
waits for: a ViT-tiny physical batch of 64 at 32 px computes in 6 ms there, and the
trainer's steps were host-bound (README, "The H100 again"). `graph_key(graphdef)` wraps the
graph with its hash computed once; equal graphs give the same wrapper (a small table: the
equality is checked once per call of `graph_key`, not per jitted call), so compiled programs
are shared across calls and jobs exactly as with the bare graph. Flax's own answer
(`nnx.cached_partial`) caches a bound `nnx.jit` function; ours are plain `jax.jit` functions
of (graphdef, state), so the key alone is wrapped.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["GraphKey", "graph_key", "graph_of"]

_TABLE_SIZE = 64  # distinct graphs kept; past it the oldest is dropped (keys stay correct)


class GraphKey:
    """A hashable graph with its hash computed once (equality: identity, then the graphs')."""

    __slots__ = ("graph", "_hash")

    def __init__(self, graph: Any):
        self.graph = graph
        self._hash = hash(graph)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, GraphKey) and self._hash == other._hash
                                 and self.graph == other.graph)

    def __repr__(self) -> str:
        return f"GraphKey({type(self.graph).__name__}, hash={self._hash})"


_table: dict[GraphKey, GraphKey] = {}
_lock = threading.Lock()


def graph_key(graph: Any) -> GraphKey:
    """The one `GraphKey` of `graph` (a `GraphKey` is returned as it is)."""
    if isinstance(graph, GraphKey):
        return graph
    key = GraphKey(graph)
    with _lock:
        known = _table.get(key)
        if known is not None:
            return known
        if len(_table) >= _TABLE_SIZE:  # the oldest graph goes (its key stays valid)
            del _table[next(iter(_table))]
        _table[key] = key
        return key


def graph_of(graph_or_key: Any) -> Any:
    """The graph itself, given a graph or its `GraphKey` (the jitted functions take either)."""
    return graph_or_key.graph if isinstance(graph_or_key, GraphKey) else graph_or_key
