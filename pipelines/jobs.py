"""The jobs users run: extract, probe, account, demo. Each reads top to bottom."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

import accounting
import extract
from pipelines import preflight, records, reporting

__all__ = [
    "account",
    "run_demo",
    "run_extract",
    "run_extract_ray",
    "run_probe",
    "run_tune",
    "tune_report",
    "store_info",
    "verify",
]

VERSION = records.VERSION


def _log(message: str, quiet: bool = False) -> None:
    if not quiet:
        print(message, file=sys.stderr, flush=True)


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
    num_workers: int | None = None,
    amp: str | None = "auto",
    channels_last: bool = False,
    compile: bool = False,
    shard: tuple[int, int] | None = None,
    views: int | None = None,
    augment: Sequence[str] = (),
    augment_seed: int = 0,
    ray: bool = False,
    ray_address: str | None = None,
    ray_shards: int | None = None,
    num_classes: int | None = None,
) -> list:
    """Extract embeddings of a data source into the feature store `out`.

    Sources with their own splits (fashion-mnist, digits, cifar) write both unless `split`
    names one; single-split sources (npz, imagefolder) write the split named by `split`
    (default "train") into a new or existing store. `shard=(k, n)` extracts one shard;
    `ray=True` runs the shards as Ray tasks (see `run_extract_ray`). `num_classes` declares
    the class count of a source without class names (an npz without `class_names`).

    `out` must be a new path or a dpprobe store: anything else is refused before any work.
    """
    extract.check_out_path(out)
    if ray:
        preflight.require_module("ray", "--ray", "pip install ray==2.60.0")
    options = dict(
        backbone=backbone, data=data, out=out, split=split, data_dir=data_dir, weights=weights,
        random_init=random_init, seed=seed, resize=resize, crop=crop, batch_size=batch_size,
        dtype=dtype, device=device, rows_per_chunk=rows_per_chunk, num_workers=num_workers,
        amp=amp, channels_last=channels_last, compile=compile, views=views,
        augment=tuple(augment), augment_seed=augment_seed, num_classes=num_classes,
    )
    if ray:
        if shard is not None:
            raise ValueError("--ray launches the shards itself; drop --shard")
        return run_extract_ray(options, address=ray_address, num_shards=ray_shards,
                               overwrite=overwrite, progress=progress)
    return _extract_local(options, shard=shard, overwrite=overwrite, progress=progress)


def _extract_local(options: dict, *, shard=None, overwrite=False, progress=True,
                   only_create=False) -> list:
    """Open the data and the backbone, then extract every split (or create it, empty)."""
    precomputed = options["backbone"] == "none"
    splits = extract.open_source(options["data"], split=options["split"],
                                 data_dir=options["data_dir"], precomputed=precomputed,
                                 num_classes=options.get("num_classes"))
    model = None
    if not precomputed:
        model = extract.create_backbone(
            options["backbone"], weights=options["weights"], random_init=options["random_init"],
            seed=options["seed"], resize=options["resize"], crop=options["crop"],
            device=options["device"],
        )
    reports = []
    for name, data_split in splits.items():
        report = extract.extract_split(
            data_split, model, options["out"], split_name=name,
            batch_size=options["batch_size"], dtype=options["dtype"],
            rows_per_chunk=options["rows_per_chunk"], overwrite=overwrite, progress=progress,
            num_workers=options["num_workers"], amp=options["amp"],
            channels_last=options["channels_last"], compile=options["compile"],
            shard=shard, views=options["views"], augment=options["augment"],
            augment_seed=options["augment_seed"], create_only=only_create,
        )
        reports.append(report)
        if only_create:
            continue
        state = "complete" if report.complete else "INCOMPLETE"
        if shard is not None and not report.complete:
            state = "shard done; the split completes when every shard has run"
        _log(
            f"{options['out']}/{name}: {report.num_examples} x {report.feature_shape} "
            f"({options['dtype']}), {report.chunks_written}/{report.num_chunks} chunks written"
            f"{' (resumed)' if report.resumed else ''}"
            f"{f' by shard {shard[0]}/{shard[1]}' if shard else ''}, {state}",
            quiet=not progress,
        )
    return reports


def _ray_shard(options: dict, shard: tuple[int, int]) -> list:
    """One Ray task: extract one shard of every split (re-opening data and backbone there)."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return _extract_local(options, shard=shard, progress=False)


