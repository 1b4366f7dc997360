"""Book-keeping clipping: the clipped sum of per-example gradients of a whole Flax NNX network
from one forward and one backward pass, without per-example gradients of its kernels.

Bu et al. 2023, "Differentially Private Optimization on Large Model at Small Cost"
(https://arxiv.org/abs/2210.00038), on the ghost norm (Goodfellow 2015; Li et al. 2021,
https://arxiv.org/abs/2110.05679). For a layer y_t = a_t W over the tokens t of one example
(its K augmented views are more tokens of the same example; a convolution's tokens are its
im2col patches), the example's kernel gradient is g = A^T B with B = dloss/dy, so

  * its squared norm is sum_{t,s} (a_t . a_s)(b_t . b_s) (ghost: never forms g, costs T^2 (d+p))
    or |A^T B|^2 (instantiated: forms g, which the clipped sum reuses), chosen per layer by
    time and space (`layer_plan`);
  * the clipped sum over examples is sum_i c_i A_i^T B_i: one einsum per layer (ghost) or the
    c-weighted sum of the instantiated g_i.

One pass: the model runs under `jax.vmap` over examples with every tapped layer's output
perturbed by zero (`dp.taps`) and every other trained parameter offset by a per-example zero;
`jax.grad` of the summed loss with respect to the perturbations and the offsets gives each
layer's B and each example's gradient of the small parameters (biases, norm scales and offsets,
class token, position embedding, gains of layers without a rule) in the same backward pass,
which never computes a kernel gradient. A parameter no rule covers is thus still exact, only
instantiated (`notices` says which are large). Written here because no JAX library has it.

Rounding. Each example's factor is c = min(1, C / U) with U an upper bound of the norm of what
the example adds to the computed float32 sum (Higham's bound for sums and dot products of m
float32 terms, gamma_m = m 2^-24 / (1 - m 2^-24), doubled for safety):
  * instantiated parts: the computed g itself is what is summed (times c), so U needs only the
    norm's rounding: sqrt(S' (1 + gamma)) with S' the computed sum of squares, scaled by the
    example's largest entry so that no square flushes to zero or overflows;
  * ghost parts: the computed Gram form S' of the exact |A^T B|^2 is within gamma_G tau^2 of it
    (tau = sum_t |a_t| |b_t|, the triangle bound), and the einsum that forms sum_i c_i A_i^T B_i
    adds to example i's term an error of norm <= gamma_T c tau; so U adds both.
  * a rule's own ghost norm (`Rule.ghost`: a layer whose gradients are a fixed linear map of
    A^T B, e.g. weight standardization, `finetune.models.ws_ghost`): the rule bounds its term
    with the same Gram form and charge, plus the rounding of its correction terms.
A non-finite norm (NaN/Inf anywhere in the example's A, B or gradients) gives factor 0, and a
masked example factor 0; its A, B and gradients are replaced by zeros before any sum.

A token far smaller than its example's largest entry may flush to zero in the scaled Gram
form; the bound adds the absolute loss that flushing can cause (d 2^-126 per Gram entry), so
such a token still counts (a review found contributions of 1e18 C without it).

The reduction over the batch's examples. Inside an `x64_jit` program every sum over examples
(the ghost layers' einsum, the c-weighted sums of instantiated gradients) accumulates in
float64 from float32 operands, whose products are exact. In float32 it would have no bound
that holds for all data: a term that rounds far below its magnitude (tokens that cancel) or
a sum of size n C makes the other examples' terms round by up to n C u each. In float64, with
kappa = `reduction_slack(n, G, L)` (n examples, G ghost layers, L norms combined):
  * a ghost layer's sum of n T exact products rounds within gamma_nT sum_i c_i tau_i (Higham,
    any order; u = 2^-53), and c_i tau_i <= C 2^12 / sqrt(d + p + 2) because U carries the
    Gram form's slack, at least sqrt(d + p + 2) 2^-12 tau: at most n^2 T 2^-41 / sqrt(d + p + 2)
    C per layer, whatever the data;
  * an instantiated leaf's sum of n exact products c_i g_i rounds within gamma_n sum_i c_i
    |g_i|, and over L leaves within n^2 sqrt(L) 2^-53 C;
  * a rule's own ghost norm states its reduction's bound (`Rule.ghost.slack`; weight
    standardization: n^2 2^-29 C for its einsum, as U carries gamma32_(T+8) tau, plus its
    correction's, scaled by the largest gain / s, `finetune.models.ws_ghost`);
so the clipping bound used is C / (1 + kappa), kappa twice their sum plus a margin (D and D'
each round): kappa = 3.5e-8 for a ViT-tiny at 32 px and n = 64 (48 ghost layers, T = 5),
7.6e-6 for WRN-16-4 at n = 32 (two weight-standardized ghost layers), an effective clipping
bound lower by that much.

Formal guarantee:
  For any inputs, each example with mask 1 has a term in the returned sum (its c g, before
  the reduction over examples) of L2 norm at most C (1 + 4 2^-24) (the last product c g rounds
  each entry by one unit), and each example with mask 0 or a non-finite gradient has the term
  zero. Inside an `x64_jit` program, for zero-out neighbours D, D' (one example's mask 1 in D,
  0 in D', the batch otherwise the same: XLA computes each example's terms the same way
  whatever the others hold: always on CPU, on GPU with `--xla_gpu_deterministic_ops=true`),
  for C >= 2^-100 (a norm that flushes below float32's normal range is below 2^-120), the
  two computed float64 sums differ in L2 norm by at most
  C (1 + 4 2^-24 + kappa) / (1 + kappa) (1 + 2^-24) <= C (1 + 3.1e-7), for any data (the
  reduction above; the trainers add physical batches in float64, `dp.accumulate`). Outside
  x64 the reduction is float32 and only the per-example term is bounded.
  Limitation: a parameter shared by two layers (tied weights) is tapped at its first layer
  only, so its gradient misses the other use; the bound still holds for what is summed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dpprobe.dp import flax_rules as _flax_rules  # noqa: F401 - registers nnx.Conv's rules
from dpprobe.dp.accumulate import FLOAT64_SUMS, weighted_rows_sum
from dpprobe.dp.canary_rows import CanaryRows, dirac_ghost, dirac_piece, dirac_rows, leaf_starts
from dpprobe.dp.clipping import ClippedSum, Clipper
from dpprobe.dp.norm_bounds import HIGHEST, gamma, ghost_norm, scaled_norm
from dpprobe.dp.scaling import unit_scale, unscale
from dpprobe.dp.taps import (
    Taps,
    notify_uncovered,
    promote_float32,
    rule_for,
    tap_model,
    tappable_layers,
)

__all__ = ["after", "bookkeeping_clipper", "layer_plan", "reduction_slack"]

def _leaf_path(key_path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", None)))
                 for k in key_path if not (hasattr(k, "name") and k.name == "value"))


_SMALL = 2**20
_LARGE = 2**26
_GHOST_TIME = 3  # ghost when T^2 (d + p) < 3 d p (`layer_plan`: measured)


def layer_plan(examples: int, tokens: int, in_dim: int, out_dim: int) -> str:
    """"ghost" or "instantiate" for a layer of T tokens and a (d, p) kernel, by time and space.

    Time, multiply-adds per example (Bu et al. 2023, Table 2): the ghost norm's Gram forms cost
    T^2 (d + p) and its clipped sum (one einsum of A and the c-scaled B) T d p; instantiation
    forms g for T d p, then its norm and the c-weighted sum read g (2 d p). Both pay T d p,
    which that count then cancels; but they do not pay it alike: instantiation forms g as n
    small matmuls with T-long contractions and writes n d p floats that two passes read again,
    where the ghost's clipped sum is one matmul over all n T rows. So ghost saves time when
    T^2 (d + p) < 3 d p, a factor measured on the layers near it (one physical batch's clipped
    sum over the plain gradient, plans alternated in one process, medians of 7): ResNet-18's
    stage-2 3 x 3 convolutions at 32 px (T = 16, ratio 2.2 and 2.4) 1.33 -> 1.13 of the plain
    gradient with ghost; Lite0's 1 x 1 convolutions at 64 px (T = 16, ratio 2.7-2.8) 0.96 ->
    0.87; but ConvNeXt-atto's stage-2 MLP layers at 32 px (ratio 4.0-4.8) 1.49 -> 1.58 and
    ResNet-18's 1 x 1 shortcut (ratio 6) no better, so they stay instantiated. Space:
    instantiation holds n d p floats, ghost 2 n T^2 (ghost saves space when 2 T^2 < p d).
    Ghost when it saves space and either time too (few tokens: a ViT at 32 px, T = 5,
    measured 216 ms per batch against 1,211 with every layer instantiated) or the gradients
    would exceed 2^26 floats; instantiation when they are small (n d p <= 2^20) or time
    favours it (a ViT at 224 px, T = 197; the small CNN's second convolution, T = 25,
    d = 256, p = 32, ratio 22: its clipped sum 22.2 -> 20.5 ms per batch of 256). (The rule
    before compared T (d + p) with d p, charging the Gram forms against forming g and
    forgetting the ghost's own einsum.)"""
    gradients = examples * in_dim * out_dim
    if gradients <= _SMALL or 2 * tokens * tokens >= in_dim * out_dim:
        return "instantiate"
    if (tokens * tokens * (in_dim + out_dim) < _GHOST_TIME * in_dim * out_dim
            or gradients > _LARGE):
        return "ghost"
    return "instantiate"


def reduction_slack(examples: int, ghost_layers: list[tuple[int, int, int]],
                    leaves: int, rules: Any = 0.0) -> Any:
    """kappa: how far, relative to C, the float64 reduction over a batch of `examples` can move
    the other examples' terms when one is removed (module docstring), with a margin; a ghost
    layer is (tokens, in_dim, out_dim), `leaves` the norms combined into each example's,
    `rules` the sum of the rules' own bounds (`Rule.ghost.slack`, relative to C)."""
    n2 = float(examples) ** 2
    ghost = sum(n2 * t * 2.0**-41 / math.sqrt(d + p + 2) for t, d, p in ghost_layers)
    inst = n2 * math.sqrt(max(leaves, 1)) * 2.0**-53
    return 2.0 * (ghost + inst + rules) * (1.0 + 2.0**-20) + 2.0**-30


def bookkeeping_clipper(loss: Callable[..., jax.Array], graphdef, rest, *,
                        notices: Callable[[str], None] | None = None,
                        dtype: Any = None, ghost: bool | None = None,
                        canaries: CanaryRows | None = None) -> Clipper:
    """The book-keeping clipper of an NNX model (module docstring).

    Args:
      loss: `loss(model, extra, *example)`, one example's scalar loss (no batch axis), given
        the merged model and the non-model parameters `extra` (None if there are none).
      graphdef, rest: the model's graph and its non-trained state (`nnx.split`).
      notices: called once per compile with a line naming the layers with trained parameters
        that no rule knows (a user's own layer: `dp.taps.unknown_layers`; exact, through
        per-example gradients) and a line naming the other trained parameters larger than
        65,536 entries that no rule covers (their per-example gradients are instantiated).
      dtype: the forward's parameter dtype (bfloat16 for mixed precision); None keeps them.
        A, B and every gradient are cast to float32 before norms and sums.
      ghost: None chooses ghost norm or instantiation per layer by cost (`layer_plan`); True
        uses the ghost norm wherever a rule allows it, False never (tests and benchmarks).
      canaries: batch -> (coordinate, value) per row (`dp.canary_rows`): a row with a
        coordinate >= 0 is a Dirac canary, whose gradient is value e_coordinate in every
        layer's norm and sum: a ghost layer's A and B are replaced, an instantiated layer's
        (or offset's) gradients are replaced in its norm and its sum adds the canary rows'
        Diracs beside the other rows' (two float64 sums of n terms and their sum: within
        kappa's margin); a rule's own ghost norm is then not used (its data has no such form).

    Returns:
      A `dp.Clipper` whose `params` is the trained `nnx.State` or (that state, extra).
    """

    def clip(params, batch: tuple, clip_norm, mask) -> ClippedSum:
        state, extra = params if isinstance(params, tuple) else (params, None)
        trained = {_leaf_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]}
        probe = nnx.merge(graphdef, state, rest)
        names = tappable_layers(probe, trained)
        modules = {tuple(path): m for path, m in nnx.iter_modules(probe)}
        covered = {(*path, p) for path in names for p in rule_for(modules[path]).params}

        def one(offsets, perturbations, example):
            st_off, ex_off = offsets
            st = jax.tree.map(lambda v, o: v if o is None else v + o.astype(v.dtype), state,
                              st_off, is_leaf=lambda x: x is None)
            if dtype is not None:
                st = jax.tree.map(lambda v: v.astype(dtype), st)
            ex = None if extra is None else jax.tree.map(lambda v, o: v + o, extra, ex_off)
            model = tap_model(nnx.merge(graphdef, st, rest), names)
            with Taps(names, perturbations) as taps:
                value = loss(model, ex, *example)
            called[:] = list(taps.inputs)[:1]  # the forward's first (pytrees sort their keys)
            return value, (taps.inputs, taps.output_shapes)

        called: list[str] = []

        first = jax.tree.map(lambda b: b[0], batch)
        _, (_, shapes) = jax.eval_shape(lambda: one((jax.tree.map(
            lambda _: None, state), None if extra is None else jax.tree.map(
                jnp.zeros_like, extra)), None, first))
        notify_uncovered(notices, probe, {_leaf_path(kp): math.prod(v.shape) for kp, v in
                                          jax.tree_util.tree_flatten_with_path(state)[0]},
                         covered)
        st_off = jax.tree_util.tree_map_with_path(  # None: a tapped layer's parameter
            lambda kp, v: None if _leaf_path(kp) in covered
            else jnp.zeros((mask.shape[0], *v.shape), jnp.float32), state)
        ex_off = None if extra is None else jax.tree.map(
            lambda v: jnp.zeros((mask.shape[0], *v.shape), jnp.float32), extra)
        perturb = {k: jnp.zeros((mask.shape[0], *s.shape), s.dtype) for k, s in shapes.items()}

        def total(offsets, perturbations):
            values, (inputs, _) = jax.vmap(one)(offsets, perturbations, batch)
            return jnp.sum(values), inputs

        (off_grads, outs), inputs = jax.grad(total, argnums=(0, 1), has_aux=True)(
            (st_off, ex_off), perturb)
        canary = None if canaries is None else canaries(batch)
        return _clip_and_sum(state, extra, off_grads, outs, inputs, names, modules, clip_norm,
                             mask, ghost, called[0] if called else None, canary)

    return clip


