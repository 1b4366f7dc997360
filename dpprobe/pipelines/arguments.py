"""What the `dpprobe` command line adds to the jobs' configs: each command's texts (help,
description, epilog) and the options that change only how it prints (`--json`). Every other
option is written once, on the config field it sets (`dpprobe.options`)."""

from __future__ import annotations

EPILOG = """\
Privacy: every epsilon is for zero-out neighbours (one record replaced by a null record; the
dataset size N is public), computed from the DpEvent of what ran, with the PLD accountant{}.
Noise and batch sampling always draw from OS entropy."""


def info_output(p) -> None:
    p.add_argument("--json", action="store_true", help="print all attributes as JSON")


def account_output(p) -> None:
    p.add_argument("--json", action="store_true", help="print JSON")


# The settings the commands that train with an accountant share: `--seed` must not silently
# mean `--seeds` (no abbreviations), and the privacy epilog.
_TRAINING = dict(allow_abbrev=False, epilog=EPILOG.format(" unless --accountant rdp"))


def verify_output(p) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")


# The parser texts of each command (help, description, epilog).
TEXTS = {
    "extract": dict(
        help="run a frozen backbone over a dataset into a Zarr feature store",
        description="Embed a dataset with a frozen backbone and write STORE/{train,test}. "
        "Rerunning an interrupted command resumes from the last complete chunk.",
        epilog="Data specs: fashion-mnist, digits, npz:PATH (images, labels), "
        "imagefolder:PATH (one folder per class), cifar10:PATH, cifar100:PATH. "
        "Backbones: any timm model name (optionally .tag), scatternet, or none (npz:PATH "
        "holding features and labels).",
    ),
    "finetune": dict(
        _TRAINING,
        help="train every weight of a backbone with DP-SGD on images",
        description="DP-SGD on a whole model (Flax NNX): Poisson-sampled batches, per-example "
        "clipping, augmentation multiplicity, EMA (De et al.; Beltran et al.). Reports the "
        "test accuracy at the (epsilon, delta) it spent.",
    ),
    "probe": dict(
        _TRAINING,
        help="train DP linear probes on a feature store over a sweep of epsilons",
        description="Full-batch DP linear probe (zero init) for every epsilon x steps x lr x "
        "seed, in one compiled program; prints test accuracy mean ± std over seeds.",
    ),
    "tune": dict(
        allow_abbrev=False,  # `--seed` must not silently mean `--seeds`
        help="private hyperparameter search (linear scaling rule) + final probe",
        description="Panda et al.'s linear scaling rule: search r = lr x T at budgets eps0 "
        "and eps1, fit r = alpha * epsilon + b, extrapolate, train the final full-batch "
        "DP-SGD probe with the remaining budget. The total epsilon includes every trial.",
        epilog=EPILOG.format(""),
    ),
    "account": dict(
        help="epsilon from a noise multiplier, or the noise multiplier for an epsilon",
        description="Privacy accounting of T Gaussian steps (Poisson-sampled if q < 1).",
        epilog=EPILOG.format(" unless --accountant rdp"),
    ),
    "audit": dict(
        help="measure the privacy a probe's mechanism at least lacks, with canaries",
        description="Train probes with a crafted canary row and with a null record in its "
        "place (the production trainer and mechanism, noise calibrated for --epsilon), score "
        "each, and bound epsilon from below at --delta: the Gaussian-DP fit and the "
        "Clopper-Pearson bound, with the ratio to the claim. Exit status 1 when a lower bound "
        "exceeds the claim.",
        epilog="A lower bound for this canary and this threat model, not a proof of privacy. "
        "The claim is for zero-out neighbours (one record replaced by a null record; N public), "
        "computed with the PLD accountant; noise keys and the row sample draw from OS entropy.",
    ),
    "verify": dict(
        help="check a feature store: completeness, shapes, NaN/Inf, labels, checksums",
        description="Reads every chunk: reports missing or incomplete splits, shape and dtype "
        "mismatches, NaN/Inf, labels out of range, and chunks whose sha256 differs from the "
        "one recorded when they were written. Exit status 1 if anything is wrong.",
    ),
    "info": dict(
        help="print a feature store's provenance",
        description="Backbone, weights, preprocessing, dataset fingerprint, shapes and "
        "completion of every split.",
    ),
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
    "demo": dict(
        help="show the privacy/utility trade-off: extract, sweep epsilon, tune privately",
        description="Fashion-MNIST (or, when absent, digits) -> ScatterNet features (reused "
        "by later runs) -> dpprobe probe's defaults at epsilon 0.5, 1, 2, 4, 8 and without "
        "noise (table, plot) -> dpprobe tune at epsilon 3, every cost paid; delta 1e-5.",
        epilog=EPILOG.format(""),
    ),
}
