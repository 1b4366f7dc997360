"""One process of the multi-process tests (`tests/pipelines/test_processes.py`): joins a job of N
processes on loopback, trains the probe (in memory and streamed) and a finetune step on its own
rows with the tests' keys, and saves what it trained to OUT/process{i}.npz.

    python -m tests.processes_worker HOST:PORT N I OUT [--idle]

With --idle it does one collective, then sleeps (the watchdog's test).

The data, keys and plans are the ones `reference()` trains in one process, so that the test can
compare the two.
"""

from __future__ import annotations

import sys
import time

import numpy as np

N, DIM, CLASSES, SIDE = 101, 6, 3, 8  # 101 rows: not a multiple of 2 or of 3
CHUNK = 16  # streamed rows per chunk
SIGMA = 4.0  # large: noise added twice instead of once is far outside the tolerance


def problem():
    """(features, labels, images) of the tests: the same on every process."""
    rng = np.random.default_rng(0)
    features = rng.normal(size=(N, DIM)).astype(np.float32) * 2.0
    labels = rng.integers(0, CLASSES, size=N).astype(np.int32)
    images = rng.integers(0, 256, size=(N, SIDE, SIDE, 1)).astype(np.uint8)
    return features, labels, images


def probe_runs(sigma: float = SIGMA):
    from dpprobe import accounting, probe

    return ([probe.RunSpec(accounting.DpPlan(sigma, 4, 1.0, 1.0), 0.5),
             probe.RunSpec(accounting.DpPlan(0.0, 4, 1.0, 1.0), 0.5)],
            probe.ProbeSpec(num_classes=CLASSES, optimizer="momentum"))


def test_keys(count: int, seed: int):
    """The tests' keys (the product draws them from OS entropy: `dp.make_keys`)."""
    import jax

    return jax.random.split(jax.random.key(seed), count)


def finetune_setup(sigma: float = SIGMA):
    """A tiny CNN (one 3x3 convolution, a dense head), its plan, recipe and flags."""
    import jax.numpy as jnp
    from flax import nnx

    from dpprobe import accounting, finetune

    class TinyCNN(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
            self.head = nnx.Linear(4 * SIDE * SIDE, CLASSES, rngs=rngs)

        def __call__(self, x):
            return self.head(jnp.tanh(self.conv(x)).reshape(x.shape[0], -1))

    spec = finetune.FinetuneSpec(CLASSES, optimizer="sgd", learning_rate=0.5, ema_decay=None)
    return (TinyCNN(nnx.Rngs(0)), accounting.DpPlan(sigma, 2, 0.5, 1.0), spec,
            finetune.FinetuneFlags(physical_batch_size=16))


def flat(model) -> np.ndarray:
    import jax
    from flax import nnx

    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))])


def train_all(rows: tuple[int, int] | None, mesh=None, sigma: float = SIGMA) -> dict:
    """The probe in memory, streamed, and the finetune steps, on rows [start, stop) (None: all
    rows, one process), with the tests' keys and sampler."""
    from dpprobe import finetune, probe

    features, labels, images = problem()
    start, stop = rows or (0, N)
    runs, spec = probe_runs(sigma)
    keys = test_keys(len(runs), 1)
    x, y = features[start:stop], labels[start:stop]
    if mesh is not None:  # the same number of rows on every process: null rows (label -1)
        pad = -(-N // mesh.devices.size) - len(y)  # one device per process here
        x = np.concatenate([x, np.zeros((pad, DIM), np.float32)])
        y = np.concatenate([y, np.full(pad, -1, np.int32)])
    memory = probe.train_probe(x, y, runs, keys, spec, num_examples=N,
                               flags=probe.PerformanceFlags(mesh=mesh))

    def chunks():
        for first in range(start, stop, CHUNK):
            yield features[first:min(first + CHUNK, stop)], labels[first:min(first + CHUNK, stop)]

    streamed = probe.train_probe_streaming(
        chunks, runs, keys, spec, num_examples=N, dim=DIM,
        flags=probe.PerformanceFlags(rows_per_chunk=CHUNK))
    model, plan, fspec, flags = finetune_setup(sigma)
    tuned = finetune.train_finetune(
        model, images[start:stop], labels[start:stop], plan, fspec, keys=test_keys(2, 2),
        flags=flags, rng=np.random.default_rng(3), rows=None if rows is None else (*rows, N))
    return {"memory_w": memory.params["w"], "memory_b": memory.params["b"],
            "stream_w": streamed.params["w"], "stream_b": streamed.params["b"],
            "finetune": flat(tuned.model)}


def main(coordinator: str, count: int, index: int, out: str, idle: bool = False) -> None:
    from types import SimpleNamespace

    from dpprobe.multihost import processes

    processes.start(SimpleNamespace(coordinator=coordinator, num_processes=count,
                                    process_id=index, process_timeout=5 if idle else 30))
    import jax

    if idle:  # one collective, then no other: only the watchdog can see a process stop
        from dpprobe.dp.distributed import sum_over_processes

        assert int(sum_over_processes(1)) == count
        print("ready", flush=True)
        time.sleep(120)
        return

    from dpprobe import dp, probe
    from dpprobe.dp.distributed import process_rows

    assert jax.process_count() == count and jax.process_index() == index
    trained = train_all(process_rows(N), mesh=probe.make_data_mesh())
    secret = np.asarray(jax.random.key_data(dp.make_keys(3)))  # OS entropy, process 0's
    np.savez(f"{out}/process{index}.npz", rows=np.array(process_rows(N)), keys=secret,
             **trained)
    print(f"process {index} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], "--idle" in sys.argv)
