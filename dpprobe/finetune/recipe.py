"""The defaults of `dpprobe finetune` (batch size, epochs, learning rate, clip norm), chosen from
public quantities only: the number of training examples N (public under zero-out neighbours),
the image size, the class count, the model and epsilon. Nothing here reads an image or a label.

Tramer & Boneh's recipe for their CNN (B = 2048, 30 epochs, momentum 0.9, lr 4, C = 0.1) is
the default for large N: measured here on Fashion-MNIST at (3, 1e-5), 86.4% (README). On small
N it fails: scikit-learn digits (N = 1,438) with B = 2048 > N trains full batch for 30 steps and
reaches 68-70% at epsilon 8, while B = 256 for 60 epochs at lr 2 reaches 96%. So:

* **B = the largest power of two <= N / 5, at most 2048** (q = B / N <= 0.2: the Poisson
  sampling still amplifies privacy, and there are at least 5 batches per epoch). N >= 10,240
  gives Tramer & Boneh's 2048; digits gets 256.
* **Epochs: 30 (40 for the ScatterNet models, Tramer & Boneh's), or more so that T = epochs x N / B
  >= 300 steps** (digits: 54 epochs): with few steps the model barely trains, whatever the
  noise.
* **lr = 4 sqrt(B / 2048)**, the square-root scaling of the learning rate with the batch size:
  4 at B = 2048 (Tramer & Boneh), 1.41 at B = 256. The expected batch's noise sigma C / B grows
  as B shrinks; a smaller step keeps the noise per step in check. On digits at epsilon 8
  (3 runs each, raw test accuracy, medians): lr 1.5 95.5%, lr 2 93.6-93.9%, lr 3 90.5%; 90
  epochs instead of 54 lose 5 points (more steps, more noise per step), 30-40 epochs are
  within a point (`benchmarks/finetune_defaults.py` measures the defaults). That is for
  `--optimizer momentum` at 0.9; the other update rules keep its step: momentum rho gets
  lr x (1 - rho) / 0.1 (the same steady-state step lr / (1 - rho)), plain `sgd` 10 x (40 sqrt
  (B / 2048)), and the adaptive ones (`adam`, `sign`, `lamb`), whose steps do not scale with
  the gradient, a fixed lr. On digits at epsilon 8 (the default model, B 256, 3 runs each,
  raw test accuracy, medians): momentum 0.9 at 1.41 97.2%; sgd at 1.41 93.9%, at 14.1 97.2%;
  adam at 1.41 (what the rule gave it before) 82.7%, 1e-3 94.2%, 3e-3 96.7%, **1e-2 97.2%**,
  3e-2 94.7%; sign 1e-2 96.4%; lamb 1e-3
  72.7%, **1e-2 92.2%**, 3e-2 88.9%, 0.1 73.8%. Not measured at other batch sizes.
* **C = 0.1** (Tramer & Boneh).
* **EMA decay 0.999** (De et al.), with their warm-up: step t's decay is
  min(0.999, (1 + t) / (10 + t)), which reaches 0.999 only at step 8,990. Before that the EMA
  averages about the last t / 9 iterates (at the last of Fashion-MNIST's 1,172 steps, a decay
  of 0.992), so for shorter runs the decay given changes nothing: an earlier "0.998 for
  `scatternet_cnn_linear`" trained exactly the 0.999 recipe, its runs are pooled with those
  in the README. Longer windows lose: averages of the same runs' iterates on Fashion-MNIST at
  (3, 1e-5) (two runs, README) keep about 89.7% up to a window of 10% of the run and lose
  up to 0.7 points with longer windows, the early iterates being worse.

* **The model, when none is given: `scatternet_cnn_linear` for images of 8 to 32 px whose
  side is a multiple of 4, else `cnn`** (`default_model`). On Fashion-MNIST at (3, 1e-5) it
  reached 89.93% (median of 14, EMA) against `cnn`'s 86.1-86.7%, in about 3x the CPU time
  (380 vs 130 s); on digits it trains at the native 8 px (`cnn` needs 16), measured in the
  README. Tramer & Boneh's CIFAR-10 results point the same way (ScatterNet + CNN 69.3%,
  end-to-end CNN 59.2% at epsilon 3; not measured here: no CIFAR offline). Above 32 px the
  ScatterNet's output grows as the side squared (81 C (S/4)^2 floats an image: 3 MB at 224 px
  RGB, 119 ms an image on this CPU), too large to hold for a dataset and slow to recompute
  every step, so larger images get the CNN (for them a pretrained ViT is the better choice).

The image size, class count and epsilon change nothing else: the recipe was measured at 8-28
px, 10 classes, epsilon 3 and 8. ViTs (finetuning pretrained
weights) take the same rule; not measured here (no pretrained weights offline).
"""

from __future__ import annotations

import dataclasses
import math

from dpprobe.choices import given_or_default

__all__ = ["FinetuneRecipe", "default_model", "ema_full_step", "finetune_recipe"]

