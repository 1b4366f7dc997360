"""The jobs users run: extract, probe, account, demo. Each reads top to bottom."""

from __future__ import annotations

import datetime
import itertools
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import accounting
import extract
from pipelines import reporting

__all__ = ["account", "run_demo", "run_extract", "run_probe"]

VERSION = "0.1.0"


def _log(message: str, quiet: bool = False) -> None:
    if not quiet:
        print(message, file=sys.stderr, flush=True)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


# ----------------------------------------------------------------------------------------------
# extract
# ----------------------------------------------------------------------------------------------


def run_extract(
    *,
    backbone: str,
    data: str,
    out: str,
    split: str | None = None,
    data_dir: str | None = None,
    weights: str | None = None,
    random_init: bool = False,
    seed: int = 0,
    resize: int | None = None,
    crop: int | None = None,
    batch_size: int = 256,
    dtype: str = "float16",
    device: str | None = None,
    rows_per_chunk: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> list:
    """Extract embeddings of a data source into the feature store `out`.

    Sources with their own splits (fashion-mnist, digits, cifar) write both unless `split`
    names one; single-split sources (npz, imagefolder) write the split named by `split`
    (default "train") into a new or existing store.
    """
    # Open the data and the backbone.
    precomputed = backbone == "none"
    splits = extract.open_source(data, split=split, data_dir=data_dir, precomputed=precomputed)
    model = None
    if not precomputed:
        model = extract.create_backbone(
            backbone,
            weights=weights,
            random_init=random_init,
            seed=seed,
            resize=resize,
            crop=crop,
            device=device,
        )
    # Extract every split, resumably.
    reports = []
    for name, data_split in splits.items():
        report = extract.extract_split(
            data_split,
            model,
            out,
            split_name=name,
            batch_size=batch_size,
            dtype=dtype,
            rows_per_chunk=rows_per_chunk,
            overwrite=overwrite,
            progress=progress,
        )
        reports.append(report)
        state = "complete" if report.complete else "INCOMPLETE"
        _log(
            f"{out}/{name}: {report.num_examples} x {report.feature_shape} ({dtype}), "
            f"{report.chunks_written}/{report.num_chunks} chunks written"
            f"{' (resumed)' if report.resumed else ''}, {state}",
            quiet=not progress,
        )
    return reports


# ----------------------------------------------------------------------------------------------
# probe
# ----------------------------------------------------------------------------------------------


def run_probe(
    store: str,
    *,
    epsilons: Sequence[float],
    delta: float,
    seeds: int = 3,
    optimizer: str = "adam",
    steps: Sequence[int] = (1,),
    learning_rates: Sequence[float] | None = None,
    loss: str = "softmax",
    clip_norm: float = 1.0,
    accountant: str = "pld",
    seed: int | None = None,
    normalization: str = "none",
    groups: int = 1,
    bias_init: float | None = None,
    out: str | None = None,
    quiet: bool = False,
) -> dict:
    """Sweep DP linear probes over epsilons x steps x learning rates x seeds on a store.

    Every run is full batch: T steps of the Gaussian mechanism on the clipped gradient sum,
    with the noise multiplier calibrated to (epsilon, delta) for add/remove-one neighbours.
    The reported `epsilon_spent` is computed from the run's `DpEvent` by `accountant`.

    Returns:
      The results dict (also written to `out` as JSON when given).
    """
    import probe  # JAX: imported here so that `dpprobe extract` does not pay for it

    start = time.perf_counter()
    _check_sweep_args(epsilons, delta, seeds, steps, clip_norm)
    learning_rates = list(learning_rates or [probe.DEFAULT_LEARNING_RATES[optimizer]])

    # Load the store.
    train_x, train_y, train_attrs = extract.load_split(store, "train")
    test_x, test_y, test_attrs = extract.load_split(store, "test")
    if train_x.shape[-1] != test_x.shape[-1]:
        raise ValueError(f"train and test feature dims differ: {train_x.shape} vs {test_x.shape}")
    num_classes = int(max(train_attrs.get("num_classes") or 0, train_y.max() + 1, test_y.max() + 1))
    num_examples = len(train_y)
    if delta >= 1.0 / num_examples:
        _log(f"warning: delta={delta:g} >= 1/N = {1 / num_examples:.3g}; "
             "a meaningful guarantee usually needs delta << 1/N", quiet)
    spec = probe.ProbeSpec(
        num_classes=num_classes,
        loss=loss,
        optimizer=optimizer,
        bias_init=bias_init,
        normalization=normalization,
        groups=groups,
    )

    # Calibrate the noise of each (epsilon, T).
    plans = {}
    for epsilon, num_steps in itertools.product(epsilons, steps):
        sigma = accounting.calibrate_noise_multiplier(
            epsilon, delta, steps=num_steps, accountant=accountant
        )
        plans[epsilon, num_steps] = accounting.DpPlan(
            sigma, num_steps, 1.0, clip_norm if math.isfinite(epsilon) else math.inf
        )

    # Train every config in one program.
    grid = list(itertools.product(epsilons, steps, learning_rates, range(seeds)))
    runs = [probe.RunSpec(plans[e, t], lr) for e, t, lr, _ in grid]
    keys = probe.make_keys(len(runs), seed)
    result = probe.train_probe(train_x, train_y, runs, keys, spec)

    # Evaluate on the test split.
    metrics = probe.evaluate(result.params, probe.prepare_features(test_x, spec), test_y)

    # Record.
    records = []
    for i, (epsilon, num_steps, lr, seed_index) in enumerate(grid):
        plan = plans[epsilon, num_steps]
        records.append(
            {
                "epsilon": epsilon,
                "epsilon_spent": plan.epsilon(delta, accountant) if plan.is_private else math.inf,
                "delta": delta,
                "noise_multiplier": plan.noise_multiplier,
                "clip_norm": plan.clip_norm,
                "steps": num_steps,
                "sampling_probability": plan.sampling_probability,
                "optimizer": optimizer,
                "learning_rate": lr,
                "seed": seed_index,
                "test_accuracy": float(metrics["top1"][i]),
                "test_top5_accuracy": float(metrics["top5"][i]),
                "per_class_accuracy": metrics["per_class"][i].tolist(),
                "clipped_fraction": float(result.clipped_fraction[i]),
                "accountant": accountant,
                "neighboring_relation": accounting.NEIGHBORING_RELATION,
                "dp_event": accounting.event_to_dict(plan.dp_event()),
            }
        )
    summary = reporting.summarize_runs(
        records, ("epsilon", "steps", "learning_rate"), ("test_accuracy", "test_top5_accuracy")
    )
    results = {
        "dpprobe_version": VERSION,
        "job": "probe",
        "created": _now(),
        "wall_seconds": time.perf_counter() - start,
        "store": str(store),
        "provenance": {"train": train_attrs, "test": _split_brief(test_attrs)},
        "probe": spec.to_dict(),
        "privacy": {
            "delta": delta,
            "accountant": accountant,
            "neighboring_relation": accounting.NEIGHBORING_RELATION,
            "dataset_size_public": True,
            "sampling": "full batch (q = 1)",
            "noise_keys": "os-entropy" if seed is None else f"seeded ({seed})",
        },
        "num_train": num_examples,
        "num_test": len(test_y),
        "runs": records,
        "summary": summary,
    }
    if out:
        reporting.write_json(out, results)
    results["wall_seconds"] = time.perf_counter() - start
    return results


def _split_brief(attrs: dict) -> dict:
    keys = ("split", "num_examples", "dataset", "backbone", "dtype", "complete", "created")
    return {k: attrs.get(k) for k in keys}


def _check_sweep_args(epsilons, delta, seeds, steps, clip_norm) -> None:
    if not epsilons:
        raise ValueError("give at least one epsilon")
    for epsilon in epsilons:
        if math.isnan(epsilon) or epsilon <= 0:
            raise ValueError(f"epsilon must be > 0 (or inf), got {epsilon}")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    for num_steps in steps:
        if num_steps < 1:
            raise ValueError(f"steps must be >= 1, got {num_steps}")
    if not clip_norm > 0 or math.isinf(clip_norm):
        raise ValueError(f"clip_norm must be finite and > 0, got {clip_norm}")


def probe_table(results: dict) -> str:
    """The printed table: epsilon, noise multiplier, steps, lr, accuracy mean ± std."""
    rows = []
    for row in results["summary"]:
        rows.append(
            row
            | {
                "acc": reporting.pm(row["test_accuracy_mean"], row["test_accuracy_std"]),
                "top5": reporting.pm(row["test_top5_accuracy_mean"], row["test_top5_accuracy_std"]),
            }
        )
    columns = [
        ("epsilon", "epsilon"),
        ("eps spent", "epsilon_spent"),
        ("noise mult", "noise_multiplier"),
        ("steps", "steps"),
        ("lr", "learning_rate"),
        ("seeds", "num_seeds"),
        ("test acc % (mean ± std)", "acc"),
        ("top-5 %", "top5"),
    ]
    privacy = results["privacy"]
    header = (
        f"delta={privacy['delta']:g}, accountant={privacy['accountant'].upper()}, "
        f"neighbours: {privacy['neighboring_relation'].replace('_', ' ')}, "
        f"{privacy['sampling']}; N_train={results['num_train']}, N_test={results['num_test']}"
    )
    return header + "\n" + reporting.format_table(rows, columns)


# ----------------------------------------------------------------------------------------------
# account
# ----------------------------------------------------------------------------------------------


def account(
    *,
    delta: float,
    epsilon: float | None = None,
    noise_multiplier: float | None = None,
    steps: int = 1,
    sampling_probability: float = 1.0,
    accountant: str = "pld",
) -> dict:
    """Epsilon from a noise multiplier, or the noise multiplier for a target epsilon."""
    if (epsilon is None) == (noise_multiplier is None):
        raise ValueError("give exactly one of --epsilon and --noise-multiplier")
    if epsilon is not None:
        noise_multiplier = accounting.calibrate_noise_multiplier(
            epsilon,
            delta,
            steps=steps,
            sampling_probability=sampling_probability,
            accountant=accountant,
        )
    plan = accounting.DpPlan(noise_multiplier, steps, sampling_probability)
    return {
        "target_epsilon": epsilon,
        "epsilon": plan.epsilon(delta, accountant),
        "delta": delta,
        "noise_multiplier": noise_multiplier,
        "steps": steps,
        "sampling_probability": sampling_probability,
        "accountant": accountant,
        "neighboring_relation": accounting.NEIGHBORING_RELATION,
        "dp_event": accounting.event_to_dict(plan.dp_event()),
    }


# ----------------------------------------------------------------------------------------------
# demo
# ----------------------------------------------------------------------------------------------

DEMO_EPSILONS = (0.5, 1.0, 2.0, 4.0, 8.0, math.inf)


def demo_data() -> str:
    """Fashion-MNIST when Debian's files are present, scikit-learn digits otherwise."""
    if all((extract.sources.FASHION_MNIST_DIR / f"{stem}.gz").exists()
           for stem in extract.sources.FASHION_MNIST_SHA256):
        return "fashion-mnist"
    return "digits"


def run_demo(out_dir: str = "runs/demo", *, data: str | None = None, seeds: int = 3,
             progress: bool = True) -> dict:
    """Extract the embedded default data with ScatterNet, sweep epsilons, write results.json."""
    data = data or demo_data()
    out = Path(out_dir)
    store = str(out / f"{data}-scatternet.zarr")
    _log(f"demo: {data} -> scatternet (J=2) features -> {store}", not progress)
    run_extract(backbone="scatternet", data=data, out=store, progress=progress)
    _log("demo: full-batch DP-SGD with momentum 0.9 (Panda et al.), T=20, lr=1, clip 1, zero "
         "init, per-example group normalization (27 groups, Tramer & Boneh)", not progress)
    results = run_probe(
        store,
        epsilons=DEMO_EPSILONS,
        delta=1e-5,
        seeds=seeds,
        optimizer="momentum",
        steps=(20,),
        learning_rates=(1.0,),
        normalization="group",
        groups=27,
        out=str(out / "results.json"),
        quiet=not progress,
    )
    return results
