"""dpprobe's DP linear probe in JAX, on one DP mechanism that every trainer shares.

  * `probe.mechanism`: secret keys, the Gaussian noise, `gaussian_privatizer` (an optax
    transformation for any pytree of clipped sums) and `privatized_optimizer`;
  * `probe.batching`: Poisson batch selection (jax_privacy) and the pad-and-mask helper;
  * `probe.clipping`: closed-form per-example clipping of linear models;
  * `probe.step`: the DP step the trainers share; `probe.train` (in memory, sharded with
    `probe.sharding`), `probe.streaming`, `probe.poisson`: the trainers;
  * `probe.standardization`: private per-feature standardization (two Gaussian releases);
  * `probe.specs`: `ProbeSpec`, `RunSpec` (privacy: the `DpPlan`), `PerformanceFlags` (speed
    knobs that never change epsilon), `TrainResult`;
  * `probe.canaries`: the audit's canary, trained with the production trainer;
    `probe.auditing`: lower bounds on epsilon from canary scores (jax_privacy's auditor).
"""

from probe.auditing import (
    AuditBounds,
    audit_bounds,
    choose_thresholds,
    gdp_mu_bounds,
    one_run_epsilon_bound,
    tradeoff_curve,
)
from probe.batching import pad_rows, poisson_batches
from probe.canaries import (
    CANARY_LABEL,
    CANARY_NORM,
    add_canary,
    audit_learning_rate,
    canary_direction,
    canary_scores,
    claimed_canary_scores,
    train_canary_runs,
)
from probe.clipping import (
    LOSSES,
    clipped_grad_sum,
    example_losses,
    feature_gram,
    linear_logits,
    per_example_grad_norms,
    residuals,
    zero_nonfinite_rows,
)
from probe.evaluation import EVAL_BLOCK_ROWS, block_logits, evaluate, evaluate_chunks, fixed_blocks
from probe.mechanism import (
    add_noise,
    gaussian_noise,
    gaussian_privatizer,
    make_keys,
    noise_stddev,
    privatized_optimizer,
)
from probe.normalization import NORMALIZATIONS, normalize_features, normalized_norm_bound
from probe.optimizers import DEFAULT_LEARNING_RATES, OPTIMIZERS, make_optimizer
from probe.poisson import train_probe_poisson
from probe.selection import correct_counts, noisy_correct_counts
from probe.sharding import make_data_mesh, shard_rows
from probe.specs import FEATURE_DTYPES, Params, PerformanceFlags, ProbeSpec, RunSpec, TrainResult
from probe.standardization import Standardizer, private_standardizer
from probe.step import init_params
from probe.streaming import train_probe_streaming
from probe.train import prepare_features, prepare_inputs, train_probe

__all__ = [
    "CANARY_LABEL",
    "CANARY_NORM",
    "DEFAULT_LEARNING_RATES",
    "EVAL_BLOCK_ROWS",
    "FEATURE_DTYPES",
    "AuditBounds",
    "LOSSES",
    "NORMALIZATIONS",
    "OPTIMIZERS",
    "Params",
    "PerformanceFlags",
    "ProbeSpec",
    "RunSpec",
    "Standardizer",
    "TrainResult",
    "add_canary",
    "add_noise",
    "audit_bounds",
    "audit_learning_rate",
    "block_logits",
    "canary_direction",
    "canary_scores",
    "choose_thresholds",
    "claimed_canary_scores",
    "clipped_grad_sum",
    "correct_counts",
    "evaluate",
    "evaluate_chunks",
    "example_losses",
    "feature_gram",
    "fixed_blocks",
    "gaussian_noise",
    "gdp_mu_bounds",
    "gaussian_privatizer",
    "init_params",
    "linear_logits",
    "make_data_mesh",
    "make_keys",
    "make_optimizer",
    "noisy_correct_counts",
    "noise_stddev",
    "normalize_features",
    "normalized_norm_bound",
    "one_run_epsilon_bound",
    "pad_rows",
    "per_example_grad_norms",
    "poisson_batches",
    "prepare_features",
    "prepare_inputs",
    "private_standardizer",
    "privatized_optimizer",
    "residuals",
    "shard_rows",
    "tradeoff_curve",
    "train_canary_runs",
    "train_probe",
    "train_probe_poisson",
    "train_probe_streaming",
    "zero_nonfinite_rows",
]
