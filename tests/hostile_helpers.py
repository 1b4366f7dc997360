"""Shared by the hostile-input tests of finetune and of the model commands: hostile images,
the CLI in a process of its own (with a file-size limit, test keys, a SIGKILL at a chosen
step), and the checks every case ends with."""

from __future__ import annotations

import io
import os
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]


def png_bomb(width: int, height: int) -> bytes:
    """A valid PNG header claiming width x height pixels, and almost no data."""
    def chunk(kind, data):
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0,
                                                            0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 100)) + chunk(b"IEND", b""))


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def odd_images(rng) -> dict[str, bytes]:
    """Images of every mode and size a folder may hold, each readable."""
    rgb = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
    return {
        "rgba.png": encoded(Image.fromarray(rng.integers(0, 256, (16, 16, 4), np.uint8), "RGBA")),
        "palette.png": encoded(Image.fromarray(rgb).convert("P")),
        "sixteen_bit.png": encoded(Image.fromarray(rng.integers(0, 65535, (16, 16), np.uint16))),
        "cmyk.jpg": encoded(Image.fromarray(rgb).convert("CMYK"), "JPEG"),
        "gray.png": encoded(Image.fromarray(rgb[..., 0])),
        "wide.png": encoded(Image.fromarray(rng.integers(0, 256, (23, 40, 3), np.uint8))),
    }


def bad_images(good: bytes) -> dict[str, bytes]:
    """Images no reader can decode: corrupt, truncated, decompression bombs (Pillow's error at
    4e8 pixels, its warning at 1e8)."""
    return {"corrupt.png": os.urandom(200), "truncated.png": good[:-60],
            "bomb.png": png_bomb(20000, 20000), "bomb_warning.png": png_bomb(10000, 10000)}


def kept_or_new(before: dict, after: dict, out: str) -> None:
    """Every file of the user's unchanged; whatever is new lies in the job's `out`, or is the
    owner's timing file beside it (`dpprobe.timings`)."""
    from dpprobe.timings import timings_path

    changed = [k for k in before if after.get(k) != before[k]]
    assert not changed, changed
    owner = str(timings_path(out))
    assert all(k.startswith(out) or k == owner for k in set(after) - set(before)), sorted(
        set(after) - set(before))


# The CLI in a process of its own. DPPROBE_TEST_FILE_SIZE: every file it writes is capped
# (`ulimit -f`), SIGXFSZ ignored so that a write fails with EFBIG instead of killing it (set
# here, not in a preexec_fn: forking a process that runs JAX's threads may deadlock).
# DPPROBE_TEST_KEYS: fixed noise keys and sampler (the product draws both from OS entropy), and
# a SIGKILL of itself after the update of step DPPROBE_TEST_KILL_AT, before it is checkpointed.
CHILD = """
import os, resource, signal, sys
size = int(os.environ["DPPROBE_TEST_FILE_SIZE"])
if size:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
if os.environ["DPPROBE_TEST_KEYS"]:
    import jax, numpy as np
    from dpprobe import finetune
    import dpprobe.finetune.checkpoint
    train = finetune.train_finetune
    def fixed(*args, **kwargs):
        kwargs["keys"] = jax.random.split(jax.random.key(7), 2)
        kwargs["rng"] = np.random.default_rng(7)
        return train(*args, **kwargs)
    finetune.train_finetune = fixed
    kill_at = int(os.environ["DPPROBE_TEST_KILL_AT"])
    due = finetune.checkpoint.Checkpointer.due
    def due_or_die(self, step):
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return due(self, step)
    finetune.checkpoint.Checkpointer.due = due_or_die
from dpprobe.pipelines import cli
sys.exit(cli.main(sys.argv[1:]))
"""


def child(argv, cwd, *, file_size: int = 0, test_keys: bool = False, kill_at: int = 0):
    """Run the CLI (CHILD) in a process: with every file capped at `file_size` bytes, with
    test keys, killed at step `kill_at`."""
    env = os.environ | {"PYTHONPATH": str(REPO), "DPPROBE_TEST_FILE_SIZE": str(file_size),
                        "DPPROBE_TEST_KEYS": "1" if test_keys else "",
                        "DPPROBE_TEST_KILL_AT": str(kill_at)}
    return subprocess.Popen([sys.executable, "-c", CHILD, *argv], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(process, timeout=240) -> tuple[int, str]:
    """(exit status, stderr) of a `child`; one that runs past `timeout` is killed: a hang."""
    try:
        _, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate()
        raise AssertionError(f"hung for {timeout} s: {err[-2000:]}") from None
    return process.returncode, err


def one_line(err: str, match: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1, err[-3000:]
    assert re.search(match, lines[0]), lines[0]




def run_case(case, world: Path, capsys) -> tuple[int, str, dict, dict]:
    """A CLI case in `world`: its setup, then `dpprobe` in process; (exit code, stderr, the
    folder's files before, after)."""
    from dpprobe.pipelines import cli
    from tests.hostile_world import snapshot

    if case.setup is not None:
        case.setup(world)
    capsys.readouterr()
    before = snapshot(world)
    code = cli.main(case.argv)
    return code, capsys.readouterr().err, before, snapshot(world)


def assert_refused_untouched(err: str, code: int, expect, before: dict, after: dict) -> None:
    """One line naming the culprit (`expect.match`, exit `expect.code`), no file changed."""
    from tests.hostile_world import assert_one_line_error

    assert_one_line_error(err, code, expect)
    assert after == before, sorted(k for k in set(before) | set(after)
                                   if before.get(k) != after.get(k))
