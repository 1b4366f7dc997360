"""Ghost norm through weight standardization: the book-keeping rule (`dp.taps.Rule.ghost`) of
`WSConv` for layers with few tokens, without forming any example's kernel gradient.

The layer computes y = A W_hat + bias with W_hat = standardize(V, gain) (`wrn.standardize_weight`)
flattened to (m, p), m the fan-in. Per filter j, with u_j = v_j - mean(v_j), s_j = |u_j| (the
standard deviation times sqrt(m)), w0_j = u_j / s_j and sc_j = gain_j / s_j, the chain rule
through the standardization maps the filter's W_hat gradient g_j (= A^T b_j) to

    d kernel_j = sc_j (P g_j - f_j w0_j q_j),   d gain_j = q_j = w0_j . g_j,

P the centring I - 1 1^T / m and f_j = 1 (f_j = 0 where m var_j is floored at eps, s_j = sqrt(eps):
the scale is then constant). P g_j = A_c^T b_j with A_c the patches centred over their m
features, and q_j = (A_c w0_j) . b_j. With B' = B sc (column j times sc_j) and |w0_j| = 1, w0_j
orthogonal to 1, an example's squared norm is therefore

    |A_c^T B'|^2 - sum_j f_j sc_j^2 q_j^2 (2 - |w0_j|^2) + sum_j q_j^2,

the first term a ghost norm (`dp.bookkeeping`), the others from q (n, p), which costs one more
product A_c W0 (the layer's forward again, as one matmul). The clipped sum is the einsum
sum_i c_i A_c,i^T B'_i minus (f sc w0) times Q = sum_i c_i q_i (the gain's clipped sum).

Rounding. The map actually applied is the one of the computed w0, sc, f (functions of the
parameters only) and the computed A_c, so q_j = (A_c w0_j) . b_j and w0_j . (A_c^T b_j) are equal
exactly; the computed q~ differs from q by at most err_j = gamma_(m+T+2) |w0_j| sum_t |a_t||b_tj|
(Higham), so with e_j >= |w0_j|^2 (rounded up) the example's term (c times the map of its g,
with q~ in place of q) has squared norm at most

    N^2 - sum_j f_j sc_j^2 (q~_j^2 (2 - e_j) - 2 |q~_j| err_j) + sum_j q~_j^2,

N the ghost bound of |A_c^T B'|; each sum is rounded down (the subtracted one) or up by its
gamma, a flushed term by its 2^-126, and the einsum's charge (gamma_(T+8) tau) is added after
the square root, as for any ghost layer. The correction by f sc w0 Q is applied after the
reduction over the batch, in float64 inside an `x64_jit` program: `slack` bounds how far that
reduction moves the other examples' terms (dp.bookkeeping's guarantee).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dpprobe.dp.bookkeeping import _SMALL, ghost_sum, weighted_sum
from dpprobe.dp.norm_bounds import HIGHEST, gamma, ghost_scaled
from dpprobe.dp.scaling import mul_pow2, unit_scale, unscale_pair
from dpprobe.finetune.models.wrn import WS_EPS

__all__ = ["WS_GHOST"]

_TINY = 2.0**-125


def _ws_map(kernel: jax.Array, gain: jax.Array, eps: float):
    """(w0 (m, p), sc (p,), f (p,), e (p,) >= |w0_j|^2), as `standardize_weight` computes them."""
    w = kernel.astype(jnp.float32)
    mean = w.mean(axis=(0, 1, 2), keepdims=True)
    fan_in = math.prod(kernel.shape[:-1])
    spread = fan_in * w.var(axis=(0, 1, 2), keepdims=True)
    rs = jax.lax.rsqrt(jnp.maximum(spread, eps))
    w0 = ((w - mean) * rs).reshape(fan_in, -1)
    e = jnp.sum(jnp.square(w0), axis=0) * (1.0 + gamma(fan_in + 2)) + fan_in * _TINY
    return w0, rs.reshape(-1) * gain.astype(jnp.float32), (spread > eps).reshape(-1), e


class _WSGhost:
    """The rule's three hooks (`dp.taps.Rule.ghost`)."""

    eps: float = WS_EPS

    @staticmethod
    def prefer(examples: int, tokens: int, fan_in: int, filters: int) -> bool:
        """Ghost when T (m + p) < m p and the batch's gradients would take more than 2^20
        floats. Measured, not a flop count (which favours instantiation at T^2 (m + p) > m p,
        `dp.bookkeeping.layer_plan`): instantiating this layer also writes and reads every
        example's gradient through the standardization's chain rule and the float64 sum, so
        on WRN-16-4 (p 32, 2 CPU cores) stage 3 (T = 49) is faster by ghost (783 against 876
        ms per batch, 482 against 679 MiB, before `dp.bookkeeping.after`) and stage 2
        (T = 196) by instantiation (794 against 987 ms); this rule separates the two."""
        return tokens * (fan_in + filters) < fan_in * filters and (
            examples * fan_in * filters > _SMALL)

    def norm(self, module, a: jax.Array, b: jax.Array):
        """(bound (n,) of each example's term, data for `sums`) from a (n, T, m), b (n, T, p)."""
        tokens, fan_in, filters = a.shape[1], a.shape[2], b.shape[2]
        w0, sc, f, e = _ws_map(module.kernel[...], module.gain[...], self.eps)
        a_c = a - jnp.mean(a, axis=2, keepdims=True)
        b_sc = b * sc
        bound, charge, _, _, bsc_exp, bsc_peak = ghost_scaled(a_c, b_sc)
        a_peak = jnp.max(jnp.abs(a_c), axis=(1, 2))
        b_peak = jnp.max(jnp.abs(b), axis=(1, 2))
        a_s, a_exp = unit_scale(a_c, a_peak)
        b_s, b_exp = unit_scale(b, b_peak)
        z = jnp.einsum("ntm,mp->ntp", a_s, w0, precision=HIGHEST)
        q = jnp.sum(z * b_s, axis=1)  # (n, p), in units of 2^(a_exp + b_exp)
        rows = jnp.sqrt(jnp.sum(jnp.square(a_s), axis=2) + fan_in * _TINY) * (
            1.0 + gamma(fan_in + 2))
        tau = jnp.einsum("nt,ntp->np", rows, jnp.abs(b_s), precision=HIGHEST) * (
            1.0 + gamma(tokens + 4))
        err = gamma(fan_in + tokens + 2) * tau * jnp.sqrt(e) + (fan_in + 2) * tokens * _TINY
        weight = jnp.where(f, jnp.square(sc), 0.0)
        lower = weight * (jnp.square(q) * (2.0 - e) - 2.0 * jnp.abs(q) * err)
        spread = weight * (jnp.square(q) * jnp.abs(2.0 - e) + 2.0 * jnp.abs(q) * err)
        drop = (jnp.sum(lower, axis=1) - 2.0 * gamma(filters + 8) * jnp.sum(spread, axis=1)
                - filters * 4 * _TINY)
        gains = jnp.sum(jnp.square(q), axis=1) * (1.0 + gamma(filters + 2)) + filters * _TINY
        # The ghost bound in units of 2^(a_exp + b_exp): a_c's scaling is the same in both,
        # so only b's exponents differ; a flush of the power-of-two product loses < 2^-126.
        ghost = mul_pow2(bound, bsc_exp - b_exp) + 2.0 * _TINY
        # Positive terms first, then one subtraction: each rounds relative to its result.
        positive = (jnp.square(ghost) * (1.0 + gamma(2)) + gains + 2.0**-100) * (
            1.0 + gamma(4))
        total = (positive - drop) * (1.0 + gamma(2))
        scaled = jnp.sqrt(jnp.maximum(total, 0.0)) * (1.0 + gamma(2))
        norm = unscale_pair(scaled, a_exp, a_peak, b_exp, b_peak)
        ghost_charge = unscale_pair(charge, a_exp, a_peak, bsc_exp, bsc_peak)
        finite = jnp.isfinite(bsc_peak) & jnp.isfinite(a_peak) & jnp.isfinite(b_peak)
        norm = jnp.where(finite, (norm + ghost_charge) * (1.0 + gamma(2)), jnp.nan)
        q = unscale_pair(q, a_exp[:, None], a_peak[:, None], b_exp[:, None], b_peak[:, None])
        return norm, (a_c, b_sc, q, w0, sc, f)

    @staticmethod
    def slack(examples: int, data) -> jax.Array:
        """The bound, relative to C, of how far this layer's reduction over the batch moves the
        other examples' terms (`dp.bookkeeping.reduction_slack`): the einsum's n T exact
        float64 products round within gamma_nT sum_i c_i tau_i <= n^2 2^-29 C (U carries
        gamma32_(T+8) tau); the gains' sum of n exact products within n^2 2^-53 C, carried
        into the kernel by sc w0 (|w0_j| ~ 1), and the subtraction's float64 rounding is
        within 2^-53 of |einsum| + |correction| <= n (1 + 2 max sc) C."""
        _, _, _, _, sc, f = data
        top = jnp.max(jnp.where(f, jnp.abs(sc), 0.0))
        n2 = float(examples) ** 2
        return n2 * 2.0**-29 * (1.0 + 2.0**-20) + 4.0 * n2 * 2.0**-53 * (1.0 + top)

    @staticmethod
    def sums(module, data, factor: jax.Array, keep: jax.Array,
             acc=jnp.float32) -> dict[str, jax.Array]:
        """The clipped sums of the kernel and the gain (module docstring), reduced over the
        batch in `acc` (float64 inside an `x64_jit` program, `dp.bookkeeping`)."""
        a_c, b_sc, q, w0, sc, f = data
        gains = weighted_sum(q, factor, keep, acc)
        kernel = ghost_sum(a_c, b_sc, factor, keep, acc)
        kernel = kernel - (jnp.where(f, sc, 0.0) * w0).astype(acc) * gains
        return {"kernel": kernel.reshape(module.kernel.shape),
                "gain": gains.reshape(module.gain.shape)}


WS_GHOST = _WSGhost()
