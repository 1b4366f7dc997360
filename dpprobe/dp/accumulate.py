"""Sums of clipped gradients whose floating-point sensitivity stays within C (1 + 1e-6).

A clipped sum is noised once it is complete, so the Gaussian mechanism needs a bound on how far
one example moves the *computed* sum, rounding included (Casacuberta et al. 2022,
https://arxiv.org/abs/2207.10635). In float32 the rounding is relative to the size of the sum,
up to N C, not to C: on N aligned rows of norm C, nulling one moved the float32 sum of the
streamed probe by 1.115 C at N = 10^7 (benchmarks/sensitivity.py), and a float32 value of size
N C cannot represent a change of 1e-6 C once N > 16. So every sum over examples is accumulated
in float64, and the noise is added to it in float64 before anything is rounded to float32
(`dp.noise.add_noise`; that rounding is post-processing):

  * within one chunk, physical batch or device: the row reduction of the clipped sum is a float64
    dot of float32 operands (`FLOAT64_SUMS`: the products are exact), over blocks of
    `SUM_BLOCK_ROWS` rows (at most `MAX_BLOCK_ROWS` for the bound below), the blocks added with
    Neumaier's compensated sum (`row_block_sum`);
  * across chunks: `add_parts`, the same compensated float64 sum (`CompensatedSum`, on the
    device, asynchronous); across a finetune step's physical batches, a plain float64 sum in
    order (`add_float64`, inside `finetune.batch_sums.stacked_sums`);
  * across devices: XLA adds the D per-device float64 sums.

Only the reduction is float64: the forward matmul (the logits), the norms and the clipping
stay float32 (the cost: README, "Measured performance"). Programs holding float64 sums are
traced with `jax.enable_x64` scoped to them (`x64_jit`): the global default stays float32, and
every array those programs create names its dtype.

Formal guarantee:
  Let u = 2^-53, b the rows of one block (<= 2^15), N the examples, D the devices, and each
  example one view (the block's terms are then the examples' clipped gradients, of norm <= C).
  A float64 sum of n terms in any order is within (n - 1) u sum |t_i| of the exact sum, and
  Neumaier's sum of k parts within 2 u |sum| + O(k u^2) sum |parts| (Higham 2002, "Accuracy and
  Stability of Numerical Algorithms", sections 4.2-4.3). For zero-out neighbours (one row
  replaced by a null row, N public) every block but the one holding that row computes
  bit-identical parts (XLA computes a block the same way each time: on CPU, and on GPU with
  `--xla_gpu_deterministic_ops=true`; otherwise add 2 u N b), so the two computed totals
  differ by at most
      C (1 + 2 b^2 u + 4 u (N + R) + 2 (D - 1) u N + O(N u^2 N / b)),
  R the rows of one chunk or physical batch (the compensated sum of its blocks; R = 0 in
  memory, where the blocks' sum is the only one): with R <= 10^6, C (1 + 6.8e-7) at N = 10^9
  on one device, C (1 + 9.1e-7) on two, and within C (1 + 1e-6) for N up to
  3.4 x 10^9 / (D + 1) on D devices (3.8 x 10^8 on eight). With K views
  per example the block's terms are the K view products, and the bound is relative to the sum
  of their norms instead of C. Measured on the adversarial aligned rows:
  tests/dp/test_sensitivity.py and benchmarks/sensitivity.py.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["BLOCK_BYTES", "FLOAT64_SUMS", "MAX_BLOCK_ROWS", "SMALL_SUM_BYTES", "SMALL_SUM_WIDTH",
           "SUM_BLOCK_ROWS", "CompensatedSum", "add_float64", "add_parts", "row_block_sum",
           "sum_block_rows", "weighted_rows_sum", "x64_jit"]

# The dtype a clipped sum's row reduction accumulates in (inside an `x64_jit` program).
FLOAT64_SUMS = jnp.float64
# Rows one float64 dot may reduce over for the bound of the module docstring.
MAX_BLOCK_ROWS = 2**15
# Rows `row_block_sum` reduces per float64 dot by default. A block's float64 operands are then a
# few MiB and stay in cache; XLA:CPU (jaxlib 0.10) materializes them per block, and at 2^15 rows
# (192 MiB at d = 768) the probe's clipped sum over 50,000 x 768 rows took 408 ms against
# 32 ms at 2^10 (one clip norm; 40 stacked runs: 2048 -> 1015 ms; 512 and 256 rows: no
# faster). Smaller blocks only tighten the bound (its b^2 term), for more Neumaier steps.
SUM_BLOCK_ROWS = 2**10
# `sum_block_rows`: bytes of one block's float64 rows meant to stay in cache, and the size of
# sum below which a Neumaier step per block stays in cache too (1 MiB: the L2 of one core of
# the 2-core AMD EPYC it was measured on; its L3 is 32 MiB, shared).
BLOCK_BYTES = 4 << 20
SMALL_SUM_BYTES = 1 << 20
# `sum_block_rows`: the sum's entries per feature (runs x classes) up to which its blocks stay
# in cache whatever the sum's size (one run of up to 16 classes on wide rows).
SMALL_SUM_WIDTH = 16


def sum_block_rows(row_bytes: int, sum_bytes: int, views: int = 1) -> int:
    """Rows per block of a float64 row reduction (`row_block_sum`), from public shapes.

    A small sum (at most `SMALL_SUM_BYTES`, e.g. a probe of 1-3 runs on 3,969 features), or a
    narrow one (at most `SMALL_SUM_WIDTH` entries per feature: one run of up to 16 classes,
    e.g. on ScatterNet's 15,552 or 20,736 features), is reduced in blocks whose float64 rows fit
    `BLOCK_BYTES`: a power of two of rows, 32 to `SUM_BLOCK_ROWS` (a narrow sum of more than
    `SMALL_SUM_BYTES` has rows of more than 64 KiB, so 32: its blocks' Neumaier steps cost
    less the more views a row holds). Any other keeps `SUM_BLOCK_ROWS`, where each block's
    Neumaier step over the whole sum would cost more than the cache saves; so do devices other
    than the CPU.
    Measured (the probe's step on 60,000 x 3,969 float16 features, 10 classes, 2-core CPU,
    seconds per step at 1,024 / 256 / 128 / 64 rows): one run 1.03 / 0.78 / 0.44 / 0.43;
    three 1.60 / 1.97 / 1.09 / 1.08; fifteen 3.28 / 3.88 / 4.81 / - (so 1,024 from a sum of
    4.8 MB). One run of 10 classes on wider rows, where a 1,024-row block holds 127-170 MB of
    float64 operands, 1,024 -> 32 rows (`benchmarks/block_rows.py`, the trainer's step):
    8,192 x 15,552 features 0.40-0.74 -> 0.32-0.44 s, 1,437 x 20,736 0.10-0.14 -> 0.09-0.13 s.
    Only the speed changes: any block size of at most `MAX_BLOCK_ROWS` keeps the module
    docstring's bound.

    Args:
      row_bytes: bytes of one row's float64 operands (8 x features per row, all its views).
      sum_bytes: bytes of the float64 sum (8 x its entries).
      views: the views each row holds (the sum's entries per feature are
        `sum_bytes * views / row_bytes`).

    Returns:
      The rows per block.
    """
    narrow = sum_bytes * views <= SMALL_SUM_WIDTH * row_bytes
    if jax.default_backend() != "cpu" or (sum_bytes > SMALL_SUM_BYTES and not narrow):
        return SUM_BLOCK_ROWS
    rows = max(1, BLOCK_BYTES // max(1, row_bytes))
    return max(32, min(SUM_BLOCK_ROWS, 1 << (rows.bit_length() - 1)))


def x64_jit(fun=None, **jit_kwargs):
    """`jax.jit(fun, **jit_kwargs)`, traced and run with `jax.enable_x64` scoped to the call,
    so it may hold float64 sums; nothing outside it sees x64."""
    if fun is None:
        return functools.partial(x64_jit, **jit_kwargs)
    jitted = jax.jit(fun, **jit_kwargs)

    @functools.wraps(fun)
    def call(*args, **kwargs):
        with jax.enable_x64(True):
            return jitted(*args, **kwargs)

    # What callers ask of a jitted function (cache checks, lowering) is the jitted one's.
    call._cache_size, call.clear_cache = jitted._cache_size, jitted.clear_cache

    def lower(*args, **kwargs):
        with jax.enable_x64(True):
            return jitted.lower(*args, **kwargs)

    call.lower = lower
    return call


class CompensatedSum:
    """A Neumaier-compensated float64 sum of pytrees of parts (on the device, asynchronous)."""

    def __init__(self):
        self.total: Any = None
        self.compensation: Any = None

    def add(self, part) -> None:
        """Add one part (a pytree of arrays, any float dtype, widened to float64)."""
        if self.total is None:
            self.total, self.compensation = _start(part)
        else:
            self.total, self.compensation = _neumaier(self.total, self.compensation, part)

    def value(self):
        """The compensated total (a float64 pytree); None if nothing was added."""
        return None if self.total is None else _finish(self.total, self.compensation)


@x64_jit
def _start(part):
    total = jax.tree.map(lambda p: p.astype(jnp.float64), part)
    return total, jax.tree.map(jnp.zeros_like, total)


def _neumaier_step(total, compensation, part):
    """One Neumaier step per leaf: (total + part, the accumulated rounding errors)."""
    part = jax.tree.map(lambda p, t: p.astype(t.dtype), part, total)
    new = jax.tree.map(jnp.add, total, part)

    def error(total, part, new):  # the rounding error of total + part, exactly
        return jnp.where(jnp.abs(total) >= jnp.abs(part), (total - new) + part,
                         (part - new) + total)

    return new, jax.tree.map(jnp.add, compensation, jax.tree.map(error, total, part, new))


_neumaier = x64_jit(_neumaier_step)


@x64_jit
def _finish(total, compensation):
    return jax.tree.map(jnp.add, total, compensation)


def row_block_sum(block_sum, inputs: jax.Array, weights: jax.Array,
                  block_rows: int = SUM_BLOCK_ROWS):
    """`block_sum(inputs, weights)` (a pytree summed over the leading row axis), computed over
    blocks of at most `block_rows` rows and accumulated with Neumaier's sum in the blocks' dtype:
    inside a compiled program, so a reduction over many rows keeps the bound of the module
    docstring. The last block is the last `block_rows` rows, its rows already summed weighted 0.

    Args:
      block_sum: (inputs block, weights block) -> a pytree of sums over the block's rows.
      inputs, weights: arrays with the rows on their leading axis.
      block_rows: rows per block, at most `MAX_BLOCK_ROWS` (the bound's b).

    Returns:
      The pytree of sums over all rows.
    """
    if not 1 <= block_rows <= MAX_BLOCK_ROWS:
        raise ValueError(f"block_rows must be in [1, {MAX_BLOCK_ROWS}] for the sum's bound, "
                         f"got {block_rows}")
    rows = inputs.shape[0]
    if rows <= block_rows:
        return block_sum(inputs, weights)
    blocks = -(-rows // block_rows)
    block_rows = -(-rows // blocks)  # equal blocks: the last one overlaps by < `blocks` rows

    def part(index):
        start = jnp.minimum(index * block_rows, rows - block_rows)
        fresh = start + jnp.arange(block_rows) >= index * block_rows
        block_weights = jax.lax.dynamic_slice_in_dim(weights, start, block_rows)
        block_weights = jnp.where(fresh.reshape((-1,) + (1,) * (weights.ndim - 1)),
                                  block_weights, 0.0)
        return block_sum(jax.lax.dynamic_slice_in_dim(inputs, start, block_rows), block_weights)

    def body(index, carry):
        return _neumaier_step(*carry, part(index))

    first = part(0)
    total, compensation = jax.lax.fori_loop(1, blocks, body,
                                            (first, jax.tree.map(jnp.zeros_like, first)))
    return jax.tree.map(jnp.add, total, compensation)


# Rows added per unrolled block of `weighted_rows_sum`, and the number of entries (all rows)
# below which it keeps a plain reduction (unrolled blocks would only lengthen the program; the
# plain one's materialized products stay under 2 MiB).
_UNROLLED_ROWS = 32
_UNROLLED_MIN_SIZE = 2**18


def weighted_rows_sum(rows: jax.Array, weights: jax.Array, acc,
                      keep: jax.Array | None = None) -> jax.Array:
    """sum_i weights_i rows_i over the leading axis in dtype `acc`, each product formed in
    `acc` (exact for float32 operands in float64) and the n products added in some order, so
    within gamma_n sum_i |weights_i rows_i| (Higham, any order), as `jnp.sum` of the products.

    Written as adds of row slices (blocks of `_UNROLLED_ROWS` unrolled, in a loop over
    blocks) for `_UNROLLED_MIN_SIZE` entries or more in all, because XLA:CPU (jaxlib 0.10)
    hands `jnp.sum` over the leading axis to YNNPACK, which materializes the broadcast weights
    and the products in `acc` and reduced 13x slower (32 x 147,456: 44 ms against 3.4 ms;
    WRN-16-4's clipped sum per batch of 32, x64: 982-1043 -> 772-809 ms); the small CNN's
    256 x 8,192 second convolution's products in float64 (16 MiB) were its clipped sum's peak.

    `keep` (n,) bool: a row not kept adds exactly zero, whatever it holds (NaN included),
    selected inside the sum's loop rather than in a zeroed copy of every row first."""
    weights = weights.astype(acc)
    keep = jnp.ones(rows.shape[:1], bool) if keep is None else keep
    if rows.size < _UNROLLED_MIN_SIZE:
        shape = (-1,) + (1,) * (rows.ndim - 1)
        return jnp.sum(jnp.where(keep.reshape(shape), rows.astype(acc) * weights.reshape(shape),
                                 0.0), axis=0)

    def block(r, w, k, count):
        terms = [jnp.where(k[i], r[i].astype(acc) * w[i], 0.0) for i in range(count)]
        return functools.reduce(operator.add, terms) if terms else jnp.zeros(r.shape[1:], acc)

    n = rows.shape[0]
    full, tail = divmod(n, _UNROLLED_ROWS)
    if full <= 1:
        return block(rows, weights, keep, n)
    tail_sum = block(rows[n - tail:], weights[n - tail:], keep[n - tail:], tail)

    def body(index, total):
        start = index * _UNROLLED_ROWS
        return total + block(*(jax.lax.dynamic_slice_in_dim(v, start, _UNROLLED_ROWS)
                               for v in (rows, weights, keep)), _UNROLLED_ROWS)

    return jax.lax.fori_loop(0, full, body, tail_sum)


def add_parts(total: CompensatedSum | None, part) -> CompensatedSum:
    """`total` with `part` added (a new `CompensatedSum` when `total` is None): the one line a
    trainer's loop over chunks or physical batches needs; read it with `.value()`."""
    total = CompensatedSum() if total is None else total
    total.add(part)
    return total


def add_float64(total, part):
    """`total` + `part` leaf by leaf in float64 (`part` when `total` is None): a plain float64
    sum, for a few parts whose running total is a pytree the caller hands on (as a finetune
    step's physical batches are added in `finetune.batch_sums.stacked_sums`). k parts of a
    batch of B rows add at most (k - 1) u B C to the rounding (u = 2^-53): below 1e-6 C for B
    up to 10^6 rows in physical batches of 256. A first part already float64 is returned as
    it is (no call: host time on a GPU)."""
    if total is None:
        wide = all(getattr(leaf, "dtype", None) == jnp.float64 for leaf in jax.tree.leaves(part))
        return part if wide else _start(part)[0]
    return _add64(total, part)


@x64_jit
def _add64(total, part):
    return jax.tree.map(lambda t, p: t.astype(jnp.float64) + p.astype(jnp.float64), total, part)