def _clip_and_sum(state, extra, off_grads, outs, inputs, names, modules, clip_norm, mask,
                  ghost, first, canary=None):
    """Norms, factors and the clipped sum from the offsets' gradients and the taps' A and B;
    `first`: the name of the tapped layer the forward pass called first (None: no layer);
    `canary`: (coordinate, value) per row, the Dirac canaries (`dp.canary_rows`), or None."""
    n = mask.shape[0]
    extras = [("extra", i) for i in range(len(jax.tree.leaves(extra)))]
    start = dict(zip([_leaf_path(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(
        state)[0]] + extras, leaf_starts((state, extra)), strict=False))  # state, then extra

    def as_canaries(key, g):  # a leaf's per-example gradients with the canary rows' Diracs
        return g if canary is None else dirac_rows(g, start[key], *canary)

    parts, norms = {}, []  # tap name -> ("ghost", a, b), ("rule", data), ("inst", {param: g})
    # A rule's per-example gradients are formed once the backward pass is over (the b of the
    # layer called first is its last value) and one layer after another (the previous ones'
    # g): formed as soon as their own b existed, the CNN's second layer's (8 MiB) were live
    # beside the backward's buffers of the first (XLA's temporary memory per batch 23.9 ->
    # 16.4 MiB; WRN-16-4 225.0 -> 213.7 MiB).
    previous = None
    for path, name in names.items():
        module = modules[path]
        rule = rule_for(module)
        x, b = promote_float32(inputs[name], outs[name])
        if rule.takes_input:  # A (patches) formed late, not all at once
            x = after(x, outs[first])  # after this layer's b too: the backward's last
            x = x if previous is None else after(x, previous)
        a = x if not rule.takes_input else jax.vmap(  # (an unused A: XLA drops it)
            lambda xi, m=module, r=rule: r.inputs(m, xi))(x)
        a, b = a.reshape(n, -1, a.shape[-1]), b.reshape(n, -1, b.shape[-1])
        if rule.row_grads is not None or rule.input_grads is not None:
            grads = (rule.row_grads(module, a, b) if rule.input_grads is None
                     else rule.input_grads(module, x, b))
            parts[name] = ("inst", grads)
            norms += [scaled_norm(as_canaries((*path, p), v)) for p, v in grads.items()]
            continue
        if canary is None and rule.ghost is not None and (
                rule.ghost.prefer(n, a.shape[1], a.shape[2], b.shape[2]) if ghost is None
                else ghost):
            norm, data = rule.ghost.norm(module, a, b)
            parts[name] = ("rule", data)
            norms.append(norm)
            continue
        plan = layer_plan(n, a.shape[1], a.shape[2], b.shape[2]) if ghost is None else (
            "ghost" if ghost else "instantiate")
        if rule.grads is None and plan == "ghost":
            if canary is not None:
                a, b = dirac_ghost(a, b, start[(*path, rule.params[0])], *canary)
            parts[name] = ("ghost", a, b)
            norms.append(ghost_norm(a, b))
            continue
        g = None if rule.example_grads is None else rule.example_grads(module, x, b)
        if g is None:
            g = jnp.einsum("ntd,ntp->ndp", a, b, precision=HIGHEST)
        else:
            previous = g
        if rule.grads is None:
            grads = {rule.params[0]: g.reshape(n, *getattr(module, rule.params[0]).shape)}
        else:
            grads = jax.vmap(lambda gi, m=module, r=rule: r.grads(m, gi))(g)
        parts[name] = ("inst", grads)
        norms += [scaled_norm(as_canaries((*path, p), v)) for p, v in grads.items()]
    st_off, ex_off = off_grads  # the parameters no rule covers, then extra's
    offsets = [(_leaf_path(kp), o) for kp, o in jax.tree_util.tree_flatten_with_path(
        st_off, is_leaf=lambda x: x is None)[0] if o is not None]
    offsets += list(zip(extras, jax.tree.leaves(ex_off), strict=True))
    small = [as_canaries(key, o).reshape(n, -1) for key, o in offsets]
    leaves = len(norms) + len(small)  # kappa counts every leaf, as if normed one by one
    if small:  # one norm of them all (exact concatenation): a few large reductions, not ~100
        norms.append(scaled_norm(jnp.concatenate(small, axis=1)))
    acc = jax.dtypes.canonicalize_dtype(FLOAT64_SUMS)  # float64 inside an `x64_jit` program
    if acc == jnp.float64:  # room for the float64 reduction's rounding (module docstring)
        ghosts = [(a.shape[1], a.shape[2], b.shape[2])
                  for kind, *data in parts.values() if kind == "ghost" for a, b in [data]]
        rules = sum(rule_for(modules[path]).ghost.slack(n, parts[name][1])
                    for path, name in names.items() if parts[name][0] == "rule")
        # (1 + kappa) (1 + 2^-22): still >= 1 + kappa once rounded to float32.
        clip_norm = clip_norm / ((1.0 + reduction_slack(n, ghosts, leaves, rules))
                                 * (1.0 + 2.0**-22))
    stacked = jnp.stack(norms, axis=1)
    peak = jnp.max(stacked, axis=1)
    scaled, exponent = unit_scale(stacked, peak)
    total = unscale(jnp.sqrt(jnp.sum(jnp.square(scaled), axis=1)
                              * (1.0 + gamma(len(norms) + 8))) * (1.0 + gamma(2)),
                     exponent, peak)
    factor = jnp.minimum(1.0, clip_norm / total)
    factor = jnp.where(jnp.isfinite(total) & (mask > 0), factor, 0.0)
    keep = factor > 0
    factor, keep = _materialized(factor, keep)

    def weighted(g, key):  # a leaf's clipped sum
        if canary is None:
            return weighted_sum(g, factor, keep, acc)
        # Its canary rows' Diracs (`dp.canary_rows`), with the same factors, beside the other
        # rows' gradients: in a selected copy of g, XLA:CPU fused g's whole computation into the
        # sum's row loop (the CNN's conv2 at a physical batch of 64: 7 -> 42 ms).
        piece = dirac_piece(g.shape[1:], start[key], *canary, g.dtype)
        return (weighted_sum(g, factor, keep & (canary[0] < 0), acc)
                + weighted_sum(piece, factor, keep, acc))

    sums = {}
    for path, name in names.items():
        kind, *data = parts[name]
        if kind == "ghost":
            g = ghost_sum(*data, factor, keep, acc)
            param = rule_for(modules[path]).params[0]
            sums[(*path, param)] = g.reshape(getattr(modules[path], param).shape)
        elif kind == "rule":
            for param, g in rule_for(modules[path]).ghost.sums(
                    modules[path], data[0], factor, keep, acc).items():
                sums[(*path, param)] = g
        else:
            for param, g in data[0].items():
                sums[(*path, param)] = weighted(g, (*path, param))
    grads = jax.tree_util.tree_map_with_path(
        lambda kp, v, o: sums[_leaf_path(kp)] if o is None else weighted(o, _leaf_path(kp)),
        state, st_off, is_leaf=lambda x: x is None)
    if extra is not None:
        grads = (grads, jax.tree.unflatten(jax.tree.structure(ex_off), [
            weighted(o, key) for key, o in zip(extras, jax.tree.leaves(ex_off), strict=True)]))
    return ClippedSum(grads, total)


def weighted_sum(g: jax.Array, factor: jax.Array, keep: jax.Array, acc) -> jax.Array:
    """sum_i c_i g_i over the leading (example) axis in dtype acc, rows not kept exactly zero.
    Products and adds, not a dot (`dp.accumulate.weighted_rows_sum`): a float64 dot would
    first write a float64 copy of every example's gradient."""
    return weighted_rows_sum(g, factor, acc, keep)


def ghost_sum(a: jax.Array, b: jax.Array, factor: jax.Array, keep: jax.Array,
              acc) -> jax.Array:
    """sum_i c_i A_i^T B_i from a (n, T, d) and b (n, T, p), one einsum reduced in dtype acc,
    rows not kept exactly zero."""
    a = jnp.where(keep[:, None, None], a, 0.0)
    b = jnp.where(keep[:, None, None], b * factor[:, None, None], 0.0)
    return jnp.einsum("ntd,ntp->dp", a, b, precision=HIGHEST, preferred_element_type=acc)


def after(x: jax.Array, y: jax.Array) -> jax.Array:
    """x (n, ...) unchanged, but computed from y (n, ...) too: what is built from x is formed
    only once y exists. XLA:CPU's scheduler otherwise forms early what depends only on
    early values: all three of WRN-16-4's stage-1 patches (58 MB each) before the backward
    pass reached their layers (x a layer's input, y its output gradient b: the clipped sum's
    temporary memory 484 -> 249 MiB per batch of 32), or all nine shifted windows of one
    (y the previous window's gradients, `finetune.models.taps`: 249 -> 233 MiB).
    Each example's x plus 0 times its first entry of y: x itself, or NaN where that entry is
    not finite; y is then part of what makes the example's gradient (the first row of one of
    its layers' B, or part of one of its layers' gradients), so that gradient is not finite
    either and its factor is 0 as before; the other examples' values are untouched."""
    first = y.reshape(y.shape[0], -1)[:, 0]
    return x + (0.0 * first).astype(x.dtype).reshape((-1,) + (1,) * (x.ndim - 1))


def _materialized(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    """`arrays` (same leading length) unchanged, but computed once. XLA:CPU drops
    `jax.lax.optimization_barrier` and fuses the factors' whole computation (every layer's
    norm, combined) into each element of the large sums that use them: 3 x 142 ms per
    WRN-16-4 batch, most of its float64 reduction's cost. A sort is never fused, and a stable
    sort by an already sorted key returns its operands exactly."""
    index = jnp.arange(arrays[0].shape[0])
    return tuple(jax.lax.sort((index, *arrays), num_keys=1, is_stable=True)[1:])
