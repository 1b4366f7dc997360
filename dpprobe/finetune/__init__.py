"""Finetuning: DP-SGD on the weights of a Flax NNX model (`finetune.train`): all of them, the
head, the biases or LoRA adapters (`finetune.modes`), on the DP mechanism of `dp` (sampling, the
per-example clipper, the privatizer); the models in `finetune.models`; its one-run privacy audit
in `finetune.canaries`.

Every name is imported on first use (PEP 562), so that `import dpprobe.finetune` loads no JAX:
the command line imports this package to build its options.

Called, the package runs its job: `dpprobe.finetune(...)` is `dpprobe.jobs.finetune` (installed by
`dpprobe/__init__.py`; this package never imports the job, which imports `pipelines`).
"""

from dpprobe._lazy import lazy_names

_LAZY = {
    "models": "dpprobe.finetune.models",
    "modes": "dpprobe.finetune.modes",
    "augment_views": "dpprobe.finetune.augment",
    "CanaryAudit": "dpprobe.finetune.canaries",
    "audit_finetune": "dpprobe.finetune.canaries",
    "Checkpointer": "dpprobe.finetune.checkpoint",
    "EVAL_BATCH_SIZE": "dpprobe.finetune.evaluation",
    "evaluate_model": "dpprobe.finetune.evaluation",
    "iter_logits": "dpprobe.finetune.evaluation",
    "normalize_images": "dpprobe.finetune.evaluation",
    "TRAIN_MODES": "dpprobe.finetune.modes",
    "add_lora": "dpprobe.finetune.modes",
    "merge_lora": "dpprobe.finetune.modes",
    "SCHEDULES": "dpprobe.finetune.specs",
    "FinetuneFlags": "dpprobe.finetune.specs",
    "FinetuneResult": "dpprobe.finetune.specs",
    "FinetuneSpec": "dpprobe.finetune.specs",
    "TrainState": "dpprobe.finetune.specs",
    "print_progress": "dpprobe.finetune.timing",
    "clipped_sum": "dpprobe.finetune.train",
    "ema_decay_at": "dpprobe.finetune.train",
    "gradient_sum": "dpprobe.finetune.train",
    "init_state": "dpprobe.finetune.train",
    "model_inputs": "dpprobe.finetune.train",
    "split_trained": "dpprobe.finetune.train",
    "train_finetune": "dpprobe.finetune.train",
    "trained_sizes": "dpprobe.finetune.train",
}


__getattr__, __dir__ = lazy_names(__name__, _LAZY)


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
