"""ScatterNet extraction on the CPU, old vs new in one run: kymatio's module (before) and the
XLA program (`dpprobe.extract.scattering_xla`, now), through the product path
(`extract_split`: decode, preprocess, the scattering, float16, checksums, Zarr writes) and the
scattering alone on the same preprocessed batches.

Reports images/s and CPU seconds per image (user + system of this process: less sensitive to
other jobs on the cores than wall time), medians of --repeats, and the load average.
Run: .venv/bin/python benchmarks/scatternet.py [--n 2048] [--n-old 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import shutil
import statistics
import tempfile
import time

import _path  # noqa: F401 - first: keeps this folder off the import path
import numpy as np
import torch


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(work) -> tuple[float, float]:
    """(wall, CPU) seconds of work()."""
    wall, cpu = time.perf_counter(), cpu_seconds()
    work()
    return time.perf_counter() - wall, cpu_seconds() - cpu


def main():
    from dpprobe import extract
    from dpprobe.extract.backbones import Scattering
    from dpprobe.pipelines.demo_job import demo_data

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2048, help="images per measurement (new)")
    parser.add_argument("--n-old", type=int, default=1024, help="images per measurement "
                        "(kymatio's module, ~15x slower)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    data = demo_data()
    source = extract.open_source(data)["train"]
    new = extract.create_backbone("scatternet", device="cpu")
    shape = source.array.shape[1:3]
    old = dataclasses.replace(new, module=Scattering(shape, J=2, L=8))
    results = {}
    for name, backbone, n in (("kymatio (before)", old, args.n_old),
                              ("XLA (now)", new, args.n)):
        subset = extract.ImageSplit(source.dataset, "train", source.labels[:n],
                                    source.class_names, f"{source.fingerprint}[:{n}]",
                                    array=source.array[:n])
        batches = [torch.stack([backbone.transform(image) for image in
                                subset.images(range(i, min(i + args.batch_size, n)))])
                   for i in range(0, n, args.batch_size)]
        backbone.forward(batches[0])  # builds and compiles for this size

        def bare(backbone=backbone, batches=batches):
            for batch in batches:
                backbone.forward(batch)

        def pipeline(backbone=backbone, subset=subset):
            workdir = tempfile.mkdtemp(prefix="dpprobe-scatternet-bench-")
            try:
                extract.extract_split(subset, backbone, os.path.join(workdir, "s.zarr"),
                                      batch_size=args.batch_size, progress=False)
            finally:
                shutil.rmtree(workdir)

        pipeline()  # warm: zarr's imports, the writer's first chunk
        rounds = {"scattering alone": [], "extract_split": []}
        for _ in range(args.repeats):
            rounds["scattering alone"].append(timed(bare))
            rounds["extract_split"].append(timed(pipeline))
        results[name] = {what: (n / statistics.median(w for w, _ in times),
                                1e3 * statistics.median(c for _, c in times) / n)
                         for what, times in rounds.items()}

    load = os.getloadavg()
    print(f"\n{data} {shape[0]}x{shape[1]}, J = 2, L = 8, batch {args.batch_size}, medians of "
          f"{args.repeats}; torch threads {torch.get_num_threads()}, {os.cpu_count()} cores; "
          f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print(f"{'implementation':18s} {'what':18s} {'images/s':>9s} {'CPU ms/image':>13s}")
    for name, rows in results.items():
        for what, (rate, cpu_ms) in rows.items():
            print(f"{name:18s} {what:18s} {rate:9.1f} {cpu_ms:13.3f}")
    for what in ("scattering alone", "extract_split"):
        (old_rate, old_cpu), (new_rate, new_cpu) = (results[name][what] for name in results)
        print(f"new / old, {what}: {new_rate / old_rate:.1f}x images/s, "
              f"{old_cpu / new_cpu:.1f}x less CPU per image")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
