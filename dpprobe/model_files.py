"""The model files the jobs write (`dpmodel.format`): what each job puts in the description
besides the arrays, built from public inputs and DP outputs only (`accounting.records`).

  * `probe --save-model DIR`: one file per epsilon of the sweep (its first seed's run; with
    several --steps or --lr, per (epsilon, T, lr)), the run's own claim, and the sweep's;
  * `tune --save-model FILE`: the final probe with its standardization, the job's ledger;
  * `finetune --out DIR`: DIR/model.safetensors, the EMA parameters when EMA is on.
"""

from __future__ import annotations

import math
import os

from dpprobe import accounting, extract, probe
from dpprobe import model as dpmodel
from dpprobe.accounting import records
from dpprobe.files import atomic_write_bytes

__all__ = ["MODEL_FILE", "finetune_model", "header", "probe_model_name", "probe_model_parts",
           "probe_models", "store_record", "tune_model", "write_model"]

# The model file in a finetune --out folder.
MODEL_FILE = "model.safetensors"


def write_model(path, arrays: dict, document: dict) -> None:
    """Write a model file atomically."""
    atomic_write_bytes(path, dpmodel.encode_model(arrays, document))


def header(job: str, class_names, num_classes: int | None = None, **extra) -> dict:
    """What every model file's description begins with (no time of the run: it depends on the
    private records, `dpprobe.timings`). A store that declares only its class count (no
    names) gets the classes' indices as names."""
    if class_names is None:
        class_names = range(num_classes)
    return {"dpprobe_version": records.VERSION, "job": job,
            "class_names": [str(c) for c in class_names]} | extra


def store_record(store, train_attrs: dict) -> dict:
    """The store's public description: its identity (backbone, weights identity,
    preprocessing, feature dim, class list: what predict checks a store against, and what
    rebuilds the backbone for images) and its train split's public attributes (no fingerprint)."""
    return extract.store.store_identity(train_attrs) | {
        "store": str(store), "train_split": records.public_split_attrs(train_attrs)}


def _claim(epsilon: float, delta: float, accountant: str, ledger: dict, covers: str,
           **extra) -> dict:
    return {"epsilon": epsilon, "delta": delta, "accountant": accountant,
            "neighboring_relation": accounting.NEIGHBORING_RELATION,
            "neighboring_relation_text": accounting.NEIGHBORING_RELATION_TEXT,
            "dataset_size_public": True, "covers": covers, "ledger": ledger} | extra


def probe_model_name(config, epsilon: float, steps: int | None,
                     learning_rate: float | None) -> str:
    """`eps1.safetensors`; `eps1_T10_lr0.5.safetensors` when the config asks for several steps
    or learning rates. A function of the config alone (not of the recipe it leads to, whose
    learning rate varies with epsilon), so that the job's preflight names the same files."""
    name = f"eps{epsilon:g}"
    name += f"_T{steps}" if len(config.steps or ()) > 1 else ""
    name += f"_lr{learning_rate:g}" if len(config.learning_rates or ()) > 1 else ""
    return name + ".safetensors"


def probe_models(directory, parts) -> list[str]:
    """Write a probe sweep's models (`probe_model_parts`) into `directory`. Returns the paths
    written."""
    written = []
    for name, arrays, document in parts:
        path = os.path.join(directory, name)
        write_model(path, arrays, document)
        written.append(path)
    return written


def probe_model_parts(config, results: dict, grid, plans, params, spec,
                      train_attrs) -> list[tuple[str, dict, dict]]:
    """(file name, arrays, document) of each model of a probe sweep, one per epsilon (x steps
    x lr), its first seed's run. The non-private reference (epsilon inf) has none: it has no
    guarantee."""
    parts = []
    for index, (epsilon, steps, lr, replicate) in enumerate(grid):
        if replicate != 0 or not math.isfinite(epsilon):
            continue
        plan, run = plans[epsilon, steps], results["runs"][index]
        ledger = accounting.PrivacyLedger()
        ledger.record(f"epsilon={epsilon:g} T={steps} lr={lr:g} replicate=0", plan,
                      role="final")
        document = header("probe", train_attrs.get("class_names"), spec.num_classes)
        document |= dpmodel.linear_document(
            dim=int(train_attrs["feature_shape"][-1]), num_classes=spec.num_classes,
            loss=spec.loss, normalization=spec.normalization, groups=spec.groups,
            feature_dtype=train_attrs["dtype"]) | {
            "parameters": {"released": "final iterate", "run": index},
            "backbone": store_record(config.store, train_attrs),
            "privacy": _claim(
                run["epsilon_spent"], config.delta, config.accountant,
                ledger.to_dict(config.delta, config.accountant),
                "every record of the store's train split",
                sweep_epsilon=results["ledger"]["epsilon_by_role"]["private"],
                note="this run alone; the runs of the sweep together (releasing several of its "
                     "models, or choosing among them by their results) cost sweep_epsilon"),
            "training": {"recipe": spec.to_dict(), "learning_rate": lr, "steps": steps,
                         "noise_multiplier": plan.noise_multiplier,
                         "clip_norm": plan.clip_norm,
                         "sampling_probability": plan.sampling_probability,
                         "num_train": results["num_train"],
                         "reported": {"split": "test", "test_accuracy": run["test_accuracy"],
                                      "test_top5_accuracy": run["test_top5_accuracy"]}},
        }
        parts.append((probe_model_name(config, epsilon, steps, lr),
                      dpmodel.linear_arrays(params["w"][index], params["b"][index]), document))
    return parts