def run_extract_ray(options: dict, *, address: str | None = None, num_shards: int | None = None,
                    overwrite: bool = False, progress: bool = True) -> list:
    """Extract with one Ray task per shard (one per GPU when the cluster has GPUs).

    The driver creates the store's splits first (so shards never race to create them), then
    every task fills its chunk-aligned shard of each split in the same store, a shared
    filesystem path or fsspec URL that every node can reach. Finished chunks are never
    redone, so rerunning after a failure resumes.
    """
    import ray

    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 ignore_reinit_error=True)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    shards = num_shards or max(1, gpus or int(ray.cluster_resources().get("CPU", 1)))
    _log(f"ray: {shards} shards on {ray.cluster_resources()}", not progress)
    # 1. Create every split (and validate the job) once, on the driver.
    created = _extract_local(options, overwrite=overwrite, progress=False, only_create=True)
    # 2. One task per shard.
    task = ray.remote(num_gpus=1 if gpus else 0, num_cpus=1)(_ray_shard)
    results = ray.get([task.remote(options, (k, shards)) for k in range(shards)])
    # 3. Mark complete what is complete (the last shard usually already did); no need to load
    #    the data or the backbone again for that.
    reports = []
    for report in created:
        written = sum(r.chunks_written for shard in results for r in shard
                      if r.split == report.split)
        complete = extract.finalize_split(options["out"], report.split)
        reports.append(dataclasses.replace(report, chunks_written=written, complete=complete))
        _log(f"{options['out']}/{report.split}: {report.num_examples} x {report.feature_shape}, "
             f"{written}/{report.num_chunks} chunks written by {shards} Ray tasks, "
             f"{'complete' if complete else 'INCOMPLETE'}", not progress)
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
    normalization: str = "none",
    groups: int = 1,
    bias_init: float | None = None,
    sampling_probability: float = 1.0,
    physical_batch_size: int = 256,
    stream: bool | None = None,
    devices: int | None = None,
    out: str | None = None,
    csv: str | None = None,
    plot: str | None = None,
    diagnostics: str | None = None,
    quiet: bool = False,
) -> dict:
    """Sweep DP linear probes over epsilons x steps x learning rates x seeds on a store.

    Full batch by default: T steps of the Gaussian mechanism on the clipped gradient sum. With
    `sampling_probability` q < 1, masked DP-SGD with Poisson subsampling (Beltran et al.).
    Noise multipliers are calibrated to (epsilon, delta) for zero-out neighbours (N public), and
    each run's `epsilon_spent` is computed from its `DpEvent` by `accountant`. Noise keys and
    batch sampling always draw from OS entropy. `math.inf` in `epsilons` trains a non-private
    reference (no noise, no guarantee), labelled as such.

    Args:
      stream: stream the train split from disk chunk by chunk (None: when it would take more
        than a quarter of the machine's memory as float32).
      devices: shard rows over this many local devices (default 1).
      out, csv, plot: write results JSON, a per-run CSV, an accuracy-vs-epsilon PNG (DP
        outputs and public inputs only, see `pipelines.records`).
      diagnostics: write exact statistics of the private data (clipped fractions, sampled batch
        sizes, the data fingerprint) to this local file, for debugging; never share it.

    Returns:
      The results dict (also written to `out` as JSON when given).
    """
    preflight.check_probe_job(store, epsilons=epsilons, steps=steps, seeds=seeds, devices=devices,
                              learning_rates=learning_rates, out=out, csv=csv, plot=plot,
                              diagnostics=diagnostics)
    start = time.perf_counter()
    _check_sweep_args(epsilons, delta, seeds, steps, clip_norm, sampling_probability)

    # Open the store (both splits must be complete). A local store's attributes come straight
    # from its metadata files, so that this process need not import Zarr (see below).
    local = {split: extract.local_split_attrs(store, split) for split in ("train", "test")}
    if all(local.values()):
        train_attrs, test_attrs = local["train"], local["test"]
    else:  # or the error that says what is wrong
        train_attrs, test_attrs = (dict(extract.open_split(store, s).attrs)
                                   for s in ("train", "test"))
    if train_attrs["feature_shape"][-1] != test_attrs["feature_shape"][-1]:
        raise ValueError(f"train and test feature dims differ: {train_attrs['feature_shape']} "
                         f"vs {test_attrs['feature_shape']}")
    num_examples = int(train_attrs["num_examples"])
    dim = int(train_attrs["feature_shape"][-1])
    if stream is None:
        stream = _too_big_for_memory(num_examples * math.prod(train_attrs["feature_shape"]) * 4)
    if stream and sampling_probability < 1.0:
        raise ValueError("Poisson subsampling (q < 1) needs the train split in memory")
    if devices and devices > 1 and (stream or sampling_probability < 1.0):
        raise ValueError("--devices shards in-memory full-batch training; it does not combine "
                         "with --stream or -q < 1")
    # Read the splits while JAX is imported (`import probe` is the first JAX import, so
    # `dpprobe extract` never pays for it): in a forked child process where possible (it imports
    # Zarr and decodes on the other core), else in threads (Zarr decodes in its own threads).
    test_bytes = int(test_attrs["num_examples"]) * math.prod(test_attrs["feature_shape"]) * 4
    test_in_memory = not stream and not _too_big_for_memory(test_bytes)
    if all(local.values()) and test_in_memory and extract.can_prefetch_in_child():
        reader = extract.SplitPrefetch(store, {"train": train_attrs, "test": test_attrs})
        import probe

        (train_x, train_y), test_chunks = reader.result("train"), [reader.result("test")]
    else:
        with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="dpprobe-read") as pool:
            train_read = pool.submit(
                _stored_labels if stream else functools.partial(extract.load_split, dtype=None),
                store, "train",
            )
            test_read = pool.submit(lambda: list(extract.iter_split_chunks(
                store, "test", dtype=None))) if test_in_memory else None
            import probe

            if stream:
                train_y = train_read.result()
            else:
                train_x, train_y, _ = train_read.result()
            test_chunks = test_read.result() if test_read else None
    learning_rates = list(learning_rates or [probe.DEFAULT_LEARNING_RATES[optimizer]])
    num_classes = records.declared_num_classes(train_attrs, test_attrs)
    if delta >= 1.0 / num_examples:
        _log(f"warning: delta={delta:g} >= 1/N = {1 / num_examples:.3g}; "
             "a meaningful guarantee usually needs delta << 1/N", quiet)
    spec = probe.ProbeSpec(num_classes=num_classes, loss=loss, optimizer=optimizer,
                           bias_init=bias_init, normalization=normalization, groups=groups)

    # Calibrate the noise of each (epsilon, T).
    plans = {}
    for epsilon, num_steps in itertools.product(epsilons, steps):
        sigma = accounting.calibrate_noise_multiplier(
            epsilon, delta, steps=num_steps, sampling_probability=sampling_probability,
            accountant=accountant,
        )
        # epsilon = inf is the same recipe without noise (clipping kept): the reference
        # isolates what the noise costs, at the same learning rate.
        plans[epsilon, num_steps] = accounting.DpPlan(sigma, num_steps, sampling_probability,
                                                      clip_norm)

    # Train every config in one program.
    grid = list(itertools.product(epsilons, steps, learning_rates, range(seeds)))
    runs = [probe.RunSpec(plans[e, t], lr) for e, t, lr, _ in grid]
    keys = probe.make_keys(len(runs))
    progress = not quiet
    if sampling_probability < 1.0:
        driver = ("Poisson-sampled minibatches (masked DP-SGD, physical batch "
                  f"{physical_batch_size})")
        result = probe.train_probe_poisson(
            train_x, train_y, runs, keys, spec, physical_batch_size=physical_batch_size,
            progress=progress,
        )
    elif stream:
        driver = "full batch, streamed from disk"
        result = probe.train_probe_streaming(
            lambda: extract.iter_split_chunks(store, "train", dtype=None), runs, keys, spec,
            num_examples=num_examples, dim=dim, progress=progress,
        )
    else:
        mesh = probe.make_data_mesh(devices) if devices and devices > 1 else None
        driver = "full batch, in memory" + (f", rows sharded over {devices} devices"
                                            if mesh else "")
        # Not waited for: the evaluation below is traced while the training computes.
        result = probe.train_probe(train_x, train_y, runs, keys, spec, mesh=mesh,
                                   progress=progress, wait=False)

    # Evaluate on the test split.
    if test_chunks is None:  # streamed
        test_chunks = extract.iter_split_chunks(store, "test", dtype=None)
    metrics = probe.evaluate_chunks(
        result.params, test_chunks,
        normalization=spec.normalization, groups=spec.groups,
    )
    result.wait()

    # Record: DP outputs and public inputs only (pipelines.records).
    run_records = []
    for i, (epsilon, num_steps, lr, replicate) in enumerate(grid):
        plan = plans[epsilon, num_steps]
        record = {
            "epsilon": epsilon,
            "epsilon_spent": plan.epsilon(delta, accountant),
            "delta": delta,
            "noise_multiplier": plan.noise_multiplier,
            "clip_norm": plan.clip_norm,
            "steps": num_steps,
            "sampling_probability": plan.sampling_probability,
            "optimizer": optimizer,
            "learning_rate": lr,
            "replicate": replicate,
            "test_accuracy": float(metrics["top1"][i]),
            "test_top5_accuracy": float(metrics["top5"][i]),
            "per_class_accuracy": metrics["per_class"][i].tolist(),
            "accountant": accountant,
            "neighboring_relation": accounting.NEIGHBORING_RELATION,
            "guarantee": ("none: non-private reference" if not plan.is_private else
                          f"({plan.epsilon(delta, accountant):.4g}, {delta:g})-DP alone"),
            "dp_event": accounting.event_to_dict(plan.dp_event()),
        }
        run_records.append(record)
    # Every run touched the same training data: choosing among them, or reporting a summary of
    # several, spends their composition. The summary rows say what each aggregate costs.
    ledger = accounting.PrivacyLedger()
    for (epsilon, num_steps, lr, replicate), run in zip(grid, runs, strict=True):
        ledger.record(f"epsilon={epsilon:g} T={num_steps} lr={lr:g} replicate={replicate}",
                      run.plan, role="private" if run.plan.is_private else "non-private reference")
    summary = reporting.summarize_runs(
        run_records, ("epsilon", "steps", "learning_rate"),
        ("test_accuracy", "test_top5_accuracy"),
    )
    for row in summary:
        row["epsilon_row"] = _composed_epsilon(plans[row["epsilon"], row["steps"]],
                                               row["num_seeds"], delta, accountant)
    results = {
        "dpprobe_version": VERSION,
        "job": "probe",
        "created": records.now(),
        "wall_seconds": time.perf_counter() - start,
        "store": str(store),
        "provenance": {"train": records.public_split_attrs(train_attrs),
                       "test": records.public_split_attrs(test_attrs)},
        "probe": spec.to_dict() | {"driver": driver},
        "privacy": {
            "delta": delta,
            "accountant": accountant,
            "neighboring_relation": accounting.NEIGHBORING_RELATION,
            "neighboring_relation_text": accounting.NEIGHBORING_RELATION_TEXT,
            "dataset_size_public": True,
            "sampling": ("full batch (q = 1)" if sampling_probability == 1.0 else
                         f"Poisson, q = {sampling_probability:g}"),
            "non_private_reference": any(not p.is_private for p in plans.values()),
        } | records.randomness(None, ""),
        "num_train": num_examples,
        "num_test": int(test_attrs["num_examples"]),
        "runs": run_records,
        "summary": summary,
        "ledger": ledger.to_dict(delta, accountant) | {
            "note": "each run alone is (epsilon_spent, delta)-DP; a summary row over seeds costs "
                    "epsilon_row (its runs composed); selecting among the runs by their results "
                    "spends the composition of all of them (epsilon)"},
    }
    if diagnostics:
        _write_diagnostics(diagnostics, grid, result, train_attrs)
    if out:
        reporting.write_json(out, results)
    if csv:
        reporting.write_csv(csv, run_records, CSV_COLUMNS)
    if plot:
        reporting.plot_accuracy(summary, plot, title=_plot_title(results))
    results["wall_seconds"] = time.perf_counter() - start
    return results


