"""Real multi-process training: 2 and 3 processes on this machine (`jax.distributed` on
loopback, CPU collectives over Gloo), each holding its own rows (`tests/processes_worker.py`).

They train the one-process model given the same keys (the probe in memory and streamed, a
finetune step of a tiny CNN), every process ends with the same bits, and the noise is added once
(the models lie within float rounding of the one-process model and far from the model with
the noise added once per process). Through the CLI, only process 0 writes outputs, and a
process killed mid-run makes the others exit within a bound with one line naming them.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests import processes_worker as worker
from tests.conftest import with_test_xla_flags

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("memory_w", "memory_b", "stream_w", "stream_b", "finetune")
# Multi-process vs one process: the same sums added in another order, then 4 steps (the probe)
# or 2 (finetune). Measured: <= 3e-8 on parameters up to 0.78 (the noise once per process
# would move them by 0.06 to 0.39).
ATOL, RTOL = 1e-6, 1e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", DPPROBE_JAX_CACHE="0",
               JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = with_test_xla_flags()  # one CPU device per process
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # no persistent cache (the tests' conftest's)
    return env


def start(commands: list[list[str]], logs: Path) -> list[subprocess.Popen]:
    logs.mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen(command, cwd=ROOT, env=environment(),
                             stdout=open(logs / f"out{i}", "w"),  # noqa: SIM115
                             stderr=open(logs / f"err{i}", "w"))  # noqa: SIM115
            for i, command in enumerate(commands)]


def finish(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Each process's exit status; a process still running after `timeout` seconds is killed
    (and the test fails), as is every straggler of a failed test."""
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in procs]
    finally:
        kill_all(procs)


def kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


@pytest.fixture(scope="module")
def references():
    """The one-process models with the tests' keys: noise added once (sigma), and the noise
    that 2 or 3 processes would add if each added its own copy (count x sigma)."""
    return {count: worker.train_all(None, sigma=count * worker.SIGMA) for count in (1, 2, 3)}


@pytest.mark.slow
@pytest.mark.parametrize("count", [2, 3])
def test_processes_train_the_one_process_model_once(count, tmp_path, references):
    address = f"127.0.0.1:{free_port()}"
    procs = start([[sys.executable, "-m", "tests.processes_worker", address, str(count), str(i),
                    str(tmp_path)] for i in range(count)], tmp_path / "logs")
    codes = finish(procs, timeout=240)
    assert codes == [0] * count, [text(tmp_path / "logs" / f"err{i}")[-2000:]
                                  for i in range(count)]
    results = [np.load(tmp_path / f"process{i}.npz") for i in range(count)]
    # Each process held its own rows: contiguous, disjoint, all N of them.
    bounds = [tuple(r["rows"]) for r in results]
    assert bounds[0][0] == 0 and bounds[-1][1] == worker.N
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(bounds, bounds[1:], strict=False))
    # The secret keys are process 0's, broadcast: the same on every process.
    for r in results[1:]:
        np.testing.assert_array_equal(r["keys"], results[0]["keys"])
    for key in KEYS:
        for r in results[1:]:  # every process holds the same bits
            np.testing.assert_array_equal(r[key], results[0][key], err_msg=key)
        once, per_process = references[1][key], references[count][key]
        np.testing.assert_allclose(results[0][key], once, atol=ATOL, rtol=RTOL, err_msg=key)
        # The noise added once per process would be far outside that tolerance.
        assert np.abs(per_process - once).max() > 1000 * ATOL, key


def test_process_rows_split_every_row_once():
    from dpprobe.dp.distributed import process_rows

    for total, count in ((101, 2), (101, 3), (5, 4), (0, 2)):
        bounds = [process_rows(total, i, count) for i in range(count)]
        assert [b for _, b in bounds[:-1]] == [a for a, _ in bounds[1:]]
        assert bounds[0][0] == 0 and bounds[-1][1] == total
        sizes = [b - a for a, b in bounds]
        assert max(sizes) - min(sizes) <= 1


