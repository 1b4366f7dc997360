"""The compiled per-batch pieces of the finetuning trainer (`finetune.train`): one physical
batch's clipped sum (`clipped_sum`, DP) or plain gradient sum (`gradient_sum`, the NOT private
reference), and a step's physical batches summed in one compiled call (`stacked_sums`).

Why the stacked call: on a GPU the trainer's step waited on the host, not on the device (an
H100 computed a ViT-tiny physical batch of 64 at 32 px in 6 ms, and a step of four took 89 ms;
README, "The H100 again"): each physical batch cost two jitted calls, its clipped sum and a
float64 addition. `stacked_sums` loops over up to m physical batches stacked on a leading axis
inside one program (`lax.fori_loop` over the live ones, so a partly filled stack computes no
padding), adding each batch's sum to a float64 total as the trainer's loop did: the same parts
added in the same order.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dpprobe.dp.accumulate import add_float64, x64_jit
from dpprobe.dp.bookkeeping import bookkeeping_clipper
from dpprobe.dp.clipping import per_example_clipper, valid_labels, zero_nonfinite_rows
from dpprobe.finetune.augment import views_of
from dpprobe.finetune.evaluation import normalize_images
from dpprobe.finetune.graph_key import graph_of
from dpprobe.finetune.models._conv import im2col_convolutions
from dpprobe.finetune.specs import FinetuneFlags, FinetuneSpec

__all__ = ["clipped_sum", "gradient_sum", "model_inputs", "stacked_sums"]


def model_inputs(images, spec: FinetuneSpec) -> jax.Array:
    """The model's input from images (`finetune.normalize_images` with the spec's public
    mean and std)."""
    return normalize_images(images, spec.mean, spec.std)


def _example_loss_fn(graphdef, rest, spec: FinetuneSpec, flags: FinetuneFlags, aug_key,
                     canaries: tuple[int, float] | None):
    """The loss of one example (leading batch axis of 1, as `clipped_grad` calls it):
    `_model_loss_fn` on the model merged from `params` (cast to bfloat16 for mixed
    precision)."""
    model_loss = _model_loss_fn(spec, aug_key, canaries)

    def loss(params, image, label, row):
        if flags.mixed_precision:
            params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
        return model_loss(nnx.merge(graphdef, params, rest), None, image[0], label[0], row[0])

    return loss


def _model_loss_fn(spec: FinetuneSpec, aug_key, canaries: tuple[int, float] | None):
    """The loss of one example (no batch axis) given the model (`dp.bookkeeping_clipper` calls
    it with the tapped model; no extra parameters): the mean over its K views of the
    cross-entropy. With gradient canaries (`canaries` = (N, norm)), row N + j is canary j,
    whose loss is 0: the clipper gives its row the Dirac gradient norm e_c instead
    (`_canary_rows`)."""

    def loss(model, extra, image, label, row):
        del extra
        views = model_inputs(views_of(image, jax.random.fold_in(aug_key, row), views=spec.augmult,
                                      padding=spec.crop_padding, flip=spec.flip), spec)
        logits = model(views.astype(jax.tree.leaves(nnx.state(model, nnx.Param))[0].dtype))
        value = optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), jnp.broadcast_to(label, logits.shape[:1])).mean()
        if canaries is None:
            return value
        return jnp.where(row >= canaries[0], 0.0, value)

    return loss


def _canary_rows(canaries: tuple[int, float] | None, coordinates):
    """The clippers' canary rows (`dp.canary_rows`): row N + j has the gradient norm e_c,
    c = coordinates[j] over the trained leaves; None without canaries."""
    if canaries is None:
        return None
    num_real, norm = canaries

    def rows_of(batch):
        canary = batch[2] - num_real  # batch = (images, labels, global rows)
        inside = jnp.clip(canary, 0, coordinates.shape[0] - 1)
        return (jnp.where(canary >= 0, coordinates[inside], -1).astype(jnp.int32),
                jnp.full(canary.shape, norm, jnp.float32))

    return rows_of


def _notice(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _clipped_sum(graphdef, params, rest, images, labels, mask, rows, clip, aug_key,
                 coordinates=None, *, spec: FinetuneSpec, flags: FinetuneFlags,
                 canaries: tuple[int, float] | None = None, structure: tuple | None = None):
    """The sum over one physical batch of each example's view-averaged gradient clipped to
    `clip`; masked rows and null records contribute exactly zero. Traced with x64 on so that
    the reduction over the batch's examples is float64 (`dp.bookkeeping`'s guarantee: one
    example moves the computed sum by at most C (1 + 3.1e-7)); the model runs in float32.

    Args:
      images: (p, H, W, C) (views drawn on the device) or (p, K, H, W, C) (given views),
        uint8 or float.
      labels, mask, rows: (p,) labels, 0/1 mask, and global row indices (they pick each
        example's augmentation key, so a view never depends on the batch).
      coordinates: (m,) int32, canary j's coordinate over the trained leaves (`canaries`).
      canaries: (N, norm) when rows N.. are gradient canaries (`_canary_rows`).
      structure: None, or the treedefs of (params, rest) when both come as lists of arrays
        (the trainer: no `nnx.Variable` is built or flattened per call); the sums then come
        back as a list too. `graphdef` may be its `graph_key` (hashed once).
    """
    graphdef, params, rest = _unpack(graphdef, params, rest, structure)
    if jnp.issubdtype(images.dtype, jnp.floating):  # uint8 images are always finite
        images, mask = zero_nonfinite_rows(images.astype(jnp.float32), mask)
    valid = valid_labels(labels, spec.num_classes)
    if flags.clipping == "bookkeeping":
        clipper = bookkeeping_clipper(
            _model_loss_fn(spec, aug_key, canaries), graphdef, rest, notices=_notice,
            dtype=jnp.bfloat16 if flags.mixed_precision else None,
            canaries=_canary_rows(canaries, coordinates))
        return _pack(structure, clipper(params, (images, jnp.where(valid, labels, 0), rows),
                                        clip, mask * valid).grads)
    clipper = per_example_clipper(
        _example_loss_fn(graphdef, rest, spec, flags, aug_key, canaries),
        microbatch_size=flags.microbatch_size, canaries=_canary_rows(canaries, coordinates))
    with im2col_convolutions():  # vmapped kernel gradients as batched matmuls (models._conv)
        return _pack(structure, clipper(params, (images, jnp.where(valid, labels, 0), rows),
                                        clip, mask * valid).grads)


def _gradient_sum(graphdef, params, rest, images, labels, mask, rows, clip, aug_key,
                  coordinates=None, *, spec: FinetuneSpec, flags: FinetuneFlags,
                  canaries: tuple[int, float] | None = None, structure: tuple | None = None):
    """NOT private: `clipped_sum` without the clipping (`clip` is ignored), for the
    non-private reference: one backward pass of the sum over the batch's unmasked rows of each
    example's (view-averaged) loss. Masked rows, bad labels and non-finite images count zero.
    No canaries (they audit a privacy claim)."""
    del clip, coordinates
    graphdef, params, rest = _unpack(graphdef, params, rest, structure)
    if jnp.issubdtype(images.dtype, jnp.floating):
        images, mask = zero_nonfinite_rows(images.astype(jnp.float32), mask)
    valid = valid_labels(labels, spec.num_classes)
    loss = _example_loss_fn(graphdef, rest, spec, flags, aug_key, canaries)

    def total(params):
        losses = jax.vmap(lambda image, label, row: loss(params, image[None], label[None],
                                                         row[None]))(
            images, jnp.where(valid, labels, 0), rows)
        return jnp.sum(jnp.where(mask * valid > 0, losses, 0.0))

    return _pack(structure, jax.grad(total)(params))


_STATIC = ("graphdef", "spec", "flags", "canaries", "structure")
clipped_sum = x64_jit(_clipped_sum, static_argnames=_STATIC)
gradient_sum = jax.jit(_gradient_sum, static_argnames=_STATIC)


def _unpack(graphdef, params, rest, structure):
    """The graph and the (params, rest) pytrees of a call (`clipped_sum`'s `structure`)."""
    if structure is not None:
        params, rest = (jax.tree.unflatten(s, v) for s, v in zip(structure, (params, rest),
                                                                   strict=True))
    return graph_of(graphdef), params, rest


def _pack(structure, sums):
    if structure is not None and jax.tree.structure(sums) != structure[0]:  # at trace time
        raise ValueError("the clipped sums are not shaped like the trained parameters")
    return sums if structure is None else jax.tree.leaves(sums)


@functools.partial(x64_jit, static_argnames=_STATIC + ("private",))
def stacked_sums(graphdef, params, rest, total, images, labels, mask, rows, count, clip,
                 aug_base, step, coordinates=None, *, spec: FinetuneSpec,
                 flags: FinetuneFlags, canaries: tuple[int, float] | None = None,
                 structure: tuple, private: bool):
    """`total` plus the sums of the first `count` physical batches stacked on the leading
    axis, each added in float64 in turn: `clipped_sum` (`private`) or `gradient_sum` of each
    (m, p, ...) slice, with step `step`'s augmentation key `fold_in(aug_base, step)`.

    Args:
      total: the float64 leaves of the sums so far (zeros at a step's first call; 0 + x is x
        exactly, so the sums are those of the per-batch calls added in order).
      images, labels, mask, rows: (m, p, ...) physical batches; those past `count` (clipped
        to [0, m]) are never read (a traced trip count: one compiled program for every
        sampled batch size).
      coordinates, canaries: the gradient canaries' coordinates and (N, norm) (`clipped_sum`).
      structure: the treedefs of (params, rest), which come as lists of arrays.
    Returns the new total's leaves (float64)."""
    one = _clipped_sum if private else _gradient_sum
    aug_key = jax.random.fold_in(aug_base, step)

    def add(acc, index):
        part = one(graphdef, params, rest, images[index], labels[index], mask[index],
                   rows[index], clip, aug_key, coordinates, spec=spec, flags=flags,
                   canaries=canaries, structure=structure)
        return add_float64(acc, part)

    total = [t.astype(jnp.float64) for t in total]
    count = jnp.clip(count, 0, images.shape[0])  # a slot is never read twice, whatever count
    if images.shape[0] == 1:  # no loop: XLA:CPU runs a loop's body up to 7x slower
        return [jnp.where(count > 0, new, old) for new, old in zip(add(total, 0), total,
                                                                    strict=True)]
    return jax.lax.fori_loop(0, count, lambda index, acc: add(acc, index), total)
