"""Where the book-keeping DP step of WRN-16-4 (28 px, physical batch 32) spends its time and
memory against the non-private step, in one process, timed in turn (ABAB...), medians of wall
and process CPU time (the CPU time is less sensitive to a shared machine's load), with XLA's
compiled flops, bytes accessed and temp memory of each program:

  plain           jax.grad of the summed loss (the non-private reference)
  book (inst)     `dp.bookkeeping_clipper` with every WSConv instantiated (no `Rule.ghost`)
  book            `dp.bookkeeping_clipper` as shipped (WS ghost norm where it is cheaper)
  pass only       the tapped forward and backward alone (A, B and the offsets' gradients,
                  summed instead of clipped): what the clipping itself adds is book - this

Run: .venv/bin/python benchmarks/bookkeeping_profile.py [--repeats 9]
"""

from __future__ import annotations

import argparse
import statistics
import time

import _path  # noqa: F401 - first: keeps this folder off the import path
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import dpprobe.dp.bookkeeping as bookkeeping
import dpprobe.dp.taps  # noqa: F401 (loads the submodule)
import dpprobe.finetune.models  # noqa: F401 (loads the submodule)
from dpprobe import dp, finetune
from dpprobe.finetune.models.wrn import WSConv

P, SIDE = 32, 28


def _loss(model, extra, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x[None]), y[None]).sum()


def _summed(state, extra, off_grads, outs, inputs, *rest):
    """In place of `_clip_and_sum`: every A, B and offset gradient summed (nothing dropped)."""
    total = sum(jnp.sum(v) for v in jax.tree.leaves((off_grads, outs, inputs)))
    return dp.ClippedSum(jax.tree.map(lambda v: v * 0 + total, state), jnp.zeros(P))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    model = finetune.models.create_model("wrn16_4", 10, image_size=SIDE, in_channels=1,
                                         rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    x, y = jax.random.normal(jax.random.key(0), (P, SIDE, SIDE, 1)), jnp.arange(P) % 10
    batch = (params, (x, y), 1.0, jnp.ones(P))
    plain = jax.jit(lambda w, x, y: jax.grad(lambda w: jnp.sum(jax.vmap(
        lambda xi, yi: _loss(nnx.merge(graphdef, w, rest), None, xi, yi))(x, y)))(w))
    programs = {"plain": (plain.lower(params, x, y).compile(), (params, x, y))}

    def book():
        return jax.jit(dp.bookkeeping_clipper(_loss, graphdef, rest)).lower(*batch).compile()

    rule = dp.taps.rule_for(WSConv.__new__(WSConv))
    dp.taps.register_rule(WSConv, rule._replace(ghost=None))
    programs["book (inst)"] = (book(), batch)
    dp.taps.register_rule(WSConv, rule)
    programs["book"] = (book(), batch)
    clip_and_sum, bookkeeping._clip_and_sum = bookkeeping._clip_and_sum, _summed
    programs["pass only"] = (book(), batch)
    bookkeeping._clip_and_sum = clip_and_sum
    wall, cpu = {k: [] for k in programs}, {k: [] for k in programs}
    for compiled, inputs in programs.values():
        jax.block_until_ready(compiled(*inputs))
    for _ in range(args.repeats):
        for key, (compiled, inputs) in programs.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(compiled(*inputs))
            wall[key].append(time.perf_counter() - start)
            cpu[key].append(time.process_time() - start_cpu)
    base = statistics.median(wall["plain"]), statistics.median(cpu["plain"])
    print(f"{'program':12} {'GFLOP':>7} {'GB read+written':>15} {'temp MiB':>9} {'wall ms':>8} "
          f"{'plain/this':>10} {'CPU ms':>7} {'plain/this':>10}")
    for key, (compiled, _) in programs.items():
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
        w, c = statistics.median(wall[key]), statistics.median(cpu[key])
        print(f"{key:12} {cost.get('flops', 0) / 1e9:7.2f} "
              f"{cost.get('bytes accessed', 0) / 1e9:15.2f} {temp:9.1f} {w * 1e3:8.0f} "
              f"{base[0] / w:10.2f} {c * 1e3:7.0f} {base[1] / c:10.2f}", flush=True)


if __name__ == "__main__":
    main()