def test_local_batches_keep_exactly_the_sampled_rows_of_the_slice():
    """Re-packing a step's physical batches for rows [40, 70): every sampled row of the slice
    once, nothing else, at least one batch; on the whole range, the batches unchanged."""
    from dpprobe import dp
    from dpprobe.dp.distributed import local_batches

    step = next(dp.poisson_batches(100, [0.5], [1], 8, np.random.default_rng(1)))
    index, mask = step.index[:, 0], step.mask[:, 0]
    sampled = index[mask > 0]
    own = local_batches(index, mask, 40, 70, 8)
    rows = np.concatenate([i[m > 0] for i, m in own])
    np.testing.assert_array_equal(rows, sampled[(sampled >= 40) & (sampled < 70)])
    assert all(len(i) == 8 and ((i >= 40) & (i < 70)).all() for i, _ in own)
    whole = local_batches(index, mask, 0, 100, 8)
    np.testing.assert_array_equal(np.stack([i for i, _ in whole]), index)
    np.testing.assert_array_equal(np.stack([m for _, m in whole]), mask)
    (empty,) = local_batches(index, mask, 100, 100, 8)
    assert empty[1].sum() == 0


def test_a_row_range_of_a_store_reads_those_rows(tmp_path):
    from dpprobe import extract

    store = tiny_store(tmp_path / "s.zarr")
    features, labels, _ = extract.load_split(store, "train")
    for first, stop in ((0, 600), (10, 200), (64, 128), (599, 600), (300, 300)):
        chunks = list(extract.iter_split_chunks(store, "train", row_range=(first, stop)))
        got = np.concatenate([c[0] for c in chunks]) if chunks else np.zeros((0, 5))
        np.testing.assert_array_equal(got, features[first:stop])
        if chunks:
            np.testing.assert_array_equal(np.concatenate([c[1] for c in chunks]),
                                          labels[first:stop])


@pytest.mark.parametrize("options, flag", [
    (["--coordinator", "nohost"], "--coordinator"),
    (["--num-processes", "2", "--process-id", "2"], "--process-id"),
    (["--num-processes", "0"], "--num-processes"),
    (["--process-timeout", "0"], "--process-timeout")])
