"""What a probe job asks for, in three frozen parts, and what it returns.

  * `ProbeSpec`: the model and its optimizer (loss, normalization, optimizer hyperparameters);
  * `RunSpec`: one config of a sweep: its DP mechanism (`accounting.DpPlan`) and learning rate;
  * `PerformanceFlags`: speed and memory knobs only.

Privacy lives in the `DpPlan` alone: nothing in `ProbeSpec` or `PerformanceFlags` changes what
one example can contribute or how much noise is added, so neither changes epsilon.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from dpprobe.accounting import DpPlan
from dpprobe.dp.optimizers import OPTIMIZERS, make_optimizer
from dpprobe.probe.clipping import LOSSES, Loss
from dpprobe.probe.normalization import NORMALIZATIONS

__all__ = ["FEATURE_DTYPES", "Params", "PerformanceFlags", "ProbeSpec", "RunSpec", "TrainResult"]

# The working set a streamed job aims to stay within, beyond the process's fixed footprint
# (the runtime, the compiled programs: about 0.5 GiB; `probe.budget` plans within it).
DEFAULT_MEMORY_BUDGET = 1 << 30

Params = dict[str, Any]  # {"w": (P, d, C), "b": (P, C)}: P stacked linear models
FEATURE_DTYPES = ("float16", "float32")


@dataclasses.dataclass(frozen=True)
class ProbeSpec:
    """Program-shaping choices of a probe. None of them changes epsilon.

    Attributes:
      num_classes: C (public: the store's declared class list).
      loss: "softmax" or "sigmoid" (one-vs-all).
      optimizer: one of `dp.OPTIMIZERS`.
      bias_init: initial bias; None gives 0 for softmax and -10 for sigmoid (Mehta et al. 2022,
        App. E.3, https://arxiv.org/abs/2205.02973).
      normalization: per-example feature normalization ("none", "l2", "group").
      groups: number of groups for "group" normalization.
      momentum, b1, b2, eps, weight_decay: optimizer hyperparameters (see `make_optimizer`).
    """

    num_classes: int
    loss: Loss = "softmax"
    optimizer: str = "adam"
    bias_init: float | None = None
    normalization: str = "none"
    groups: int = 1
    momentum: float = 0.9
    b1: float = 0.9
    b2: float = 0.999
    eps: float | None = None
    weight_decay: float = 0.0

    def __post_init__(self):
        if self.num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {self.num_classes}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(
                f"normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}"
            )

    @property
    def initial_bias(self) -> float:
        if self.bias_init is not None:
            return float(self.bias_init)
        return -10.0 if self.loss == "sigmoid" else 0.0

    def make_optimizer(self, learning_rate):
        """The optax optimizer with this learning rate (`dp.make_optimizer`)."""
        return make_optimizer(self.optimizer, learning_rate, momentum=self.momentum, b1=self.b1,
                              b2=self.b2, eps=self.eps, weight_decay=self.weight_decay)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"bias_init": self.initial_bias}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One config of a sweep: its DP mechanism and its learning rate."""

    plan: DpPlan
    learning_rate: float

    def __post_init__(self):
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"learning_rate must be finite and > 0, got {self.learning_rate}")


@dataclasses.dataclass(frozen=True)
class PerformanceFlags:
    """Speed and memory knobs of the trainers. None of them changes epsilon: each example's
    contribution is clipped to the plan's C and the noise is the plan's sigma C whatever they
    are; they change only how the same sums are cut into compiled calls (and, for
    `feature_dtype`, a per-example rounding of the features, a function of one example).

    Attributes:
      physical_batch_size: Poisson training: rows per compiled call (a logical batch is cut
        into such physical batches, the last one padded and masked).
      rows_per_chunk: streaming: pad every chunk to this many rows (default: the first
        chunk's), so that one compiled kernel serves every chunk; longer chunks are cut.
      prefetch_depth: streaming: chunks read ahead in a background thread.
      mesh: in memory: a `jax.sharding.Mesh` with a "data" axis (`probe.make_data_mesh`) to
        shard rows over devices; None runs on the default device.
      feature_dtype: the features' dtype on the device ("float16" halves memory); None keeps
        the input's. Computation is float32 either way.
      memory_budget: streaming: bytes for the runs' state and one chunk call; runs are
        trained in groups and chunks cut to stay within it (`probe.budget`).
    """

    physical_batch_size: int = 256
    rows_per_chunk: int | None = None
    prefetch_depth: int = 2
    mesh: Any = None
    feature_dtype: str | None = None
    memory_budget: int = DEFAULT_MEMORY_BUDGET

    def __post_init__(self):
        if self.physical_batch_size < 1:
            raise ValueError(f"physical_batch_size must be >= 1, got {self.physical_batch_size}")
        if self.rows_per_chunk is not None and self.rows_per_chunk < 1:
            raise ValueError(f"rows_per_chunk must be >= 1, got {self.rows_per_chunk}")
        if self.memory_budget < 1:
            raise ValueError(f"memory_budget must be >= 1 byte, got {self.memory_budget}")
        if self.prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be >= 1, got {self.prefetch_depth}")
        if self.feature_dtype not in (None, *FEATURE_DTYPES):
            raise ValueError(f"feature_dtype must be one of {FEATURE_DTYPES} or None, "
                             f"got {self.feature_dtype!r}")


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """Trained stacked parameters (NumPy, leading axis = run) and clipping statistics.

    Only `params` is a DP output. `clipped_fraction` (per run, the mean over steps of the
    fraction of examples clipped) and `batch_sizes` (Poisson training: each sampled logical
    batch size, (steps, runs), 0 once a run has finished) are exact statistics of the private
    data: for local debugging only, never to be published.
    """

    params: Params
    clipped_fraction: np.ndarray
    batch_sizes: np.ndarray | None = None
