"""dpprobe's DP linear probe in JAX, on the DP mechanism of `dp` (noise, sampling, the
clipper interface, the privatizer, auditing).

  * `probe.clipping`: closed-form per-example clipping of linear models (`linear_clipper`,
    the one-layer case of `dp.norms`);
  * `probe.step`: the DP step the trainers share; `probe.train` (in memory, sharded with
    `probe.sharding`), `probe.streaming` (within a memory budget: `probe.budget`),
    `probe.poisson`: the trainers;
  * `probe.normalization`: per-example feature normalization (free);
    `probe.standardization`: private per-feature standardization (two Gaussian releases);
  * `probe.specs`: `ProbeSpec`, `RunSpec` (privacy: the `DpPlan`), `PerformanceFlags` (speed
    knobs that never change epsilon), `TrainResult`;
  * `probe.evaluation`, `probe.selection`: accuracy, noisy counts for private selection;
  * `probe.cost`: a full-batch sweep's estimated time from public shapes and the device (the
    recipe's default step count);
  * `probe.estimator`: `DPLinearProbe`, one probe run as a scikit-learn estimator on arrays;
  * `probe.canaries`: the audit's canary, trained with the production trainer (its bounds:
    `dp.auditing`).


Every name is imported on first use (PEP 562), so that `import dpprobe.probe` loads no JAX:
the command line imports this package to build its options.

Called, the package runs its job: `dpprobe.probe(...)` is `dpprobe.jobs.probe` (installed by
`dpprobe/__init__.py`; this package never imports the job, which imports `pipelines`).
"""

from dpprobe._lazy import lazy_names

_LAZY = {
    "DEFAULT_MEMORY_BUDGET": "dpprobe.probe.budget",
    "StreamPlan": "dpprobe.probe.budget",
    "plan_stream": "dpprobe.probe.budget",
    "CANARY_LABEL": "dpprobe.probe.canaries",
    "CANARY_NORM": "dpprobe.probe.canaries",
    "add_canary": "dpprobe.probe.canaries",
    "StepCost": "dpprobe.probe.cost",
    "step_cost": "dpprobe.probe.cost",
    "audit_learning_rate": "dpprobe.probe.canaries",
    "canary_direction": "dpprobe.probe.canaries",
    "canary_scores": "dpprobe.probe.canaries",
    "claimed_canary_scores": "dpprobe.probe.canaries",
    "train_canary_runs": "dpprobe.probe.canaries",
    "LOSSES": "dpprobe.probe.clipping",
    "clipped_grad_sum": "dpprobe.probe.clipping",
    "example_losses": "dpprobe.probe.clipping",
    "feature_gram": "dpprobe.probe.clipping",
    "linear_clipper": "dpprobe.probe.clipping",
    "linear_logits": "dpprobe.probe.clipping",
    "per_example_grad_norms": "dpprobe.probe.clipping",
    "residuals": "dpprobe.probe.clipping",
    "DPLinearProbe": "dpprobe.probe.estimator",
    "EVAL_BLOCK_ROWS": "dpprobe.probe.evaluation",
    "block_logits": "dpprobe.probe.evaluation",
    "evaluate": "dpprobe.probe.evaluation",
    "evaluate_chunks": "dpprobe.probe.evaluation",
    "fixed_blocks": "dpprobe.probe.evaluation",
    "NORMALIZATIONS": "dpprobe.probe.normalization",
    "normalize_features": "dpprobe.probe.normalization",
    "normalized_norm_bound": "dpprobe.probe.normalization",
    "train_probe_poisson": "dpprobe.probe.poisson",
    "correct_counts": "dpprobe.probe.selection",
    "noisy_correct_counts": "dpprobe.probe.selection",
    "make_data_mesh": "dpprobe.probe.sharding",
    "shard_rows": "dpprobe.probe.sharding",
    "FEATURE_DTYPES": "dpprobe.probe.specs",
    "Params": "dpprobe.probe.specs",
    "PerformanceFlags": "dpprobe.probe.specs",
    "ProbeSpec": "dpprobe.probe.specs",
    "RunSpec": "dpprobe.probe.specs",
    "TrainResult": "dpprobe.probe.specs",
    "Standardizer": "dpprobe.probe.standardization",
    "private_standardizer": "dpprobe.probe.standardization",
    "init_params": "dpprobe.probe.step",
    "train_probe_streaming": "dpprobe.probe.streaming",
    "prepare_features": "dpprobe.probe.train",
    "prepare_inputs": "dpprobe.probe.train",
    "train_probe": "dpprobe.probe.train",
}


__getattr__, __dir__ = lazy_names(__name__, _LAZY)


__all__ = [
    "CANARY_LABEL",
    "CANARY_NORM",
    "DEFAULT_MEMORY_BUDGET",
    "DPLinearProbe",
    "EVAL_BLOCK_ROWS",
    "FEATURE_DTYPES",
    "LOSSES",
    "NORMALIZATIONS",
    "Params",
    "PerformanceFlags",
    "ProbeSpec",
    "RunSpec",
    "Standardizer",
    "StepCost",
    "StreamPlan",
    "TrainResult",
    "add_canary",
    "audit_learning_rate",
    "block_logits",
    "canary_direction",
    "canary_scores",
    "claimed_canary_scores",
    "clipped_grad_sum",
    "correct_counts",
    "evaluate",
    "evaluate_chunks",
    "example_losses",
    "feature_gram",
    "fixed_blocks",
    "init_params",
    "linear_clipper",
    "linear_logits",
    "make_data_mesh",
    "noisy_correct_counts",
    "normalize_features",
    "normalized_norm_bound",
    "per_example_grad_norms",
    "plan_stream",
    "prepare_features",
    "prepare_inputs",
    "private_standardizer",
    "residuals",
    "shard_rows",
    "step_cost",
    "train_canary_runs",
    "train_probe",
    "train_probe_poisson",
    "train_probe_streaming",
]