def test_bad_process_options_are_usage_errors(options, flag, capsys):
    from dpprobe.pipelines import cli

    assert cli.main(["probe", "STORE", *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dpprobe probe: error: argument {flag}") and err.count("\n") == 1


def tiny_store(path: Path, rows: int = 600) -> str:
    from dpprobe import extract

    rng = np.random.default_rng(0)
    for split, n in (("train", rows), ("test", 50)):
        writer = extract.SplitWriter(
            str(path), split, num_rows=n, feature_shape=(5,), dtype="float32",
            provenance={"backbone": {"name": "none"}, "dataset": {"name": "t", "num_classes": 3,
                                                                  "class_names": list("abc")}},
            rows_per_chunk=64)
        features = rng.normal(size=(n, 5)).astype(np.float32)
        labels = rng.integers(0, 3, size=n)
        for chunk in writer.pending_chunks():
            a, b = writer.chunk_rows(chunk)
            writer.write_chunk(chunk, features[a:b], labels[a:b])
        assert writer.finalize()
        writer.close()
    return str(path)


def probe_command(store: str, address: str, count: int, i: int, *options: str) -> list[str]:
    return [sys.executable, "-m", "dpprobe.pipelines.cli", "probe", store, "--coordinator", address,
            "--num-processes", str(count), "--process-id", str(i), "--epsilons", "1",
            "--seeds", "1", *options]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["--stream", "--in-memory"])
def test_cli_processes_write_once(mode, tmp_path):
    """`dpprobe probe --coordinator --num-processes --process-id` (601 rows: 300 and 301 per
    process): process 0 prints the table and writes the results and the model; the others
    write and print nothing."""
    store = tiny_store(tmp_path / "s.zarr", rows=601)
    address = f"127.0.0.1:{free_port()}"
    procs = start([probe_command(store, address, 2, i, mode, "--steps", "3", "--quiet",
                                 "--process-timeout", "10",
                                 "--out", str(tmp_path / f"r{i}.json"),
                                 "--save-model", str(tmp_path / f"m{i}"))
                   for i in range(2)], tmp_path / "logs")
    codes = finish(procs, timeout=240)
    assert codes == [0, 0], [text(tmp_path / "logs" / f"err{i}")[-2000:] for i in range(2)]
    assert (tmp_path / "r0.json").is_file() and any((tmp_path / "m0").iterdir())
    assert not (tmp_path / "r1.json").exists() and not (tmp_path / "m1").exists()
    assert (tmp_path / "r0.timings.json").is_file()  # the owner's, from the writer alone
    assert not (tmp_path / "r1.timings.json").exists()
    assert "epsilon" in text(tmp_path / "logs" / "out0")
    assert "epsilon" not in text(tmp_path / "logs" / "out1")
    driver = json.loads((tmp_path / "r0.json").read_text())["probe"]["driver"]
    assert driver.endswith("rows split over 2 processes"), driver


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_process_ends_the_job_with_one_line(victim, tmp_path):
    """SIGKILL one process mid-training (the coordinator, process 0, or another): every other
    exits non-zero within the bound, its last line naming it and the lost process."""
    store = tiny_store(tmp_path / "s.zarr")
    address = f"127.0.0.1:{free_port()}"
    logs = tmp_path / "logs"
    procs = start([probe_command(store, address, 2, i, "--stream", "--steps", "100000",
                                 "--process-timeout", "10") for i in range(2)], logs)
    try:
        deadline = time.monotonic() + 180
        # Process 0 shows the progress (the other is quiet); a step needs both processes.
        while "probe steps" not in text(logs / "err0"):
            assert all(p.poll() is None for p in procs), [text(logs / f"err{i}")[-2000:]
                                                          for i in range(2)]
            assert time.monotonic() < deadline, "the processes did not start training"
            time.sleep(0.2)
        time.sleep(1.0)
        procs[victim].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        survivor = procs[1 - victim]
        code = survivor.wait(timeout=40)
        elapsed = time.monotonic() - killed
    finally:
        kill_all(procs)
    err = text(logs / f"err{1 - victim}")
    lines = [line.strip() for line in err.replace("\r", "\n").splitlines() if line.strip()]
    assert code != 0 and elapsed < 40
    assert lines[-1].startswith(f"dpprobe probe: error: process {1 - victim} of 2: "), lines[-3:]
    assert "another process" in lines[-1] or "lost contact" in lines[-1], lines[-1]
    assert "Traceback" not in err


@pytest.mark.slow
def test_a_process_outside_collectives_learns_of_a_killed_coordinator(tmp_path):
    """Process 1 sleeps outside any collective when process 0 (which started the coordination
    service) is killed: its watchdog ends it within the timeout (5 s), with one line."""
    address = f"127.0.0.1:{free_port()}"
    logs = tmp_path / "logs"
    procs = start([[sys.executable, "-m", "tests.processes_worker", address, "2", str(i),
                    str(tmp_path), "--idle"] for i in range(2)], logs)
    try:
        deadline = time.monotonic() + 180
        while not all("ready" in text(logs / f"out{i}") for i in range(2)):
            assert all(p.poll() is None for p in procs), [text(logs / f"err{i}")[-2000:]
                                                          for i in range(2)]
            assert time.monotonic() < deadline, "the processes did not start"
            time.sleep(0.2)
        procs[0].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        code = procs[1].wait(timeout=40)
        elapsed = time.monotonic() - killed
    finally:
        kill_all(procs)
    lines = [line for line in text(logs / "err1").splitlines() if line.strip()]
    assert code == 1 and elapsed < 5 + 10, (code, elapsed)
    assert lines[-1] == ("dpprobe: error: process 1 of 2: process 0 has not answered for 5 s: "
                         "it stopped or hangs"), lines[-3:]
