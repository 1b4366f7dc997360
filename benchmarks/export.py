"""`dpprobe export --format onnx` and `--format torch`: export time, file size, load time and
throughput, side by side in one process.

1. A ScatterNet model: kymatio's filter-by-filter module against `extract.scattering`'s
   batched one (what the exports use: matrix DFTs for ONNX, batched FFTs for torch).
2. ONNX's two exporters (`model.onnx_export`): torch's TorchScript exporter (the default)
   against its dynamo exporter, on the ScatterNet model and on an EfficientNet-Lite0 at 224 px,
   with the largest |logit difference| between their files in onnxruntime.

The models are random-init (benchmark inputs, not trained models) written as the finetune job
writes them; throughput is the median of `--repeats` calls on `--batch` random images, and on
`--small-batch` (a serving-sized call).

    python benchmarks/export.py [--side 28] [--batch 256] [--small-batch 16] [--repeats 5]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _path  # noqa: F401  (first: this folder off the import path)


def model_file(folder: str, side: int, name: str = "scatternet_cnn_linear") -> str:
    """A random-init model file: the ScatterNet model on `side` px gray images, or a timm
    architecture `name` on `side` px RGB images."""
    from flax import nnx

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import dpprobe.finetune.models as fm
    from dpprobe import model as dpmodel
    from dpprobe import model_files
    from tests.model_helpers import perturb_nnx  # every parameter plus N(0, 0.01^2) noise

    classes = [str(c) for c in range(10)]
    gray = name == "scatternet_cnn_linear"
    if gray:
        model = fm.create_model(name, len(classes), image_size=side, in_channels=1,
                                rngs=nnx.Rngs(0))
    else:
        import timm

        model = fm.model_from_timm(timm.create_model(name, pretrained=False,
                                                     num_classes=len(classes)).eval(),
                                   len(classes), rngs=nnx.Rngs(0))
    perturb_nnx(model, 0.01)  # the zero head too: logits that depend on every layer
    channels, stats = (1, (0.5,)) if gray else (3, (0.5, 0.5, 0.5))
    document = model_files.header("finetune", classes) | dpmodel.network_document(
        model, name=name, num_classes=len(classes), image_size=side, channels=channels,
        resize=None, crop=None, rgb=not gray, mean=stats, std=stats,
        timm_architecture=None if gray else name) | {
        "parameters": {"released": "final iterate"},
        "privacy": {"epsilon": 1.0, "delta": 1e-5, "accountant": "pld",
                    "neighboring_relation": "zero_out", "ledger": {}},
        "training": {}}
    path = os.path.join(folder, f"{name}.safetensors")
    model_files.write_model(path, dpmodel.network_arrays(model), document)
    return path


def onnx_runner(data: bytes):
    import onnxruntime

    session = onnxruntime.InferenceSession(data)
    name = session.get_inputs()[0].name
    return lambda x: session.run(None, {name: x})


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
    parser.add_argument("--exporters-only", action="store_true",
                        help="only table 2 (the ONNX exporters)")
    args = parser.parse_args()
    if not args.exporters_only:
        scatternet_exports(args)
    exporters(args)


def scatternet_exports(args) -> None:
    """Table 1: kymatio's module against the batched one, in both formats."""
    import io

    import numpy as np
    import torch

    import dpprobe.extract.scattering  # noqa: F401 (loads the submodule)
    from dpprobe import extract
    from dpprobe import model as dpmodel
    from dpprobe.model import onnx_export, torch_export

    rng = np.random.default_rng(0)
    images = rng.random((args.batch, 1, args.side, args.side), dtype=np.float32)
    small = images[:args.small_batch]
    batched = extract.scattering.batch_scatterings
    kymatio = lambda module, dft: module  # noqa: E731 - the exports without the swap

    def torch_runner(data):
        program = torch.export.load(io.BytesIO(data)).module()

        def run(x):
            with torch.no_grad():
                return program(torch.from_numpy(x))
        return run

    exports = [("onnx, kymatio's module", kymatio, onnx_export.export_onnx, onnx_runner),
               ("onnx, batched + matrix DFTs", batched, onnx_export.export_onnx, onnx_runner),
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


def exporters(args) -> None:
    """Table 2: ONNX's TorchScript exporter against its dynamo exporter."""
    import numpy as np

    from dpprobe import model as dpmodel
    from dpprobe.model import onnx_export

    rng = np.random.default_rng(1)
    print(f"\nONNX exporters (model.onnx_export), medians of {args.repeats} calls of "
          f"{args.small_batch} images")
    print(f"{'model':28s} {'exporter':12s} {'export s':>9s} {'MB':>6s} {'img/s':>7s} "
          f"{'max |logit|':>12s} {'max |logit diff|':>17s}")
    with tempfile.TemporaryDirectory() as folder:
        for name, side, channels in (("scatternet_cnn_linear", args.side, 1),
                                     ("tf_efficientnet_lite0", 224, 3)):
            model = dpmodel.load_model(model_file(folder, side, name))
            x = rng.random((args.small_batch, channels, side, side), dtype=np.float32)
            logits = {}
            for exporter in ("torchscript", "dynamo"):
                start = time.perf_counter()
                data, _ = onnx_export.export_onnx(model, exporter=exporter)
                seconds = time.perf_counter() - start
                run = onnx_runner(data)
                logits[exporter] = run(x)[0]
                diff = np.abs(logits[exporter] - logits["torchscript"]).max()
                print(f"{name + f' ({side} px)':28s} {exporter:12s} {seconds:9.1f} "
                      f"{len(data) / 1e6:6.1f} {throughput(run, x, args.repeats):7.0f} "
                      f"{np.abs(logits[exporter]).max():12.3f} {diff:17.2e}")


if __name__ == "__main__":
    main()
