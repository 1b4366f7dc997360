"""Finetuning: DP-SGD on the weights of a Flax NNX model (`finetune.train`): all of them, the
head, the biases or LoRA adapters (`finetune.modes`), on the DP mechanism of `dp` (sampling, the
per-example clipper, the privatizer); the models in `finetune.models`; its one-run privacy audit
in `finetune.canaries`.

Every name is imported on first use and `dpprobe.finetune(...)` runs its job (`dpprobe._lazy`).
"""

from dpprobe._lazy import lazy_names

__getattr__, __dir__ = lazy_names(__name__, {
    "augment": ("augment_views",),
    "canaries": ("CanaryAudit", "audit_finetune"),
    "checkpoint": ("Checkpointer",),
    "evaluation": ("EVAL_BATCH_SIZE", "evaluate_model", "iter_logits", "normalize_images"),
    "modes": ("TRAIN_MODES", "add_lora", "merge_lora"),
    "specs": ("FinetuneFlags", "FinetuneResult", "FinetuneSpec", "SCHEDULES", "TrainState"),
    "timing": ("print_progress",),
    "train": (
        "clipped_sum", "ema_decay_at", "gradient_sum", "init_state", "model_inputs",
        "split_trained", "train_finetune", "trained_sizes",
    ),
}, submodules=("models", "modes"))


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
