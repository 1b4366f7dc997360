"""Exact scaling by powers of two, for float32 norm bounds that must not under- or overflow
(`dp.bookkeeping`). Hand-written because XLA's exp2 on CPU is not exact at integers, and a
bound scaled by an inexact power of two is no longer a bound."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["mul_pow2", "unit_scale", "unscale", "unscale_pair"]


def _pow2(k: jax.Array) -> jax.Array:
    """2^k exactly (float32) for integer k in [-126, 127], built from its bits: XLA's exp2 on
    CPU is not exact at integers (221 of those 254 values are off by up to ~1e-7 relative)."""
    return jax.lax.bitcast_convert_type((k.astype(jnp.int32) + 127) << 23, jnp.float32)


def mul_pow2(x: jax.Array, exponent: jax.Array) -> jax.Array:
    """x 2^exponent exactly (short of flushing and overflow), |exponent| <= 500, by four
    powers of two of the same sign, so an intermediate never flushes to zero or overflows
    unless the result does (scaling by one exponent and then another could: a review found
    2^-126 A with 2^127 B giving U = 0, an unclipped example)."""
    quarter = jnp.sign(exponent) * (jnp.abs(exponent) // 4)
    step = _pow2(quarter)
    return x * step * step * step * _pow2(exponent - 3 * quarter)


def unit_scale(x: jax.Array, peak: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x / 2^e per example, where peak = m 2^e (m in [0.5, 1)): entries in [-1, 1], exactly
    (`mul_pow2`: a reciprocal of a peak above ~1e38 would be subnormal and XLA flushes it to
    zero). Returns (scaled x, e)."""
    _, exponent = jnp.frexp(jnp.where(jnp.isfinite(peak), peak, 0.0))
    shape = (-1,) + (1,) * (x.ndim - 1)
    return mul_pow2(x, -exponent.reshape(shape)), exponent


def unscale(value: jax.Array, exponent: jax.Array, peak: jax.Array) -> jax.Array:
    """value 2^e (`mul_pow2`, so only a true overflow gives inf); NaN/inf where the peak was
    not finite."""
    return jnp.where(jnp.isfinite(peak), mul_pow2(value, exponent), peak)


def unscale_pair(value: jax.Array, a_exp: jax.Array, a_peak: jax.Array, b_exp: jax.Array,
                 b_peak: jax.Array) -> jax.Array:
    """value 2^(e_a + e_b) in one `mul_pow2` (unscaling by e_a and then by e_b could flush in
    between); NaN/inf where a peak was not finite."""
    value = mul_pow2(value, a_exp + b_exp)
    finite = jnp.isfinite(a_peak) & jnp.isfinite(b_peak)
    return jnp.where(finite, value, jnp.where(jnp.isfinite(a_peak), b_peak, a_peak))
