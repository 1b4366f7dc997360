"""The probe job's records: one run's (DP outputs and public inputs only), the mean +- std rows
over seeds with what each costs composed, and the owner's diagnostics file (exact statistics
of the private data, never published)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from dpprobe import accounting, files
from dpprobe.accounting import records

__all__ = ["composed_epsilon", "run_record", "summarize_runs", "write_diagnostics"]


def run_record(config, optimizer: str, epsilon: float, plan, lr: float,
                replicate: int, metrics, i: int) -> dict:
    """One run's results: DP outputs and public inputs only.

    Args:
      config: the job's `ProbeConfig` (delta, accountant).
      optimizer: the optimizer the runs used.
      epsilon: the run's target epsilon.
      plan: its `DpPlan`.
      lr: its learning rate.
      replicate: its seed's index.
      metrics: the test metrics of every run (`probe.evaluate_chunks`).
      i: the run's index.

    Returns:
      The run's record (a CSV row of the job, an entry of its results' "runs").
    """
    delta, accountant = config.delta, config.accountant
    return {
        "epsilon": epsilon,
        "epsilon_spent": plan.epsilon(delta, accountant),
        "delta": delta,
        "noise_multiplier": plan.noise_multiplier,
        "clip_norm": plan.clip_norm,
        "steps": plan.steps,
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


def composed_epsilon(plan, count: int, delta: float, accountant: str) -> float:
    """Epsilon of `count` runs of `plan` on the same data, composed (what a mean over seeds
    costs).

    Args:
      plan: the runs' `DpPlan`.
      count: how many runs.
      delta: the target delta.
      accountant: the accountant.

    Returns:
      Their composed epsilon.
    """
    ledger = accounting.PrivacyLedger()
    for _ in range(count):
        ledger.record("run", plan)
    return ledger.epsilon(delta, accountant)


def write_diagnostics(path, grid, result, train_attrs) -> None:
    """Write exact statistics of the private data, for local debugging only (never published).

    Args:
      path: the file.
      grid: the (epsilon, T, lr, replicate) of every run.
      result: the `TrainResult` (clipped fractions, batch sizes).
      train_attrs: the train split's attributes (its fingerprint).
    """
    batch_sizes = result.batch_sizes
    files.write_json(path, {
        "warning": records.DIAGNOSTICS_WARNING,
        "dpprobe_version": records.VERSION,
        "created": records.now(),
        "dataset_fingerprint": (train_attrs.get("dataset") or {}).get("fingerprint"),
        "runs": [{"epsilon": e, "steps": t, "learning_rate": lr, "replicate": k,
                  "clipped_fraction": float(result.clipped_fraction[i]),
                  **({"batch_sizes": batch_sizes[:t, i].tolist()} if batch_sizes is not None
                     else {})}
                 for i, (e, t, lr, k) in enumerate(grid)],
    })


def summarize_runs(runs: Sequence[dict], group_keys: Sequence[str], metrics: Sequence[str]):
    """Mean and std (over seeds) of `metrics` for runs grouped by `group_keys`, in order.

    Args:
      runs: the run records.
      group_keys: the keys a row groups by (epsilon, steps, learning rate).
      metrics: the metrics averaged.

    Returns:
      One row per group: its keys, `num_seeds`, each metric's `_mean` and `_std`.
    """
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for run in runs:
        groups[tuple(run[k] for k in group_keys)].append(run)
    summary = []
    for key, members in groups.items():
        row = dict(zip(group_keys, key, strict=True)) | {"num_seeds": len(members)}
        for metric in metrics:
            values = np.array([m[metric] for m in members if m.get(metric) is not None], float)
            row[f"{metric}_mean"] = float(values.mean()) if values.size else None
            row[f"{metric}_std"] = float(values.std(ddof=1)) if values.size > 1 else 0.0
        for shared in ("noise_multiplier", "epsilon_spent"):
            if shared in members[0]:
                row[shared] = members[0][shared]
        summary.append(row)
    return summary