def tune_model(config, results: dict, params, standardizer) -> None:
    """Write the tune job's final probe to `config.save_model`: the head (standardization
    folded in), the standardization's statistics, and the job's whole ledger as its claim. Its
    test accuracy was computed by `probe.evaluate`, the function the model predicts with."""
    train_attrs = extract.local_split_attrs(config.store, "train") or dict(
        extract.open_split(config.store, "train").attrs)
    spec = probe.ProbeSpec(**{k: v for k, v in results["probe"].items() if k != "bias_init"})
    standardization = None
    if standardizer is not None:
        standardization = results["standardization"] | {"plan": next(
            e for e in results["ledger"]["entries"] if e["role"] == "standardization")}
    privacy = results["privacy"]
    document = header("tune", train_attrs.get("class_names"), spec.num_classes)
    document |= dpmodel.linear_document(
        dim=int(train_attrs["feature_shape"][-1]), num_classes=spec.num_classes, loss=spec.loss,
        normalization=spec.normalization, groups=spec.groups,
        feature_dtype=train_attrs["dtype"], standardization=standardization) | {
        "parameters": {"released": "final iterate of the selected recipe"},
        "backbone": store_record(config.store, train_attrs),
        "privacy": _claim(privacy["epsilon_total"], privacy["delta"], "pld", results["ledger"],
                          privacy["covers"]),
        "training": {"recipe": spec.to_dict(), "chosen": results["chosen"],
                     "line": results["line"], "num_train": results["selection"]["num_trained"],
                     "reported": {"split": "test",
                                  "test_accuracy": results["final"]["test_accuracy"],
                                  "test_top5_accuracy": results["final"]["test_top5_accuracy"]}},
    }
    write_model(config.save_model,
                dpmodel.linear_arrays(params["w"][0], params["b"][0], standardizer), document)


def finetune_model(path, results: dict, model, *, released: str, name: str, image_size: int,
                   channels: int, resize, crop, rgb: bool, mean, std,
                   timm_architecture: str | None, trained: dict | None = None) -> None:
    """Write a fine-tuned network: `released` ("EMA" or "final iterate") parameters (LoRA
    adapters already merged, `finetune.modes.merge_lora`); `trained`: which parameters the
    run trained (the job's `"trained"` record). A --non-private run's file says it is NOT
    private in its claim."""
    privacy = results["privacy"]
    covers = ("NOTHING: NOT private. " + privacy["claim"] if not privacy.get("private", True)
              and "claim" in privacy else "every record of the training data")
    data = results["data"]
    accuracy = results["test_accuracy_ema" if released == "EMA" else "test_accuracy"]
    document = header("finetune", data["class_names"]) | dpmodel.network_document(
        model, name=name, num_classes=data["num_classes"], image_size=image_size,
        channels=channels, resize=resize, crop=crop, rgb=rgb, mean=mean, std=std,
        timm_architecture=timm_architecture) | {
        "parameters": {"released": released,
                       "note": "the EMA of the iterates (De et al.), post-processing of the "
                               "same noisy steps" if released == "EMA" else
                               "the last iterate (no EMA)"},
        "backbone": {"model": results["model"]},
        "privacy": _claim(privacy["epsilon"], privacy["delta"], privacy["accountant"],
                          results["ledger"], covers, plan=privacy["plan"],
                          private=privacy.get("private", True)),
        "training": {"recipe": results["recipe"], "trained": trained, "data": {
                         k: data[k] for k in ("spec", "num_train", "num_test")},
                     "reported": {"split": "test", "test_accuracy": accuracy}},
    }
    write_model(path, dpmodel.network_arrays(model), document)
