"""The forked reader that `dpprobe probe` starts while it imports JAX (`extract._fork_read`)."""

import subprocess
import sys

import numpy as np

from tests.store_helpers import fill, make_writer

# A fresh interpreter without JAX or torch (as `dpprobe probe` is when it forks its reader).
_PREFETCH = """
import sys, numpy as np, extract
store = sys.argv[1]
assert extract.can_prefetch_in_child()
attrs = extract.local_split_attrs(store, "train")
assert "zarr" not in sys.modules  # the parent read the attributes without Zarr
reader = extract.SplitPrefetch(store, {"train": attrs})
features, labels = reader.result("train")
assert "zarr" not in sys.modules
ref, ref_labels, _ = extract.load_split(store, "train", dtype=None)
assert features.dtype == ref.dtype and np.array_equal(features, ref), "features differ"
assert labels.dtype == np.int32 and np.array_equal(labels, ref_labels), "labels differ"
assert features.ctypes.data % 64 == 0
print("ok")
"""


def _prefetch_in_fresh_process(store):
    return subprocess.run([sys.executable, "-c", _PREFETCH, store], capture_output=True,
                          text=True, timeout=120)


def test_child_process_prefetch_equals_load_split(tmp_path, rng):
    store = str(tmp_path / "s.zarr")
    features = rng.normal(size=(300, 7)).astype(np.float32)
    fill(writer := make_writer(store, dtype="float16"), features, rng.integers(0, 4, size=300))
    writer.finalize()
    done = _prefetch_in_fresh_process(store)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_child_process_prefetch_reports_a_bad_chunk(tmp_path, rng):
    store = str(tmp_path / "s.zarr")
    fill(writer := make_writer(store), rng.normal(size=(300, 7)), rng.integers(0, 4, size=300))
    writer.finalize()
    (tmp_path / "s.zarr" / "train" / "features" / "c" / "2" / "0").write_bytes(b"garbage")
    done = _prefetch_in_fresh_process(store)
    assert done.returncode != 0
    assert "reading" in done.stderr and "failed" in done.stderr, done.stderr
