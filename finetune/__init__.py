"""dpprobe's full fine-tuning path: DP-SGD on every weight of a Flax NNX image model."""
