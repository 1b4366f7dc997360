"""The demo job: what dpprobe does, in one command that runs in minutes on a laptop.

1. Features: Fashion-MNIST (Debian's package) or, when absent, scikit-learn digits, through
   ScatterNet into a store under `out_dir` (reused, and said so, by a second run).
2. The privacy/utility trade-off: `dpprobe probe` with the defaults it chooses from the store
   (`probe.recipe`) at epsilon 0.5, 1, 2, 4, 8 and without noise, a table and a plot.
3. Private tuning at epsilon 3 with every cost paid (`dpprobe tune`), put on the same plot
   beside Tramer & Boneh's published 89.7% (whose tuning was not paid for).
4. The tuned model file, loaded as a user would, predicts the first test images.
Each step is a public job of the Python API; the demo adds only the order and the plot.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

from dpprobe import checks, extract, plots, preflight
from dpprobe.messages import log
from dpprobe.model.predictions import predict_examples
from dpprobe.options import integer, option
from dpprobe.pipelines.extract_job import run_extract
from dpprobe.pipelines.probe_job import probe_table, run_probe
from dpprobe.pipelines.reporting import PRIVACY_EPILOG
from dpprobe.pipelines.tune_job import run_tune
from dpprobe.probe import recipe

__all__ = [
    "DEMO_DATA", "DEMO_EPSILONS", "DEMO_TUNE", "DemoConfig", "demo_data", "demo_report",
    "run_demo",
]

DEMO_DATA = ("fashion-mnist", "digits")
DEMO_EPSILONS = (0.5, 1.0, 2.0, 4.0, 8.0, math.inf)
DEMO_DELTA = 1e-5
# Test images the tuned model predicts at the end.
PREDICT_IMAGES = 8
# Steps of the sweep's full-batch runs where the probe's default (T = 300) would not fit the
# demo in minutes on two CPU cores (Fashion-MNIST: 60,000 x 3,969 features). The learning rate
# follows (lr = r / T, the same r). T = 100 loses 0.3-1 point against T = 300 (README, `dpprobe
# probe`); T = 50 lost the trade-off itself (88.0-88.3% from epsilon 1 to inf: the large
# learning rates of short runs overshoot).
DEMO_STEPS = {"fashion-mnist": 100}
# The demo's tune, smaller than `dpprobe tune`'s defaults for the same reason: 3 trials per
# stage of T = 25 and a final run of T = 100 (the defaults: 5 trials of T in 25, 50, 100 and a
# final T = 300). Every cost is still paid.
DEMO_TUNE = {"epsilon": 3.0, "trials": 3, "steps_choices": (25,), "final_steps": 100}
# Tramer & Boneh (2021, https://arxiv.org/abs/2011.11660), Table 1: ScatterNet + linear model
# on Fashion-MNIST, 89.7% at epsilon 3, delta 1e-5, hyperparameters tuned without paying for it.
PUBLISHED = {"fashion-mnist": plots.Reference(
    3.0, 89.7, "Tramer & Boneh 2021, ScatterNet + linear: 89.7% at epsilon 3\n"
    "(published; its hyperparameter tuning was not paid for)", marker="*", color="k")}


# `dpprobe demo`'s parser texts (help, description, epilog).
TEXTS = dict(
    help="show the privacy/utility trade-off: extract, sweep epsilon, tune privately",
    description="Fashion-MNIST (or, when absent, digits) -> ScatterNet features (reused "
    "by later runs) -> dpprobe probe's defaults at epsilon 0.5, 1, 2, 4, 8 and without "
    "noise (table, plot) -> dpprobe tune at epsilon 3, every cost paid; delta 1e-5.",
    epilog=PRIVACY_EPILOG.format(""),
)


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Where the demo writes, which data (None: fashion-mnist if installed, else digits), how
    many seeds (independent runs) per epsilon, whether to show progress."""

    out_dir: str = option("runs/demo", "--out", help="output directory (default %(default)s)")
    data: str | None = option(None, choices=DEMO_DATA, help="force a dataset (default: "
                              "fashion-mnist if installed, else digits)")
    seeds: int = option(1, type=integer, help="runs per epsilon (default %(default)s)")
    progress: bool = option(True, "--quiet", action="store_false", help="only the report")

    def __post_init__(self):
        if self.data is not None and self.data not in DEMO_DATA:
            raise checks.ConfigError("data", f"must be one of {DEMO_DATA}, got {self.data!r}")
        checks.check_int("seeds", self.seeds)


def demo_data() -> str:
    """Fashion-MNIST when Debian's files are present, scikit-learn digits otherwise."""
    if all((extract.sources.FASHION_MNIST_DIR / f"{stem}.gz").exists()
           for stem in extract.sources.FASHION_MNIST_SHA256):
        return "fashion-mnist"
    return "digits"


