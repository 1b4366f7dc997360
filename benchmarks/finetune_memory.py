"""Peak temporary memory of one physical batch's clipped sum, DP against non-private, from
XLA's compiled memory analysis (exact for the program, unaffected by the machine's load).

  non-private     jax.grad of the summed loss of the batch
  book-keeping    `dp.bookkeeping_clipper` (the finetuning default)
  per-example     `dp.per_example_clipper` (jax_privacy.clipped_grad, vmapped gradients)

Models and physical batches as in benchmarks/finetune.py. Target (issue 25): book-keeping
<= 1.5x non-private.
Run: .venv/bin/python benchmarks/finetune_memory.py [--skip-per-example] [--cases 0,1]
(--skip-per-example: no vmapped column, whose compilation is most of the run on a GPU).
"""

from __future__ import annotations

import argparse

import _path  # noqa: F401 - first: keeps this folder off the import path
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import dpprobe.finetune.models  # noqa: F401 (loads the submodule)
from dpprobe import dp, finetune

CASES = [("cnn", 28, 1, 256), ("wrn16_4", 28, 1, 32), ("vit_tiny_patch16_224", 32, 3, 64),
         ("vit_tiny_patch16_224", 224, 3, 16)]


def _temp_mib(fn, *args) -> float:
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-per-example", action="store_true")
    parser.add_argument("--cases", default=None,
                        help="comma-separated indices into CASES (default: all)")
    args = parser.parse_args()
    cases = CASES if args.cases is None else [CASES[int(i)] for i in args.cases.split(",")]
    loss = optax.softmax_cross_entropy_with_integer_labels
    print(f"{'model':22} {'px':>3} {'p':>4} {'non-private MiB':>15} {'book-keeping':>13} "
          f"{'ratio':>6}" + ("" if args.skip_per_example else f" {'per-example':>12} {'ratio':>6}"))
    for name, side, channels, p in cases:
        model = finetune.models.create_model(name, 10, image_size=side, in_channels=channels,
                                             rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        x, y = jnp.zeros((p, side, side, channels)), jnp.zeros(p, jnp.int32)
        plain = jax.jit(lambda w, x, y, g=graphdef, r=rest: jax.grad(
            lambda w: loss(nnx.merge(g, w, r)(x), y).sum())(w))
        book = jax.jit(dp.bookkeeping_clipper(
            lambda m, extra, xi, yi: loss(m(xi[None]), yi[None]).sum(), graphdef, rest))
        each = jax.jit(dp.per_example_clipper(
            lambda w, xi, yi, g=graphdef, r=rest: loss(nnx.merge(g, w, r)(xi), yi).sum()))
        base = _temp_mib(plain, params, x, y)
        ours = _temp_mib(book, params, (x, y), 1.0, jnp.ones(p))
        line = f"{name:22} {side:3d} {p:4d} {base:15.1f} {ours:13.1f} {ours / base:6.2f}"
        if not args.skip_per_example:
            theirs = _temp_mib(each, params, (x, y), 1.0, jnp.ones(p))
            line += f" {theirs:12.1f} {theirs / base:6.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