CSV_COLUMNS = ("epsilon", "epsilon_spent", "delta", "noise_multiplier", "clip_norm", "steps",
               "sampling_probability", "optimizer", "learning_rate", "replicate",
               "test_accuracy", "test_top5_accuracy", "accountant", "neighboring_relation",
               "guarantee")


def _composed_epsilon(plan, count: int, delta: float, accountant: str) -> float:
    """Epsilon of `count` runs of `plan` on the same data, composed (what a mean over seeds
    costs)."""
    ledger = accounting.PrivacyLedger()
    for _ in range(count):
        ledger.record("run", plan)
    return ledger.epsilon(delta, accountant)


def _write_diagnostics(path, grid, result, train_attrs) -> None:
    """Exact statistics of the private data, for local debugging only (never published)."""
    batch_sizes = result.batch_sizes
    reporting.write_json(path, {
        "warning": records.DIAGNOSTICS_WARNING,
        "dpprobe_version": VERSION,
        "created": records.now(),
        "dataset_fingerprint": (train_attrs.get("dataset") or {}).get("fingerprint"),
        "runs": [{"epsilon": e, "steps": t, "learning_rate": lr, "replicate": k,
                  "clipped_fraction": float(result.clipped_fraction[i]),
                  **({"batch_sizes": batch_sizes[:t, i].tolist()} if batch_sizes is not None
                     else {})}
                 for i, (e, t, lr, k) in enumerate(grid)],
    })