def run_demo(config: DemoConfig | str | None = None, /, **options) -> dict:
    """Extract the default data with ScatterNet, sweep epsilons with the probe's defaults, tune
    privately at epsilon 3, and plot the trade-off.

    Takes a `DemoConfig`, or the output folder and the config's other fields as keywords.

    Returns:
      {"data", "store", "sweep" (the probe's results), "tune" (the tune's results, without
      its parameters), "files" (what it wrote), "reused_features", "wall_seconds"}. The demo's
      data is public, so its duration may be shown; its sweep and tune write their timings to
      their owner's files all the same (`dpprobe.timings`).
    """
    config = checks.make_config(DemoConfig, config, "out_dir", **options)
    out = Path(config.out_dir)
    files = {"sweep": out / "results.json", "tune": out / "tune.json",
             "model": out / "tuned.safetensors", "plot": out / "tradeoff.png"}
    preflight.check_demo_job(config.out_dir)
    for path in files.values():
        preflight.check_output_paths(out_dir=path)
    for results_path in (files["sweep"], files["tune"]):  # and the owner's timings beside them
        preflight.check_timings_file(results_path)
    start = time.perf_counter()
    quiet = not config.progress
    data = config.data or demo_data()
    store = str(out / f"{data}-scatternet.zarr")

    # 1. Features, once: a second run finds them complete and says so.
    reused = all((extract.local_split_attrs(store, split) or {}).get("complete")
                 for split in ("train", "test"))
    log(f"demo [1/4] features: {data} through ScatterNet (J = 2, L = 8, no weights) into "
        f"{store}" + (": already extracted by an earlier run, reused" if reused else ""), quiet)
    run_extract(backbone="scatternet", data=data, out=store, progress=config.progress)

    # 2. The trade-off: the probe's defaults (chosen from the store), epsilon 0.5 to 8 and inf.
    steps = DEMO_STEPS.get(data)
    log(f"demo [2/4] the privacy/utility trade-off: one probe per epsilon in 0.5, 1, 2, 4, 8 "
        f"and one without noise, {config.seeds} seed(s) each, with the defaults `dpprobe probe` "
        "chooses from the store" + (f", but T = {steps} steps instead of "
                                    f"{recipe.PROBE_STEPS}, to fit the demo in minutes"
                                    if steps else ""), quiet)
    sweep = run_probe(store, epsilons=DEMO_EPSILONS, delta=DEMO_DELTA, seeds=config.seeds,
                      steps=(steps,) if steps else None, out=str(files["sweep"]), quiet=quiet)

    # 3. Private tuning at epsilon 3, every cost paid (the search decides whether it pays).
    log(f"demo [3/4] private tuning at epsilon {DEMO_TUNE['epsilon']:g}, every cost paid "
        "(standardization, search, selection and the final run in one ledger); smaller than "
        f"`dpprobe tune`'s defaults to fit the demo: {DEMO_TUNE['trials']} trials per stage of "
        f"T = {DEMO_TUNE['steps_choices'][0]}, final T = {DEMO_TUNE['final_steps']}", quiet)
    tune = run_tune(store, delta=DEMO_DELTA, out=str(files["tune"]),
                    save_model=str(files["model"]), quiet=quiet, **DEMO_TUNE)
    tune.pop("params")

    # 4. Predict: the tuned model file on a few test images, through its recorded backbone
    # (ScatterNet, run on the images), as `dpprobe predict --model` does.
    log(f"demo [4/4] predict: the tuned model ({files['model']}) on the first "
        f"{PREDICT_IMAGES} test images", quiet)
    predictions = predict_examples(str(files["model"]), data, PREDICT_IMAGES)

    # The plot: the sweep, the non-private line, the tuned run and the published reference.
    tuned = plots.Reference(
        tune["privacy"]["epsilon_total"], 100 * tune["final"]["test_accuracy"],
        f"dpprobe tune (this run): {100 * tune['final']['test_accuracy']:.1f}% at epsilon "
        f"{tune['privacy']['epsilon_total']:.3g}, tuning paid", marker="D", color="C3",
        filled=False)
    references = [tuned] + ([PUBLISHED[data]] if data in PUBLISHED else [])
    plots.plot_accuracy(sweep["summary"], files["plot"], title=plots.plot_title(sweep),
                        references=references, warnings=sweep["warnings"])
    return {"data": data, "store": store, "sweep": sweep, "tune": tune,
            "files": {name: str(path) for name, path in files.items()},
            "reused_features": reused, "published": PUBLISHED.get(data),
            "predictions": predictions,
            "wall_seconds": time.perf_counter() - start}


def demo_report(results: dict) -> str:
    """What `dpprobe demo` prints: the trade-off table, the tuned run beside the published
    reference, the files it wrote and how long it took."""
    tune, privacy = results["tune"], results["tune"]["privacy"]
    lines = [probe_table(results["sweep"]), "",
             f"tuned privately: {100 * tune['final']['test_accuracy']:.2f}% test accuracy at "
             f"total epsilon {privacy['epsilon_total']:.4f} (delta {privacy['delta']:g}), every "
             f"cost paid ({tune['ledger']['num_mechanisms']} mechanisms in its ledger); "
             + tune["search"]["decision"]]
    published = results.get("published")
    if published is not None:
        lines.append(f"published reference: {published.label.replace(chr(10), ' ')}")
    predictions = results.get("predictions") or []
    if predictions:
        lines.append(f"the tuned model on {len(predictions)} test images: " + ", ".join(
            f"{p['prediction']} ({100 * p['probability']:.0f}%"
            + (")" if p["prediction"] == p["label"] else f"; it is {p['label']})")
            for p in predictions))
    lines += [f"wrote {path}" for path in results["files"].values()]
    features = ("reused the features extracted by an earlier run" if results["reused_features"]
                else "features extracted")
    lines.append(f"demo finished in {results['wall_seconds']:.0f} s ({features}: "
                 f"{results['store']})")
    lines.append(f"next: dpprobe finetune --data {results['data']} --epsilon 3 --out ft (DP-SGD "
                 "on a whole network; the default for small images is a ScatterNet + CNN), "
                 f"dpprobe export --model {results['files']['model']} --format onnx "
                 "model.onnx (README: \"Use your model\")")
    return "\n".join(lines)