MAX_BATCH = 2048  # Tramer & Boneh's batch for Fashion-MNIST
MIN_BATCHES_PER_EPOCH = 5
MIN_EPOCHS = 30.0
# Tramer & Boneh's epochs where they differ (ScatterNet + CNN on Fashion-MNIST: 40).
MODEL_EPOCHS = {"scatternet_cnn": 40.0, "scatternet_cnn_linear": 40.0}
MIN_STEPS = 300
EMA_DECAY = 0.999  # De et al.
BASE_LEARNING_RATE = 4.0  # at MAX_BATCH, momentum 0.9
BASE_MOMENTUM = 0.9
# The defaults that depend on nothing, declared here once: `FinetuneSpec`, `FinetuneFlags` and
# the command's `FinetuneConfig` take them from this module, which imports no JAX.
OPTIMIZER = "momentum"
SCHEDULES: tuple[str, ...] = ("constant", "cosine")  # learning-rate schedules
SCHEDULE = "constant"
TRAIN_MODE = "all"
PHYSICAL_BATCH_SIZE = 256  # examples per clipped sum (memory only, never epsilon)
ADAPTIVE_LEARNING_RATE = 1e-2  # adam, sign, lamb: measured on digits (module docstring)
CLIP_NORM = 0.1
SCATTERNET_MAX_SIDE = 32  # the default model's ScatterNet up to this side (module docstring)


def ema_full_step(decay: float) -> int:
    """The first step t at which De et al.'s warm-up (1 + t) / (10 + t) reaches `decay`, so
    that the EMA's decay is `decay` itself (`finetune.ema_decay_at`, in float64 as the trainer
    takes it): the least such t, by bisection (the closed form (10 d - 1) / (1 - d) rounds)."""

    def reached(t: int) -> bool:
        return (1.0 + t) / (10.0 + t) >= decay

    if reached(0):
        return 0
    low, high = 0, 1
    while not reached(high):
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if reached(middle) else (middle, high)
    return high


def _learning_rate(config, batch_size: int) -> tuple[float, str]:
    """The default learning rate of `config.optimizer` at expected batch B, and its rule."""
    base = BASE_LEARNING_RATE * math.sqrt(batch_size / MAX_BATCH)
    if config.optimizer == "momentum":
        if config.momentum == BASE_MOMENTUM:
            return base, "4 sqrt(B / 2048)"
        scale = (1 - config.momentum) / (1 - BASE_MOMENTUM)
        return base * scale, f"4 sqrt(B / 2048) (1 - {config.momentum:g}) / 0.1"
    if config.optimizer == "sgd":
        return base / (1 - BASE_MOMENTUM), "40 sqrt(B / 2048): momentum 0.9's step"
    return ADAPTIVE_LEARNING_RATE, f"measured for {config.optimizer}"


def default_model(image_size: int) -> str:
    """The model of a run that names none, from the model's input side (public)."""
    if 8 <= image_size <= SCATTERNET_MAX_SIDE and image_size % 4 == 0:  # its smallest: 8
        return "scatternet_cnn_linear"
    return "cnn"


@dataclasses.dataclass(frozen=True)
class FinetuneRecipe:
    """The recipe a finetune run trains with, and which of its values were chosen (not given)
    and from what."""

    batch_size: int
    epochs: float | None  # None when the run's length is given in steps
    learning_rate: float
    clip_norm: float
    ema_decay: float  # 0: no EMA
    chosen: dict[str, str]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One line for the terminal: each value, and where the chosen ones came from."""
        why = {k: f" [{v}]" for k, v in self.chosen.items()}
        length = (f", {self.epochs:g} epochs{why.get('epochs', '')}"
                  if self.epochs is not None else "")
        return (f"recipe: B = {self.batch_size}{why.get('batch_size', '')}{length}, lr = "
                f"{self.learning_rate:.3g}{why.get('learning_rate', '')}, C = "
                f"{self.clip_norm:g}{why.get('clip_norm', '')}, EMA "
                f"{self.ema_decay:g}{why.get('ema_decay', '')}")


def finetune_recipe(config, *, num_examples: int, image_size: int, num_classes: int
                    ) -> FinetuneRecipe:
    """The config's batch size, epochs, learning rate, clip norm and EMA decay where it gives
    them, else the rule of the module docstring.

    Args:
      config: a `FinetuneConfig` (its None recipe fields are chosen here).
      num_examples, image_size, num_classes: N, the model's input side, K.

    Returns:
      The `FinetuneRecipe`, with what was chosen and from what.

    Formal guarantee: a function of public quantities only (N is public under zero-out
    neighbours; the image size, class count, model and epsilon are arguments): choosing it
    costs no privacy.
    """
    inputs = (f"N = {num_examples}, {image_size} px, {num_classes} classes, {config.model}, "
              f"epsilon {config.epsilon:g}")
    chosen = {}
    batch_size = config.batch_size
    if batch_size is None:
        batch_size = min(MAX_BATCH, 2 ** max(0, int(math.log2(max(1, num_examples
                                                                   // MIN_BATCHES_PER_EPOCH)))))
        chosen["batch_size"] = f"from {inputs}"
    epochs = config.epochs
    if epochs is None and config.steps is None:
        least = MODEL_EPOCHS.get(config.model, MIN_EPOCHS)
        epochs = max(least, math.ceil(MIN_STEPS * batch_size / num_examples))
        chosen["epochs"] = f"at least {least:g} and at least 300 steps"
    learning_rate = config.learning_rate
    if learning_rate is None:
        learning_rate, chosen["learning_rate"] = _learning_rate(config, batch_size)
    clip_norm = given_or_default(chosen, "clip_norm", config.clip_norm, CLIP_NORM,
                                 "Tramer & Boneh")
    ema_decay = given_or_default(chosen, "ema_decay", config.ema_decay, EMA_DECAY,
                                 f"De et al.; their warm-up (1 + t) / (10 + t) until step "
                                 f"{ema_full_step(EMA_DECAY):,}")
    return FinetuneRecipe(int(batch_size), None if config.steps is not None else float(epochs),
                          float(learning_rate), float(clip_norm), float(ema_decay), chosen)
