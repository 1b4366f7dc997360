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


Every name is imported on first use and `dpprobe.probe(...)` runs its job (`dpprobe._lazy`).
"""

from dpprobe._lazy import lazy_names

__getattr__, __dir__ = lazy_names(__name__, {
    "budget": ("DEFAULT_MEMORY_BUDGET", "StreamPlan", "plan_stream"),
    "canaries": (
        "CANARY_LABEL", "CANARY_NORM", "add_canary", "audit_learning_rate", "canary_direction",
        "canary_scores", "claimed_canary_scores", "train_canary_runs",
    ),
    "clipping": (
        "LOSSES", "clipped_grad_sum", "example_losses", "feature_gram", "linear_clipper",
        "linear_logits", "per_example_grad_norms", "residuals",
    ),
    "cost": ("StepCost", "step_cost"),
    "estimator": ("DPLinearProbe",),
    "evaluation": (
        "EVAL_BLOCK_ROWS", "block_logits", "evaluate", "evaluate_chunks", "fixed_blocks",
    ),
    "normalization": ("NORMALIZATIONS", "normalize_features", "normalized_norm_bound"),
    "poisson": ("train_probe_poisson",),
    "selection": ("correct_counts", "noisy_correct_counts"),
    "sharding": ("make_data_mesh", "shard_rows"),
    "specs": (
        "FEATURE_DTYPES", "Params", "PerformanceFlags", "ProbeSpec", "RunSpec", "TrainResult",
    ),
    "standardization": ("Standardizer", "private_standardizer"),
    "step": ("init_params",),
    "streaming": ("train_probe_streaming",),
    "train": ("prepare_features", "prepare_inputs", "train_probe"),
})


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
