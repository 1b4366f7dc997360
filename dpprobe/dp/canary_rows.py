"""Dirac canary rows inside a clipper: the white-box audit's gradient canaries (`dp.canaries`)
placed on coordinates of the trained parameters themselves.

A canary row is an example whose gradient is `value` e_c, a Dirac on one coordinate c of the
trained parameters (their leaves flattened in `jax.tree.leaves` order and concatenated), in
place of its loss's gradient (Nasr et al. 2023, Tight Auditing of Differentially Private
Machine Learning, https://arxiv.org/abs/2302.07956: their Dirac canary). The clipper then
treats it as any example: its norm enters the per-example norm by the layer's own code (the
ghost norm of its A and B, or the norm of its instantiated gradient), it is scaled by the
same clipping factor, summed by the same per-layer sum and noised with the rest. So a fault in
any layer's clipping or noise meets the canaries placed on that layer:

  * a canary's `value` (far above C) is clipped to C by a correct clipper and passes whole
    where a layer's clipping is skipped (its factor not applied, or its norm left out of the
    example's norm: the canary's norm is then 0, its factor 1);
  * the auditor reads the privatized sum at c (`coordinates_of`), so noise missing on the
    layer, or on the whole model, leaves the canary's C bare.

How each representation of a layer's per-example gradients holds a Dirac: an instantiated
gradient's (or an offset's) canary rows are replaced in its norm (`dirac_rows`), and its sum
adds the canary rows' Diracs (`dirac_piece`) beside the other rows', with the same factors;
a ghost layer's A and B rows are replaced (`dirac_ghost`): its A^T B is a (d, p) matrix and
the kernel's flat coordinate f is its entry (f // p, f % p) (the kernel is that matrix
reshaped, row-major), made by A's first token row e_(f // p) and B's value e_(f % p), every
other token row zero. Either way the canary's own forward (a public zero image, a loss of 0)
counts for nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["CanaryRows", "coordinates_of", "dirac_example", "dirac_ghost", "dirac_piece",
           "dirac_rows", "leaf_starts"]

# batch -> (coordinate (n,) int32, value (n,) float32): each row's canary coordinate over the
# trained leaves, -1 for a row that is not a canary.
CanaryRows = Callable[[tuple], tuple[jax.Array, jax.Array]]


def leaf_starts(tree) -> list[int]:
    """Where each leaf of `tree` starts in its flattened concatenation (`jax.tree.leaves`
    order), and the total size last."""
    return [0, *np.cumsum([int(np.prod(np.shape(v))) for v in jax.tree.leaves(tree)]).tolist()]


def coordinates_of(tree, coordinates: jax.Array) -> jax.Array:
    """The entries of `tree`'s leaves, flattened and concatenated, at `coordinates` (m,): what
    an auditor reads of a privatized sum."""
    flat = jnp.concatenate([jnp.ravel(v) for v in jax.tree.leaves(tree)])
    return flat[coordinates]


def dirac_piece(shape: tuple, start: int, coordinate: jax.Array, value: jax.Array,
                dtype) -> jax.Array:
    """(n, *shape): row i is value_i e_(coordinate_i - start) where that coordinate lies in the
    leaf of `shape` starting at `start`, else zero (every row that is not a canary's)."""
    size = int(np.prod(shape))
    hit = jnp.arange(size)[None, :] == (coordinate - start)[:, None]
    piece = jnp.where(hit, value[:, None].astype(dtype), jnp.zeros((), dtype))
    return piece.reshape(coordinate.shape[0], *shape)


def dirac_rows(grads: jax.Array, start: int, coordinate: jax.Array, value: jax.Array
               ) -> jax.Array:
    """Per-example gradients (n, *shape) of the leaf starting at `start`, each canary row
    (coordinate >= 0) replaced by value e_(coordinate - start) (zero if its coordinate lies in
    another leaf): elementwise selects, fused."""
    canary = (coordinate >= 0).reshape((-1,) + (1,) * (grads.ndim - 1))
    return jnp.where(canary, dirac_piece(grads.shape[1:], start, coordinate, value,
                                         grads.dtype), grads)


def dirac_ghost(a: jax.Array, b: jax.Array, start: int, coordinate: jax.Array,
                value: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A ghost layer's rows a (n, T, d) and b (n, T, p), its kernel's leaf starting at
    `start`: each canary row's replaced so that its A^T B is value e_(f // p) e_(f % p)^T,
    f = coordinate - start (zero if the coordinate lies in another leaf)."""
    d, p = a.shape[2], b.shape[2]
    local = coordinate - start
    here = (local >= 0) & (local < d * p)
    canary = (coordinate >= 0)[:, None, None]
    first = (jnp.arange(a.shape[1]) == 0)[None, :, None]
    row = jnp.clip(local, 0, d * p - 1)
    a_row = jax.nn.one_hot(row // p, d, dtype=a.dtype)[:, None, :]
    b_row = (jax.nn.one_hot(row % p, p, dtype=b.dtype)
             * jnp.where(here, value, 0.0).astype(b.dtype)[:, None])[:, None, :]
    return (jnp.where(canary, jnp.where(first, a_row, 0.0), a),
            jnp.where(canary, jnp.where(first, b_row, 0.0), b))


def dirac_example(grads, coordinate: jax.Array, value: jax.Array):
    """One example's gradient pytree (no batch axis), replaced by value e_coordinate over its
    flattened leaves when coordinate >= 0 (the per-example clipper's canary rows)."""
    leaves, treedef = jax.tree.flatten(grads)
    starts = leaf_starts(grads)
    out = [dirac_rows(leaf[None], start, coordinate[None], value[None])[0]
           for leaf, start in zip(leaves, starts, strict=False)]
    return jax.tree.unflatten(treedef, out)
