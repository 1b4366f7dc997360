"""`dpprobe predict` streams: peak memory and throughput on stores of 10^5 and 10^6 rows.

For each size, one process writes a store of N x d float16 random features (through
`extract.SplitWriter`) and a probe model file of random weights for it (a benchmark input, not
a trained model); another runs `run_predict` to a CSV and reports its peak RSS (per process).
Bounded memory means that peak does not grow with N (the features alone are N x d x 2 bytes).

    python benchmarks/predict.py [--rows 100000,1000000] [--dim 64]
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import _path  # noqa: F401  (first: this folder off the import path)


def make(rows: int, dim: int, folder: str) -> None:
    import numpy as np

    from dpprobe import extract, model_files
    from dpprobe import model as dpmodel

    store = os.path.join(folder, "s.zarr")
    attrs = {"backbone": {"name": "none", "weights_source": "precomputed embeddings"},
             "preprocessing": {"kind": "none (precomputed)"},
             "dataset": {"name": "random", "num_classes": 10,
                         "class_names": [str(c) for c in range(10)]}}
    writer = extract.SplitWriter(store, "test", num_rows=rows, feature_shape=(dim,),
                                 dtype="float16", provenance=attrs)
    rng = np.random.default_rng(0)
    for chunk in writer.pending_chunks():
        start, stop = writer.chunk_rows(chunk)
        writer.write_chunk(chunk, rng.normal(size=(stop - start, dim)).astype(np.float32),
                           rng.integers(0, 10, stop - start))
    writer.finalize()
    writer.close()
    split = dict(extract.open_split(store, "test").attrs)
    document = model_files.header("probe", split["class_names"]) | dpmodel.linear_document(
        dim=dim, num_classes=10, loss="softmax", normalization="none", groups=1,
        feature_dtype="float16") | {
        "backbone": model_files.store_record(store, split),
        "privacy": {"epsilon": 1.0, "delta": 1e-5, "accountant": "pld",
                    "neighboring_relation": "zero_out", "ledger": {}}}
    model = os.path.join(folder, "m.safetensors")
    model_files.write_model(model, dpmodel.linear_arrays(
        rng.normal(size=(dim, 10)).astype(np.float32), np.zeros(10, np.float32)), document)


def predict(rows: int, dim: int, folder: str) -> dict:
    from dpprobe.pipelines import run_predict

    store, model = os.path.join(folder, "s.zarr"), os.path.join(folder, "m.safetensors")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    result = run_predict(model, data=store, out=os.path.join(folder, "p.csv"), quiet=True)
    seconds = time.perf_counter() - start
    return {"rows": result["rows"], "dim": dim, "seconds": round(seconds, 1),
            "rows_per_second": round(result["rows"] / seconds),
            "features_mib": round(rows * dim * 2 / 2**20, 1),
            "peak_rss_mib_before_predict": round(before / 1024, 1),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="100000,1000000")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--step", nargs=3, help=argparse.SUPPRESS)  # make|predict ROWS DIR
    args = parser.parse_args()
    if args.step:
        step, rows, folder = args.step
        result = (make if step == "make" else predict)(int(rows), args.dim, folder)
        print(json.dumps(result))
        return
    for rows in (int(r) for r in args.rows.split(",")):
        with tempfile.TemporaryDirectory() as folder:
            for step in ("make", "predict"):
                out = subprocess.run([sys.executable, __file__, "--step", step, str(rows),
                                      folder, "--dim", str(args.dim)], capture_output=True,
                                     text=True, check=True)
        print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
