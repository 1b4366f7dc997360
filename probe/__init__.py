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
)
from probe.evaluation import evaluate
from probe.normalization import NORMALIZATIONS, normalize_features
from probe.optimizers import DEFAULT_LEARNING_RATES, OPTIMIZERS, make_optimizer
from probe.train import (
    ProbeSpec,
    RunSpec,
    TrainResult,
    apply_update,
    init_params,
    make_keys,
    noisy_mean,
    prepare_features,
    train_probe,
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
    "evaluate",
    "example_losses",
    "feature_gram",
    "init_params",
    "linear_logits",
    "make_keys",
    "make_optimizer",
    "noisy_mean",
    "normalize_features",
    "per_example_grad_norms",
    "prepare_features",
    "residuals",
    "train_probe",
]
