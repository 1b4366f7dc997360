"""Ghost norm through weight standardization: the book-keeping rule (`dp.taps.Rule.ghost`) of
`WSConv` (WRN-16-4) and `StdConv` (timm's StdConv2d, BiT) for layers with few tokens, without
forming any example's kernel gradient.

The layer computes y = A W_hat + bias with W_hat a standardization of the kernel V flattened to
(m, p), m the fan-in. Per filter j, with u_j = v_j - mean(v_j) and w0_j = u_j / |u_j|:

  * `WSConv` (`wrn.standardize_weight`): W_hat_j = gain_j u_j / s_j with s_j = sqrt(max(|u_j|^2,
    eps)); sc_j = gain_j / s_j, f_j = 1 (f_j = 0 where |u_j|^2 is floored at eps: the scale is
    then constant, and w0_j = u_j / sqrt(eps));
  * `StdConv` (`bit.standardize_std`, no gain): W_hat_j = r_j u_j with r_j = (|u_j|^2 / m +
    eps)^(-1/2); sc_j = r_j and f_j = r_j^2 |u_j|^2 / m in [0, 1) (eps additive: the scale
    moves with u_j, but less than 1 / |u_j| does).

In both, the chain rule through the standardization maps the filter's W_hat gradient g_j
(= A^T b_j) to

    d kernel_j = sc_j (P g_j - f_j q_j w0_j),   d gain_j = q_j = w0_j . g_j (WSConv only),

P the centring I - 1 1^T / m (for StdConv: d W_hat = r P dV + u dr with dr = -r^3 u . dV / m,
so the transpose is r P g - r^3 |u|^2 q w0 / m). P g_j = A_c^T b_j with A_c the patches
centred over their m features, and q_j = (A_c w0_j) . b_j. With B' = B sc (column j times
sc_j) and w0_j . P g_j = q_j, an example's squared norm is therefore

    |A_c^T B'|^2 - sum_j f_j sc_j^2 q_j^2 (2 - f_j |w0_j|^2) + [sum_j q_j^2: the gain],

the first term a ghost norm (`dp.bookkeeping`), the others from q (n, p), which costs one more
product A_c W0 (the layer's forward again, as one matmul). The clipped sum is the einsum
sum_i c_i A_c,i^T B'_i minus (f sc w0) times Q = sum_i c_i q_i (the gain's clipped sum).

Rounding. The map actually applied is the one of the computed w0, sc, f >= 0 (functions of the
parameters only) and the computed A_c, so q_j = (A_c w0_j) . b_j and w0_j . (A_c^T b_j) are equal
exactly and the identity above holds for any computed w0 (no exact centring or unit norm is
needed); the computed q~ differs from q by at most err_j = gamma_(m+T+2) |w0_j| sum_t
|a_t||b_tj| (Higham), so q^2 >= L_j = q~_j^2 - 2 |q~_j| err_j, and with e_j >= |w0_j|^2 (rounded
up) and 2 - f_j e_j >= 0, f_j q_j^2 (2 - f_j |w0_j|^2) >= f_j (2 - f_j e_j) L_j (when L_j < 0
the right side is <= 0 <= the left). The example's term (c times the map of its g, with q~ in
place of q) therefore has squared norm at most

    N^2 - sum_j f_j sc_j^2 (2 - f_j e_j) L_j + [sum_j q~_j^2],

N the ghost bound of |A_c^T B'|; each sum is rounded down (the subtracted one, by gamma of
its terms' absolute values) or up by its gamma, a flushed term by its 2^-126, and the einsum's
charge (gamma_(T+8) tau) is added after the square root, as for any ghost layer. The
correction by f sc w0 Q is applied after the reduction over the batch, in float64 inside an
`x64_jit` program: `slack` bounds how far that reduction moves the other examples' terms
(dp.bookkeeping's guarantee).
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


# A StdConv's bound on f sc |q~| relative to the example's own bound (`_WSGhost.norm`): raised
# where the ratio exceeds it, which a gradient does only when nearly parallel to its filter
# (the direction the standardization removes); 2^10 keeps the slack's share n^2 2^-43 (3e-8 at
# n = 256).
STD_TOP = 2.0**10


def _ws_map(module, floor_eps: float):
    """(w0 (m, p), sc (p,), f (p,) >= 0, e (p,) >= |w0_j|^2) of a `WSConv` (a gain: the
    floored spread of `standardize_weight`) or a `StdConv` (no gain: `module.eps` added to the
    variance, `bit.standardize_std`), module docstring."""
    w = module.kernel[...].astype(jnp.float32)
    mean = w.mean(axis=(0, 1, 2), keepdims=True)
    fan_in = math.prod(w.shape[:-1])
    gain = getattr(module, "gain", None)
    if gain is not None:
        spread = fan_in * w.var(axis=(0, 1, 2), keepdims=True)
        rs = jax.lax.rsqrt(jnp.maximum(spread, floor_eps))
        w0 = ((w - mean) * rs).reshape(fan_in, -1)
        sc = rs.reshape(-1) * gain[...].astype(jnp.float32)
        f = (spread > floor_eps).reshape(-1).astype(jnp.float32)
    else:
        u = (w - mean).reshape(fan_in, -1)
        squares = jnp.sum(jnp.square(u), axis=0)
        var = squares / fan_in
        sc = jax.lax.rsqrt(var + module.eps)
        f = var * jnp.square(sc)
        w0 = u * jax.lax.rsqrt(jnp.maximum(squares, _TINY))  # a zero filter: w0 = 0
    e = jnp.sum(jnp.square(w0), axis=0) * (1.0 + gamma(fan_in + 2)) + fan_in * _TINY
    return w0, sc, f, e


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
        w0, sc, f, e = _ws_map(module, self.eps)
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
        # f q^2 (2 - f |w0|^2) from below: L = q~^2 - 2 |q~| err <= q^2 <= (|q~| + err)^2
        # (module docstring; 2 - f e < 0 cannot happen with f <= 1, |w0| ~ 1, but is bounded).
        weight = f * jnp.square(sc)
        factor = 2.0 - f * e
        high = jnp.square(jnp.abs(q) + err)
        lower = weight * factor * jnp.where(
            factor >= 0.0, jnp.square(q) - 2.0 * jnp.abs(q) * err, high)
        spread = weight * jnp.abs(factor) * high
        drop = (jnp.sum(lower, axis=1) - 2.0 * gamma(filters + 8) * jnp.sum(spread, axis=1)
                - filters * 4 * _TINY)
        gains = 0.0  # the gain's own term (WSConv's), module docstring
        if getattr(module, "gain", None) is not None:
            gains = (jnp.sum(jnp.square(q), axis=1) * (1.0 + gamma(filters + 2))
                     + filters * _TINY)
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
        if getattr(module, "gain", None) is not None:
            # The gain's term puts |q~_j| <= N: |c f sc q~| <= max f |sc| C (parameters only).
            top = jnp.max(jnp.where(f > 0, jnp.abs(sc), 0.0))
        else:
            # No gain: q~ is not bounded by the example's norm (f near 1 lets a large q hide
            # behind a small kernel gradient), so the bound is raised to at least
            # max_j f_j sc_j |q~_j| / STD_TOP (the 2^-20: the product's float32 rounding). It
            # stays an upper bound of the example's norm (so clipping to C holds), it binds
            # only where that ratio exceeds STD_TOP, and it makes |c f sc q~| <= STD_TOP C
            # for every row: a public constant, never a statistic of the batch.
            reach = jnp.max(f * jnp.abs(sc) * jnp.abs(q), axis=1) * (1.0 + 2.0**-20) / STD_TOP
            norm = jnp.maximum(norm, reach)
            top = jnp.asarray(STD_TOP, jnp.float32)
        return norm, (a_c, b_sc, q, w0, sc, f, top)

    @staticmethod
    def slack(examples: int, data) -> jax.Array:
        """The bound, relative to C, of how far this layer's reduction over the batch moves the
        other examples' terms (`dp.bookkeeping.reduction_slack`): the einsum's n T exact
        float64 products round within gamma_nT sum_i c_i tau_i <= n^2 2^-29 C (U carries
        gamma32_(T+8) tau). The correction f sc w0 Q: |c_i f_j sc_j q~_ij| <= top C, with top
        a function of the parameters and public constants only, never of the batch (so the
        clip norm this slack lowers is the same on neighbouring batches): max f |sc| for a
        WSConv, whose gain term puts |q~| within the example's bound N_i, and `STD_TOP` for
        a StdConv, whose bound `norm` raises to at least f sc |q~| / STD_TOP; Q's sum of n
        exact products then rounds within n^2 2^-53 top C, and the subtraction's float64
        rounding is within 2^-53 of |einsum| + |correction| <= n (1 + 2 top) C (and a gain's
        own sum within n^2 2^-53 C)."""
        top = data[-1]
        n2 = float(examples) ** 2
        return n2 * 2.0**-29 * (1.0 + 2.0**-20) + 4.0 * n2 * 2.0**-53 * (1.0 + top)

    @staticmethod
    def sums(module, data, factor: jax.Array, keep: jax.Array,
             acc=jnp.float32) -> dict[str, jax.Array]:
        """The clipped sums of the kernel and (WSConv's) gain (module docstring), reduced over
        the batch in `acc` (float64 inside an `x64_jit` program, `dp.bookkeeping`)."""
        a_c, b_sc, q, w0, sc, f, _ = data
        gains = weighted_sum(q, factor, keep, acc)
        kernel = ghost_sum(a_c, b_sc, factor, keep, acc)
        kernel = kernel - (f * sc * w0).astype(acc) * gains
        sums = {"kernel": kernel.reshape(module.kernel.shape)}
        if getattr(module, "gain", None) is not None:
            sums["gain"] = gains.reshape(module.gain.shape)
        return sums


WS_GHOST = _WSGhost()
