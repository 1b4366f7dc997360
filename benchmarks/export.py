"""`dpprobe export --format onnx` of a ScatterNet model: export time, file size and
onnxruntime throughput, kymatio's filter-by-filter module against `extract.scattering`'s
batched one with matrix DFTs (what the export uses), side by side in one process; and the
`torch` export (kymatio's module, unchanged) for reference.

The model is a random-init `scatternet_cnn_linear` (a benchmark input, not a trained model)
written as the finetune job writes it; throughput is the median of `--repeats` calls on
`--batch` random images.

    python benchmarks/export.py [--side 28] [--batch 256] [--repeats 5]
"""

import argparse
import os
import statistics
import tempfile
import time

import _path  # noqa: F401  (first: this folder off the import path)


def model_file(folder: str, side: int) -> str:
    from flax import nnx

    import dpprobe.finetune.models as fm
    from dpprobe import model as dpmodel
    from dpprobe import model_files

    classes = [str(c) for c in range(10)]
    model = fm.create_model("scatternet_cnn_linear", len(classes), image_size=side,
                            in_channels=1, rngs=nnx.Rngs(0))
    document = model_files.header("finetune", classes) | dpmodel.network_document(
        model, name="scatternet_cnn_linear", num_classes=len(classes), image_size=side,
        channels=1, resize=None, crop=None, rgb=False, mean=(0.5,), std=(0.5,),
        timm_architecture=None) | {
        "parameters": {"released": "final iterate"},
        "privacy": {"epsilon": 1.0, "delta": 1e-5, "accountant": "pld",
                    "neighboring_relation": "zero_out", "ledger": {}},
        "training": {}}
    path = os.path.join(folder, "scatternet.safetensors")
    model_files.write_model(path, dpmodel.network_arrays(model), document)
    return path


def throughput(run, images, repeats: int) -> float:
    run(images)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(images)
        times.append(time.perf_counter() - start)
    return len(images) / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", type=int, default=28)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import io

    import numpy as np
    import onnxruntime
    import torch

    import dpprobe.extract.scattering  # noqa: F401 (loads the submodule)
    from dpprobe import extract
    from dpprobe import model as dpmodel
    from dpprobe.model import torch_export

    images = np.random.default_rng(0).random((args.batch, 1, args.side, args.side),
                                             dtype=np.float32)
    batched = extract.scattering.batch_scatterings
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        model = dpmodel.load_model(model_file(folder, args.side))
        for label, swap in (("onnx, kymatio's module", lambda module, dft: module),
                            ("onnx, batched + matrix DFTs", batched)):
            extract.scattering.batch_scatterings = swap
            start = time.perf_counter()
            data, _ = torch_export.export_onnx(model)
            seconds = time.perf_counter() - start
            session = onnxruntime.InferenceSession(data)
            name = session.get_inputs()[0].name
            rate = throughput(lambda x, s=session, n=name: s.run(None, {n: x}), images,
                              args.repeats)
            rows.append((label, seconds, len(data), rate))
        extract.scattering.batch_scatterings = batched
        start = time.perf_counter()
        data, _ = torch_export.export_torch(model)
        seconds = time.perf_counter() - start
        program = torch.export.load(io.BytesIO(data)).module()
        rate = throughput(lambda x: program(torch.from_numpy(x)), images, args.repeats)
        rows.append(("torch (torch.export), kymatio's module", seconds, len(data), rate))
    print(f"scatternet_cnn_linear, {args.side} px, {args.batch} images per call, "
          f"medians of {args.repeats}, {os.cpu_count()} CPUs")
    print(f"{'export':40s} {'export s':>9s} {'MB':>6s} {'img/s':>8s}")
    for label, seconds, size, rate in rows:
        print(f"{label:40s} {seconds:9.1f} {size / 1e6:6.1f} {rate:8.0f}")
    print(f"onnxruntime, batched / kymatio's: {rows[1][3] / rows[0][3]:.1f}x images per second, "
          f"{rows[0][1] / rows[1][1]:.1f}x faster export")


if __name__ == "__main__":
    main()