def _plot_title(results: dict) -> str:
    backbone = results["provenance"]["train"].get("backbone", {}).get("name", "?")
    dataset = results["provenance"]["train"].get("dataset", {}).get("name", "?")
    return (f"{dataset} / {backbone}: {results['probe']['optimizer']}, "
            f"delta={results['privacy']['delta']:g} ({results['privacy']['accountant'].upper()}, "
            f"zero-out)\nx: epsilon per run; beside each point: its epsilon (seeds composed)"
            f"\nall private points together: epsilon "
            f"{reporting.format_epsilon(results['ledger']['epsilon_by_role'].get('private', 0.0))}")


def _too_big_for_memory(num_bytes: int) -> bool:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return False
    return num_bytes > total // 4


def _stored_labels(store, split) -> np.ndarray:
    return np.asarray(extract.open_split(store, split)["labels"][:], np.int32)


def _check_sweep_args(epsilons, delta, seeds, steps, clip_norm, sampling_probability) -> None:
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
    if not 0.0 < sampling_probability <= 1.0:
        raise ValueError(f"sampling_probability must be in (0, 1], got {sampling_probability}")


def probe_table(results: dict) -> str:
    """The printed table: epsilon per run and of the row (its seeds composed), noise
    multiplier, steps, lr, accuracy mean ± std; the non-private reference labelled as such."""
    rows = []
    for row in results["summary"]:
        private = math.isfinite(row["epsilon"])
        rows.append(
            row
            | {
                "epsilon": row["epsilon"] if private else "inf: non-private, no guarantee",
                "acc": reporting.pm(row["test_accuracy_mean"], row["test_accuracy_std"]),
                "top5": reporting.pm(row["test_top5_accuracy_mean"], row["test_top5_accuracy_std"]),
            }
        )
    columns = [
        ("epsilon per run", "epsilon"),
        ("eps spent", "epsilon_spent"),
        ("eps of row (seeds composed)", "epsilon_row"),
        ("noise mult", "noise_multiplier"),
        ("steps", "steps"),
        ("lr", "learning_rate"),
        ("seeds", "num_seeds"),
        ("test acc % (mean ± std)", "acc"),
        ("top-5 %", "top5"),
    ]
    if (results.get("probe") or {}).get("num_classes", 6) <= 5:
        columns.pop()  # top-5 of at most 5 classes is always 100%: not shown
    privacy = results["privacy"]
    header = (
        f"delta={privacy['delta']:g}, accountant={privacy['accountant'].upper()}, "
        f"{privacy['neighboring_relation_text']}, {privacy['sampling']}; "
        f"N_train={results['num_train']}, N_test={results['num_test']}"
    )
    ledger = results["ledger"]
    private = sum(1 for e in ledger["entries"] if e["role"] == "private")
    footer = (f"all {private} private runs together (e.g. picking the best): epsilon = "
              f"{reporting.format_epsilon(ledger['epsilon_by_role'].get('private', 0.0))} at "
              f"delta={privacy['delta']:g}")
    if private < ledger["num_mechanisms"]:
        footer += "; the non-private reference has no guarantee"
    return header + "\n" + reporting.format_table(rows, columns) + "\n" + footer


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
    accounting.calibration.check_tractable(noise_multiplier, sampling_probability, accountant)
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
    preflight.check_demo_job(out_dir, seeds=seeds)
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


