"""`dpprobe export --format onnx` and `--format torch` of a ScatterNet model: export time, file
size, load time and throughput, kymatio's filter-by-filter module against `extract.scattering`'s
batched one (what the exports use: matrix DFTs for ONNX, batched FFTs for torch), side by side
in one process.

The model is a random-init `scatternet_cnn_linear` (a benchmark input, not a trained model)
written as the finetune job writes it; throughput is the median of `--repeats` calls on
`--batch` random images, and on `--small-batch` (a serving-sized call).

    python benchmarks/export.py [--side 28] [--batch 256] [--small-batch 16] [--repeats 5]
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
    parser.add_argument("--small-batch", type=int, default=16)
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

    rng = np.random.default_rng(0)
    images = rng.random((args.batch, 1, args.side, args.side), dtype=np.float32)
    small = images[:args.small_batch]
    batched = extract.scattering.batch_scatterings
    kymatio = lambda module, dft: module  # noqa: E731 - the exports without the swap

    def onnx_runner(data):
        session = onnxruntime.InferenceSession(data)
        name = session.get_inputs()[0].name
        return lambda x: session.run(None, {name: x})

    def torch_runner(data):
        program = torch.export.load(io.BytesIO(data)).module()

        def run(x):
            with torch.no_grad():
                return program(torch.from_numpy(x))
        return run

    exports = [("onnx, kymatio's module", kymatio, torch_export.export_onnx, onnx_runner),
               ("onnx, batched + matrix DFTs", batched, torch_export.export_onnx, onnx_runner),
               ("torch, kymatio's module", kymatio, torch_export.export_torch, torch_runner),
               ("torch, batched FFTs", batched, torch_export.export_torch, torch_runner)]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        model = dpmodel.load_model(model_file(folder, args.side))
        for label, swap, export, runner in exports:
            extract.scattering.batch_scatterings = swap
            start = time.perf_counter()
            data, _ = export(model)
            seconds = time.perf_counter() - start
            start = time.perf_counter()
            run = runner(data)
            load = time.perf_counter() - start
            rows.append((label, seconds, len(data), load, throughput(run, images, args.repeats),
                         throughput(run, small, args.repeats)))
        extract.scattering.batch_scatterings = batched
    print(f"scatternet_cnn_linear, {args.side} px, medians of {args.repeats} calls, "
          f"{os.cpu_count()} CPUs")
    batch, small_batch = f"img/s @{args.batch}", f"img/s @{args.small_batch}"
    print(f"{'export':32s} {'export s':>9s} {'MB':>6s} {'load s':>7s} {batch:>11s} "
          f"{small_batch:>11s}")
    for label, seconds, size, load, rate, small_rate in rows:
        print(f"{label:32s} {seconds:9.1f} {size / 1e6:6.1f} {load:7.2f} {rate:11.0f} "
              f"{small_rate:11.0f}")
    for fmt, (before, after) in (("onnxruntime", rows[:2]), ("torch", rows[2:])):
        print(f"{fmt}, batched / kymatio's: {after[4] / before[4]:.2f}x images per second at "
              f"{args.batch}, {after[5] / before[5]:.2f}x at {args.small_batch}, "
              f"{before[1] / after[1]:.1f}x faster export, {before[3] / after[3]:.1f}x faster "
              "load")


if __name__ == "__main__":
    main()
