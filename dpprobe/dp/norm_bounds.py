"""Rounding-safe upper bounds of per-example gradient norms for book-keeping clipping
(`dp.bookkeeping`, whose docstring gives the argument): Higham's gamma_m, blocked sums whose
rounding bound grows with 16 log16(m) instead of m, the norm of a formed gradient and the
ghost norm of A^T B from A and B, each scaled by powers of two so that no huge or tiny example
overflows or flushes to zero. Written here because no library bounds its norms' rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dpprobe.dp.scaling import unit_scale, unscale, unscale_pair

__all__ = ["HIGHEST", "blocked_sum", "gamma", "ghost_norm", "ghost_scaled", "scaled_norm"]

HIGHEST = jax.lax.Precision.HIGHEST
_U = 2.0**-24


def gamma(m: int) -> float:
    """Higham's gamma_m = m u / (1 - m u) for float32 (u = 2^-24): the relative error bound of
    a sum or dot product of m terms in any order."""
    return (m * _U) / (1.0 - m * _U)


_BLOCK = 16


def blocked_sum(x: jax.Array) -> tuple[jax.Array, int]:
    """Row sums of x (n, m) by levels of at most 16 terms, and the number of terms k of their
    rounding bound: |computed - exact| <= gamma_k sum |x|, with k = the levels' sizes summed
    (about 16 log16(m), not m as for a sum in unknown order)."""
    terms = 0
    while x.shape[1] > 1:
        width = min(_BLOCK, x.shape[1])
        pad = -x.shape[1] % width
        x = jnp.pad(x, ((0, 0), (0, pad))).reshape(x.shape[0], -1, width).sum(axis=2)
        terms += width
    return x[:, 0], terms


def scaled_norm(g: jax.Array) -> jax.Array:
    """Upper bound of each example's L2 norm of g (n, ...), safe from underflow and overflow:
    scaled by the example's largest entry, squares summed by `blocked_sum`; the scaling, the
    squares and the sum round within gamma_(terms + 4) relative, the square root by u."""
    flat = g.reshape(g.shape[0], -1)
    peak = jnp.max(jnp.abs(flat), axis=1)
    scaled, exponent = unit_scale(flat, peak)
    sq, terms = blocked_sum(jnp.square(scaled))
    return unscale(jnp.sqrt(sq * (1.0 + gamma(terms + 4))) * (1.0 + gamma(2)), exponent,
                    peak)


def ghost_norm(a: jax.Array, b: jax.Array) -> jax.Array:
    """Upper bound of |A_i^T B_i| plus the einsum's rounding of c A_i^T B_i (module docstring),
    from a (n, T, d) and b (n, T, p), without forming A_i^T B_i."""
    bound, charge, a_exp, a_peak, b_exp, b_peak = ghost_scaled(a, b)
    return unscale_pair(bound + charge, a_exp, a_peak, b_exp, b_peak)


def ghost_scaled(a: jax.Array, b: jax.Array) -> tuple[jax.Array, ...]:
    """`ghost_norm`'s two terms before unscaling: (the bound of |A_i^T B_i|, the einsum's
    rounding charge gamma_(T+8) tau), both in units of 2^(e_a + e_b), and a's and b's
    exponents and peaks (`dp.scaling.unit_scale`)."""
    tokens, d, p = a.shape[1], a.shape[2], b.shape[2]
    a_peak = jnp.max(jnp.abs(a), axis=(1, 2))
    b_peak = jnp.max(jnp.abs(b), axis=(1, 2))
    a_s, a_exp = unit_scale(a, a_peak)
    b_s, b_exp = unit_scale(b, b_peak)
    a_gram = jnp.einsum("ntd,nsd->nts", a_s, a_s, precision=HIGHEST)
    b_gram = jnp.einsum("ntp,nsp->nts", b_s, b_s, precision=HIGHEST)
    # Flushes: scaled entries are in [-1, 1], so a product or Gram entry that XLA flushes to
    # zero (below 2^-126) loses less than d 2^-126 (a's) or p 2^-126 (b's) absolutely: with
    # the diagonals raised by that much, tau bounds sum_t |a_t| |b_t| however small a token
    # is next to the example's peak; the Gram form's absolute loss is within
    # T^2 (2 d p + 1) 2^-125.
    tiny = 2.0**-125
    a_diag = jnp.diagonal(a_gram, axis1=1, axis2=2) + d * tiny
    b_diag = jnp.diagonal(b_gram, axis1=1, axis2=2) + p * tiny
    sq, sq_terms = blocked_sum((a_gram * b_gram).reshape(a.shape[0], -1))
    tau, tau_terms = blocked_sum(jnp.sqrt(a_diag) * jnp.sqrt(b_diag))
    # Each Gram entry is within gamma_d (gamma_p) of |a_t| |a_s| (|b_t| |b_s|) of its exact
    # value, products round by u, the blocked sum adds gamma_(sq_terms) of the sum of
    # |terms| <= tau^2; tau itself is computed low by at most gamma_(d + p + tau_terms + 4).
    tau = tau * (1.0 + gamma(d + p + tau_terms + 4))
    slack = gamma(d + 1) + gamma(p + 1) + gamma(sq_terms + 2)
    flushed = tokens * tokens * (2.0 * d * p + 1.0) * tiny
    bound = jnp.sqrt((jnp.maximum(sq, 0.0) + slack * tau**2 + flushed) * (1.0 + gamma(2)))
    return bound, gamma(tokens + 8) * tau, a_exp, a_peak, b_exp, b_peak
