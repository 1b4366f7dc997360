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
  * `probe.canaries`: the audit's canary, trained with the production trainer (its bounds:
    `dp.auditing`).
"""

from dpprobe.probe.budget import DEFAULT_MEMORY_BUDGET, StreamPlan, plan_stream
from dpprobe.probe.canaries import (
    CANARY_LABEL,
    CANARY_NORM,
    add_canary,
    audit_learning_rate,
    canary_direction,
    canary_scores,
    claimed_canary_scores,
    train_canary_runs,
)
from dpprobe.probe.clipping import (
    LOSSES,
    clipped_grad_sum,
    example_losses,
    feature_gram,
    linear_clipper,
    linear_logits,
    per_example_grad_norms,
    residuals,
)
from dpprobe.probe.evaluation import (
    EVAL_BLOCK_ROWS,
    block_logits,
    evaluate,
    evaluate_chunks,
    fixed_blocks,
)
from dpprobe.probe.normalization import NORMALIZATIONS, normalize_features, normalized_norm_bound
from dpprobe.probe.poisson import train_probe_poisson
from dpprobe.probe.selection import correct_counts, noisy_correct_counts
from dpprobe.probe.sharding import make_data_mesh, shard_rows
from dpprobe.probe.specs import (
    FEATURE_DTYPES,
    Params,
    PerformanceFlags,
    ProbeSpec,
    RunSpec,
    TrainResult,
)
from dpprobe.probe.standardization import Standardizer, private_standardizer
from dpprobe.probe.step import init_params
from dpprobe.probe.streaming import train_probe_streaming
from dpprobe.probe.train import prepare_features, prepare_inputs, train_probe

__all__ = [
    "CANARY_LABEL",
    "CANARY_NORM",
    "DEFAULT_MEMORY_BUDGET",
    "EVAL_BLOCK_ROWS",
    "FEATURE_DTYPES",
    "LOSSES",
    "NORMALIZATIONS",
    "Params",
    "PerformanceFlags",
    "ProbeSpec",
    "RunSpec",
    "Standardizer",
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
    "train_canary_runs",
    "train_probe",
    "train_probe_poisson",
    "train_probe_streaming",
]