# ----------------------------------------------------------------------------------------------
# tune
# ----------------------------------------------------------------------------------------------


def run_tune(store: str, *, epsilon: float, delta: float, out: str | None = None,
             model: str | None = None, **kwargs) -> dict:
    """`linear_scaling_search` on a store; writes results JSON (and the model as npz)."""
    preflight.check_tune_job(store, out=out, model=model)
    from pipelines.search import linear_scaling_search

    results = linear_scaling_search(store, epsilon, delta, **kwargs)
    params = results.pop("params")
    if model:
        path = Path(model)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp.npz")
        np.savez(tmp, w=params["w"][0], b=params["b"][0])
        os.replace(tmp, path)
        results["model_file"] = str(path)
    if out:
        reporting.write_json(out, results)
    results["params"] = params
    return results


def tune_report(results: dict) -> str:
    """Trials, the fitted line, the final run and the ledger, for the terminal."""
    lines = []
    for stage in results["stages"]:
        lines.append(f"stage {stage['stage']}: epsilon {stage['epsilon_stage']:.4g} for the "
                     f"stage ({stage['epsilon_per_trial']:.4g} per trial), best r = "
                     f"{stage['best_r']:.4g}")
        rows = [t | {"score": f"{100 * t['score']:.2f}"} for t in stage["trials"]]
        lines.append(reporting.format_table(rows, [
            ("r", "r"), ("lr", "learning_rate"), ("steps", "steps"),
            ("noise mult", "noise_multiplier"), ("score % (DP)", "score")]))
    line, chosen, final = results["line"], results["chosen"], results["final"]
    lines.append(f"linear scaling: r = {line['alpha']:.4g} * epsilon + {line['b']:.4g} -> r* = "
                 f"{line['r_star']:.4g} at the final run's epsilon "
                 f"{results['privacy']['epsilon_final_alone']:.4g}"
                 + (" (fit not positive: kept stage 1's best r)" if line["fallback_used"] else ""))
    lines.append(f"final run: lr = {chosen['learning_rate']:.4g}, T = {chosen['steps']}, "
                 f"noise multiplier = {chosen['noise_multiplier']:.4g} -> test accuracy "
                 f"{100 * final['test_accuracy']:.2f}%"
                 + (f" (top-5 {100 * final['test_top5_accuracy']:.2f}%)"
                    if results["probe"]["num_classes"] > 5 else ""))
    privacy = results["privacy"]
    lines.append(f"selection: {results['selection']['scoring']}")
    lines.append(f"total epsilon (tuning and selection included) = "
                 f"{privacy['epsilon_total']:.4f} <= requested {privacy['epsilon_requested']:g}, "
                 f"delta = {privacy['delta']:g}, {privacy['neighboring_relation_text']}; covers "
                 f"{privacy['covers']}")
    ledger = results["ledger"]
    lines.append(f"privacy ledger: {ledger['num_mechanisms']} mechanisms, PLD composition "
                 f"epsilon = {ledger['epsilon']:.4f}; Gaussian DP mu = {ledger['gdp_mu']:.4g} "
                 f"(epsilon {ledger['gdp_epsilon']:.4f}); basic composition epsilon = "
                 f"{ledger['basic_composition_epsilon']:.4f}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# verify, info
# ----------------------------------------------------------------------------------------------


def verify(store: str, *, data: str | None = None, data_dir: str | None = None,
           progress: bool = True) -> extract.VerifyReport:
    """`extract.verify_store`, optionally re-fingerprinting the source data.

    A source with its own splits (fashion-mnist, digits, cifar) is compared split by split. A
    single-split source (npz, imagefolder) is compared with the split it was extracted into:
    the one that recorded this data spec, else the one whose fingerprint it matches.
    """
    fingerprints = None
    extra_problems = []
    if data:
        summary = extract.store_summary(store)
        recorded = summary["splits"]
        precomputed = any((a.get("backbone") or {}).get("name") == "none"
                          for a in recorded.values())
        kind, _ = extract.parse_data_spec(data)
        single = kind in ("npz", "imagefolder")
        num_classes = next((len(a["class_names"]) for a in recorded.values()
                            if a.get("class_names") and kind == "npz"), None)
        splits = extract.open_source(data, data_dir=data_dir, split=None,
                                     precomputed=precomputed, num_classes=num_classes)
        if single:
            (one,) = splits.values()
            spec_match = [n for n, a in recorded.items() if (a.get("dataset") or {}).get("spec")
                          == data]
            print_match = [n for n, a in recorded.items()
                           if (a.get("dataset") or {}).get("fingerprint") == one.fingerprint]
            target = (print_match or spec_match or [None])[0]
            if target is None:
                extra_problems.append(f"--data {data} matches no split of the store (its "
                                      f"fingerprint {one.fingerprint} is recorded by none of "
                                      f"{sorted(recorded)})")
                fingerprints = {}
            else:
                fingerprints = {target: one.fingerprint}
        else:
            fingerprints = {name: one.fingerprint for name, one in splits.items()}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(unit="chunk", desc="verify", file=sys.stderr, dynamic_ncols=True,
                   leave=False)

    def tick(split, chunk, total):
        if bar is not None:
            bar.set_description(f"verify {split}")
            bar.update(1)

    try:
        report = extract.verify_store(store, fingerprints=fingerprints, progress=tick)
    finally:
        if bar is not None:
            bar.close()
    report.problems.extend(extra_problems)
    return report


def store_info(store: str) -> str:
    """The provenance of a store, for people."""
    summary = extract.store_summary(store)
    lines = [f"{store}: {summary['root'].get('format')} v{summary['root'].get('format_version')}"]
    for name, attrs in summary["splits"].items():
        backbone, dataset = attrs.get("backbone", {}), attrs.get("dataset", {})
        pre = attrs.get("preprocessing", {})
        lines += [
            f"[{name}] {attrs.get('num_examples')} examples x {attrs.get('feature_shape')} "
            f"{attrs.get('dtype')}, {attrs['chunks_done']}/{attrs['num_chunks']} chunks of "
            f"{attrs.get('rows_per_chunk')} rows, complete={attrs.get('complete')}",
            f"  backbone: {backbone.get('name')} (weights: {backbone.get('weights_source')}"
            + (f", seed {backbone['seed']}" if backbone.get("seed") is not None else "")
            + (f", file {backbone['weights_file']}" if backbone.get("weights_file") else "")
            + (f", sha256 {backbone['weights_sha256']}" if backbone.get("weights_sha256")
               else "")
            + (f", tag {backbone['tag']}" if backbone.get("tag") else "") + ")"
            + "".join(f", {k} {backbone[k]}" for k in ("timm_version", "kymatio_version",
                                                      "torch_version") if backbone.get(k)),
            "  preprocessing: " + ", ".join(f"{k}={v}" for k, v in pre.items()
                                              if k != "transform" and v not in (None, [], ())),
            f"  dataset: {dataset.get('name')} ({dataset.get('spec')}), "
            f"{dataset.get('num_classes')} classes, fingerprint {dataset.get('fingerprint')}",
            "  classes: " + ", ".join(str(c) for c in (attrs.get("class_names")
                                                        or dataset.get("class_names") or [])),
            f"  created {attrs.get('created')}, completed {attrs.get('completed', '-')}",
        ]
    return "\n".join(lines)
