"""The options of the commands that write, apply and export model files: `probe
--save-model`, `predict`, `export` (`pipelines.arguments` holds the other commands')."""

from __future__ import annotations

from pipelines.arguments import _integer

__all__ = ["TEXTS", "export", "predict", "probe_save_model"]


def probe_save_model(p) -> None:
    p.add_argument("--save-model", metavar="DIR",
                   help="write one model file per epsilon (its first seed's run) into DIR, "
                   "named by epsilon (eps1.safetensors), for `dpprobe predict` and `export`")


def predict(p) -> None:
    p.add_argument("--model", required=True, help="a dpprobe model file")
    p.add_argument("--data", required=True, nargs="+", metavar="SPEC",
                   help="a feature store, a data spec as for extract (digits, fashion-mnist, "
                   "npz:PATH, imagefolder:PATH, ...), or image files / folders of images")
    p.add_argument("--split", help="the split of a store or data spec (default test)")
    p.add_argument("--out", help="write the CSV here (default: stdout)")
    p.add_argument("--top-k", type=_integer, metavar="K",
                   help="also write the K best classes and their probabilities (default 1)")
    p.add_argument("--weights", help="a copy of the backbone's weights file, where the recorded "
                   "path is not on this machine (its sha256 must match the record)")
    p.add_argument("--data-dir", help="directory of Fashion-MNIST's gzipped IDX files")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def export(p) -> None:
    from pipelines.export_job import FORMATS

    p.add_argument("out", metavar="OUT", help="the file to write")
    p.add_argument("--model", required=True, help="a dpprobe model file")
    p.add_argument("--format", required=True, choices=FORMATS,
                   help="torch: a torch.export program (any model); timm: a fine-tuned timm "
                   "ViT's state dict; onnx: an ONNX model (any model)")
    p.add_argument("--weights", help="a copy of the backbone's weights file (sha256 checked)")
    p.add_argument("--quiet", action="store_true")


TEXTS = {
    "predict": dict(
        help="apply a model file to a store, a data spec or image files; write a CSV",
        description="One CSV row per input: id, prediction (class name), probability, label "
        "(when known) and the top-k. Prints the accuracy when the input has labels. A model "
        "on features given images runs its recorded backbone (weights sha256-checked).",
    ),
    "export": dict(
        help="export a model file to PyTorch (torch.export), timm or ONNX",
        description="The exported module takes float32 NCHW images in [0, 1] at the model's "
        "input size (a probe on precomputed embeddings: its features) and returns logits.",
    ),
}
