"""dpprobe's DP linear probe in JAX: closed-form per-example clipping, Gaussian noise on the
clipped sum, optax optimizers as post-processing, many configs in one compiled program."""

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
from probe.evaluation import evaluate, evaluate_chunks
from probe.mechanism import gaussian_noise, make_keys
from probe.normalization import NORMALIZATIONS, normalize_features
from probe.optimizers import DEFAULT_LEARNING_RATES, OPTIMIZERS, make_optimizer
from probe.selection import correct_counts, noisy_correct_counts
from probe.train import (
    ProbeSpec,
    RunSpec,
    TrainResult,
    apply_update,
    init_params,
    make_data_mesh,
    noisy_mean,
    prefetch,
    prepare_features,
    shard_rows,
    train_probe,
    train_probe_poisson,
    train_probe_streaming,
)

__all__ = [
    "DEFAULT_LEARNING_RATES",
    "LOSSES",
    "NORMALIZATIONS",
    "OPTIMIZERS",
    "ProbeSpec",
    "RunSpec",
    "TrainResult",
    "apply_update",
    "clipped_grad_sum",
    "correct_counts",
    "evaluate",
    "evaluate_chunks",
    "example_losses",
    "feature_gram",
    "gaussian_noise",
    "init_params",
    "linear_logits",
    "make_data_mesh",
    "make_keys",
    "make_optimizer",
    "noisy_correct_counts",
    "noisy_mean",
    "normalize_features",
    "per_example_grad_norms",
    "prefetch",
    "prepare_features",
    "residuals",
    "shard_rows",
    "train_probe",
    "train_probe_poisson",
    "train_probe_streaming",
    "zero_nonfinite_rows",
]
