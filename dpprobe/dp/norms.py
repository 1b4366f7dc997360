"""Per-example gradient norms of a dense layer from its inputs and output gradients, without
forming the per-example gradient, bounded from above under float32 rounding.

A dense layer y_t = W^T a_t + b applied to the T tokens of one example (the K augmented views
of an example, averaged; later the positions of a sequence or the patches of a convolution) has
the per-example gradient g = (1/T) sum_t (a_t b_t^T, b_t), where b_t = dloss/dy_t. Its squared
norm needs only the Gram matrices of the tokens (the "ghost norm", Goodfellow 2015; Li et al.
2021, https://arxiv.org/abs/2110.05679; Bu et al. 2023, https://arxiv.org/abs/2210.00038):

    ||g||^2 = (1/T^2) sum_{t,s} (a_t . a_s + 1) (b_t . b_s).

For one token this is (||a||^2 + 1) ||b||^2, which is the linear probe's closed form
(`probe.clipping`): the probe is the one-layer case of this rule.

Rounding. The norm used for clipping is an *upper bound* of the exact norm that holds whatever
the float32 rounding: the output gradients enter scaled by their largest entry m (per example
and config), so that no square of a tiny gradient flushes to zero and hides an example of
norm up to ~1e19; with B = ((1/T) sum_t sqrt(||a_t||^2 + 1) ||b_t||)^2 (the triangle bound, all
terms positive), the computed squared norm S' satisfies |S' - S| <= gamma B with
gamma = 2 (d + p + T^2 + 8) 2^-24 (Higham's bound for sums and dot products of n float32 terms,
doubled), so sqrt(S' + gamma B) >= ||g||. For T = 1, S = B and the bound is a relative
(1 + gamma) on the squared norm (about 1e-4 for d = 768); for tokens whose Gram form cancels
(large, nearly antipodal views) it keeps the clipped contribution within C where the float32
value alone would not; the bound is floored at B / 16 (below). Exact float64 norms would do the
same, but float64 reductions run many times slower than float32 on CPUs and GPUs. Every einsum
runs at `precision=HIGHEST`, so TF32 or bf16 passes on accelerators never enter the bound.
A norm that is not finite (NaN/Inf inputs, or an overflow) comes out NaN or inf: the clipper
gives that example factor 0.

Formal guarantee:
  For any finite float32 inputs, `dense_grad_norms` returns a value >= the exact L2 norm of
  the per-example gradient defined above (or NaN/inf).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["dense_grad_norms", "input_gram"]

_HIGHEST = jax.lax.Precision.HIGHEST
_F32_UNIT_ROUNDOFF = 2.0**-24


def input_gram(inputs: jax.Array) -> jax.Array:
    """Per-example Gram matrix of the tokens, (n, T, T), from inputs (n, T, d); for T = 1 it
    is ||a||^2."""
    return jnp.einsum("ntd,nsd->nts", inputs, inputs, precision=_HIGHEST)


def dense_grad_norms(gram: jax.Array, output_grads: jax.Array, *, in_dim: int) -> jax.Array:
    """Upper bounds (module docstring) on the L2 norms of each example's gradient of a dense
    layer with bias, averaged over its T tokens, for P stacked configs.

    Args:
      gram: (n, T, T) `input_gram` of the layer's inputs.
      output_grads: (n, T, P, p) dloss/dy per token and config (P = 1 for a single model).
      in_dim: d, the inputs' dimension (it enters the rounding bound).

    Returns:
      (n, P) norms; NaN or inf where the example is not finite.
    """
    tokens = output_grads.shape[1]
    gamma = 2.0 * (in_dim + output_grads.shape[-1] + tokens * tokens + 8) * _F32_UNIT_ROUNDOFF
    peak = jnp.max(jnp.abs(output_grads), axis=(1, 3))  # (n, P)
    scaled = output_grads / jnp.maximum(peak, jnp.finfo(output_grads.dtype).tiny)[
        :, None, :, None]
    if tokens == 1:  # sqrt(||a||^2 + 1) ||b||: a product of positive terms.
        grad_norms = jnp.sqrt(jnp.sum(jnp.square(scaled[:, 0]), axis=-1))
        bound = jnp.sqrt((gram[:, 0, 0, None] + 1.0) * (1.0 + gamma)) * grad_norms
        return peak * bound
    grad_gram = jnp.einsum("ntpc,nspc->npts", scaled, scaled, precision=_HIGHEST)
    sq_norms = jnp.einsum("nts,npts->np", gram + 1.0, grad_gram, precision=_HIGHEST) / tokens**2
    input_norms = jnp.sqrt(jnp.diagonal(gram, axis1=1, axis2=2) + 1.0)  # (n, T)
    scaled_norms = jnp.sqrt(jnp.diagonal(grad_gram, axis1=2, axis2=3))  # (n, P, T)
    triangle = jnp.einsum("nt,npt->np", input_norms, scaled_norms, precision=_HIGHEST) / tokens
    bound = jnp.maximum(sq_norms, 0.0) + gamma * jnp.square(triangle)
    # Floor at (triangle / 4)^2: the clipped sum adds the per-token terms a_t (s b_t) / T, of
    # total size s * triangle; the floor keeps them below 4 C, so the float32 rounding of that
    # sum stays ~1e-7 C instead of growing with a cancelling example's terms (up to
    # C / sqrt(gamma)). It clips harder only examples whose tokens cancel by more than 3/4.
    return peak * jnp.sqrt(jnp.maximum(bound, jnp.square(triangle / 4.0)))
