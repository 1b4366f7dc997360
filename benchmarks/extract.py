"""Extraction throughput: the whole pipeline vs the bare backbone forward on the same batches.

  pipeline   `extract_split`: DataLoader workers decode + preprocess, the backbone runs
             (autocast on GPU), a writer thread compresses and writes Zarr chunks
  bare       the backbone's forward pass alone over the same preprocessed batches, already in
             memory (the upper bound)

Reports images/s of each, their ratio (target >= 0.9), and the store's bytes per row.
Run: .venv/bin/python benchmarks/extract.py [--backbone vit_tiny_patch16_224] [--n 384]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import _path  # noqa: F401 - first: keeps this folder off the import path
import numpy as np
import torch


def bytes_on_disk(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def bare_forward(backbone, batches) -> None:
    """The backbone alone (autocast bf16 on GPU, as the pipeline), outputs back on the host."""
    device = backbone.device
    with torch.inference_mode(), torch.autocast(device.type, dtype=torch.bfloat16,
                                                 enabled=device.type == "cuda"):
        for batch in batches:
            backbone.module(batch.to(device, non_blocking=True)).float().cpu()


def main():
    from dpprobe import extract
    from dpprobe.pipelines.demo_job import demo_data

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backbones", default="vit_tiny_patch16_224,scatternet")
    parser.add_argument("--n", type=int, default=384, help="images per measurement (timm)")
    parser.add_argument("--n-scatternet", type=int, default=4096,
                        help="images per measurement for the (much faster) ScatterNet")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default=None)
    parser.add_argument("--workers", type=int, default=None,
                        help="DataLoader workers (default: dpprobe's default for the device)")
    args = parser.parse_args()

    data = demo_data()
    source = extract.open_source(data)["train"]
    rows = []
    for name in args.backbones.split(","):
        n = args.n_scatternet if name == "scatternet" else args.n
        subset = extract.ImageSplit(source.dataset, "train", source.labels[:n],
                                    source.class_names, f"{source.fingerprint}[:{n}]",
                                    array=source.array[:n])
        kwargs = {} if name == "scatternet" else {"random_init": True}
        backbone = extract.create_backbone(name, device=args.device, **kwargs)
        device = backbone.device
        # Bare forward: the same batches, preprocessed beforehand, in memory.
        batches = [torch.stack([backbone.transform(img) for img in
                                subset.images(range(i, min(i + args.batch_size, n)))])
                   for i in range(0, n, args.batch_size)]
        bare_forward(backbone, batches)  # warm up
        bare_times, pipe_times, sizes = [], [], {}
        for _ in range(args.repeats):
            start = time.perf_counter()
            bare_forward(backbone, batches)
            if device.type == "cuda":
                torch.cuda.synchronize()
            bare_times.append(time.perf_counter() - start)
            for dtype in ("float16", "float32"):
                workdir = Path(tempfile.mkdtemp(prefix="dpprobe-extract-bench-"))
                try:
                    start = time.perf_counter()
                    extract.extract_split(subset, backbone, str(workdir / "s.zarr"),
                                          batch_size=args.batch_size, dtype=dtype,
                                          num_workers=args.workers, progress=False)
                    elapsed = time.perf_counter() - start
                    if dtype == "float16":
                        pipe_times.append(elapsed)
                    sizes[dtype] = bytes_on_disk(workdir / "s.zarr" / "train") / n
                finally:
                    shutil.rmtree(workdir)
        bare_rate = n / statistics.median(bare_times)
        pipe_rate = n / statistics.median(pipe_times)
        dim = extract.embed_images(backbone, subset, [0]).shape[1]
        rows.append((name, n, device.type, dim, bare_rate, pipe_rate, sizes))

    print(f"\n{data}, batch {args.batch_size}, medians of {args.repeats}; "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'backbone':24s} {'images':>6s} {'device':6s} {'d':>5s} {'bare img/s':>11s} "
          f"{'pipeline img/s':>15s} {'ratio':>6s} {'bytes/row f16':>14s} {'bytes/row f32':>14s}"
          f" {'raw f16':>8s}")
    for name, n, device, dim, bare_rate, pipe_rate, sizes in rows:
        print(f"{name:24s} {n:6d} {device:6s} {dim:5d} {bare_rate:11.1f} {pipe_rate:15.1f} "
              f"{pipe_rate / bare_rate:6.3f} {sizes['float16']:14.0f} {sizes['float32']:14.0f}"
              f" {2 * dim:8d}")
    print("pipeline includes decoding, preprocessing, the forward pass, "
          "float16 conversion, checksums, Zarr compression and writes (writer thread); "
          "bytes/row includes labels and per-chunk metadata.")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
