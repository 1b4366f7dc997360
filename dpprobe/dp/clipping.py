"""The clipping interface every trainer uses, null records, and the general clipper.

A **clipper** turns parameters and a batch into the sum over the batch of each example's
gradient clipped to L2 norm C, and the per-example norms it clipped with:

    clipper(params, batch, clip_norm, mask) -> ClippedSum(grads, norms)

`batch` is a tuple of arrays whose leading axis is the example; `mask` (n,) is 1 for an example
that counts and 0 for padding or a null record, which contributes exactly zero. Two clippers
exist today: the linear probe's closed form (`probe.linear_clipper`, one matmul for P stacked
configs, norms from `dp.norms`) and `per_example_clipper`, for any model, on
`jax_privacy.clipped_grad` (the gradient of each example, vmapped). Book-keeping clipping of
whole networks plugs in as a third. Every clipper passes the same contract tests
(`tests/contract.py`): leave-one-out within C, masked rows zero, C = inf gives the plain
gradient, no recompilation across batch sizes.

Null records. An example whose label lies outside the declared classes, whose input holds a
NaN or Inf, or whose gradient is not finite is a null record: it contributes exactly zero,
by a rule that looks at that example alone (`valid_labels`, `zero_nonfinite_rows`,
`null_if_nonfinite`), so no outcome depends on whether one private record is bad. A trainer's
input that holds a null record on purpose (an excluded canary) gives it the label `NULL_LABEL`.

Canary rows. Both clippers take `canaries` (`dp.canary_rows`): a row it marks has the gradient
value e_c on one coordinate c of the parameters in place of its loss's (the white-box audit's
Dirac canaries, `dp.canaries`), and is clipped and summed like any row, so that the audit sees
each layer's clipping and noise.

Formal guarantee:
  For every clipper here and any input values, each example with mask 1 contributes to
  `grads` a vector of L2 norm at most `clip_norm`, and each example with mask 0 contributes
  zero: the sum's L2 sensitivity is C for zero-out neighbours.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from dpprobe.dp.accumulate import FLOAT64_SUMS
from dpprobe.dp.canary_rows import CanaryRows, dirac_example

__all__ = ["NULL_LABEL", "ClippedSum", "Clipper", "null_if_nonfinite", "per_example_clipper",
           "valid_labels", "zero_nonfinite_rows"]

# The label a trainer's input gives a null record (an excluded canary): outside every class set.
NULL_LABEL = -1


class ClippedSum(NamedTuple):
    """What a clipper returns: the sum of the clipped per-example gradients (a pytree shaped
    like the parameters) and the per-example gradient norms it clipped with (private: for
    diagnostics only)."""

    grads: Any
    norms: jax.Array


class Clipper(Protocol):
    """(params, batch, clip_norm, mask) -> `ClippedSum` (module docstring)."""

    def __call__(self, params: Any, batch: tuple, clip_norm: jax.Array,
                 mask: jax.Array) -> ClippedSum: ...


def valid_labels(labels: jax.Array, num_classes: int) -> jax.Array:
    """Whether each label lies in [0, num_classes): a row whose label does not is a null
    record (works on NumPy and JAX arrays alike)."""
    return (labels >= 0) & (labels < num_classes)


def zero_nonfinite_rows(inputs: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`inputs` with every row (example) that holds a NaN or Inf set to zero, and `mask`
    zeroed there: such rows become null records. Trainers call it once per program, fused
    with the cast to float32, so it costs no extra pass over the inputs."""
    finite = jnp.isfinite(inputs.reshape(inputs.shape[0], -1)).all(axis=1)
    shape = (-1,) + (1,) * (inputs.ndim - 1)
    return jnp.where(finite.reshape(shape), inputs, 0.0), mask * finite


def null_if_nonfinite(grads: Any) -> Any:
    """One example's gradient, or zero if any coordinate is not finite (a null record): a
    function of that example alone, so the sum's sensitivity stays C."""
    finite = jnp.all(jnp.stack([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]))
    return jax.tree.map(lambda g: jnp.where(finite, g, 0.0), grads)


def per_example_clipper(loss: Callable[..., jax.Array], *, microbatch_size: int | None = None,
                        canaries: CanaryRows | None = None) -> Clipper:
    """The general clipper: each example's gradient of `loss`, clipped and summed
    (`jax_privacy.clipping.clipped_fun` over `jax.grad`, as `jax_privacy.clipped_grad` builds
    it, with the norms its clipping used: asking `clipped_grad` for them would compute every
    gradient's norm a second time).

    Args:
      loss: `loss(params, *example)`, the scalar loss of one example given with a leading
        batch axis of 1 (how `jax_privacy.clipped_grad` calls it).
      microbatch_size: examples per vmapped chunk inside a batch (less memory, more
        sequential work); None: the whole batch at once.
      canaries: batch -> (coordinate, value) per row (`dp.canary_rows`): a row with a
        coordinate >= 0 is a Dirac canary, its gradient value e_coordinate over the flattened
        parameters in place of its loss's, then clipped and summed as any row's.

    Returns:
      A `Clipper`. A gradient with a non-finite coordinate is zeroed before clipping
      (`null_if_nonfinite`); clipping is float32, the sum float64 inside an `x64_jit` program
      (`dp.accumulate`), float32 outside.
    """
    from jax_privacy.clipping import clipped_fun

    def example_grad(params, *example):
        if canaries is None:
            return null_if_nonfinite(jax.grad(loss)(params, *example))
        *example, coordinate, value = example  # (1,) each: one example with its batch axis
        grads = dirac_example(jax.grad(loss)(params, *example), coordinate[0], value[0])
        return null_if_nonfinite(grads)

    def clip(params, batch: tuple, clip_norm, mask) -> ClippedSum:
        if canaries is not None:
            batch = (*batch, *canaries(batch))
        clipped = clipped_fun(example_grad, batch_argnums=tuple(range(1, 1 + len(batch))),
                              l2_clip_norm=clip_norm, return_norms=True,
                              microbatch_size=microbatch_size,
                              dtype=jax.dtypes.canonicalize_dtype(FLOAT64_SUMS))
        grads, aux = clipped(params, *batch, is_padding_example=mask == 0)
        return ClippedSum(grads, aux[-1])  # jax_privacy 2.0 returns ((), norms) here

    return clip
