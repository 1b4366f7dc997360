"""Finetuning: DP-SGD on the weights of a Flax NNX model (`finetune.train`): all of them, the
head, the biases or LoRA adapters (`finetune.modes`), on the DP mechanism of `dp` (sampling, the
per-example clipper, the privatizer); the models in `finetune.models`; its one-run privacy audit
in `finetune.canaries`."""

from dpprobe.finetune import models, modes
from dpprobe.finetune.augment import augment_views
from dpprobe.finetune.canaries import CanaryAudit, audit_finetune
from dpprobe.finetune.checkpoint import Checkpointer
from dpprobe.finetune.evaluation import (
    EVAL_BATCH_SIZE,
    evaluate_model,
    iter_logits,
    normalize_images,
)
from dpprobe.finetune.modes import TRAIN_MODES, add_lora, merge_lora
from dpprobe.finetune.specs import (
    SCHEDULES,
    FinetuneFlags,
    FinetuneResult,
    FinetuneSpec,
    TrainState,
)
from dpprobe.finetune.timing import print_progress
from dpprobe.finetune.train import (
    clipped_sum,
    ema_decay_at,
    gradient_sum,
    init_state,
    model_inputs,
    split_trained,
    train_finetune,
    trained_sizes,
)

__all__ = [
    "EVAL_BATCH_SIZE",
    "SCHEDULES",
    "TRAIN_MODES",
    "CanaryAudit",
    "Checkpointer",
    "FinetuneFlags",
    "FinetuneResult",
    "FinetuneSpec",
    "TrainState",
    "audit_finetune",
    "augment_views",
    "add_lora",
    "merge_lora",
    "models",
    "modes",
    "gradient_sum",
    "split_trained",
    "clipped_sum",
    "ema_decay_at",
    "evaluate_model",
    "init_state",
    "iter_logits",
    "normalize_images",
    "model_inputs",
    "print_progress",
    "train_finetune",
    "trained_sizes",
]
