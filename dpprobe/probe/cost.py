"""What a full-batch probe sweep costs, from public shapes and the device alone.

One full-batch step of P stacked runs on N x d features with C classes computes the logits
(N d P C multiply-adds in float32) and the clipped sum X^T (s R) (N d P C more, its reduction
in float64: `dp.accumulate`); the norms, the noise and the optimizer are O(N P C + d P C).
So a step takes about N d C P / rate seconds, the rate a public constant per device kind:

  * CPU: CPU_RATE_PER_CORE per core, read off `benchmarks/probe_recipe_speed.py` (a step of
    15 runs on 200,000 x 512 x 10 classes on 2 cores shared with other jobs: 1.8 CPU seconds,
    8.5e9 per core and CPU second; 1.25 s with float32 sums), rounded down;
  * an accelerator: ACCELERATOR_RATE, not measured here. It is set for a datacenter GPU's
    float64 (its float64 sums run at 1/2 of float32); a card with slow float64 (1/32-1/64 of
    float32) is slower than this says.

A sweep also starts (imports, compiling its programs: START_SECONDS) and reads the store
(READ_BYTES_PER_SECOND of float16 features, decoded by Zarr); streamed from disk, it reads the
store at every step. The probe's recipe chooses its default step count from this estimate
(`probe.recipe.default_steps`) and `dpprobe probe` prints it before training.

Formal guarantee: every function here reads public quantities only (N, d, C, the number of
runs, the device); none reads a feature or a label, so choosing from them costs no privacy.
"""

from __future__ import annotations

import dataclasses
import os

__all__ = ["ACCELERATOR_RATE", "CPU_RATE_PER_CORE", "READ_BYTES_PER_SECOND", "START_SECONDS",
           "StepCost", "device_rate", "local_device", "step_cost"]

# Multiply-adds (N d C per run, per step) per second and CPU core (module docstring).
CPU_RATE_PER_CORE = 8.0e9
# The same, per accelerator (not measured: module docstring).
ACCELERATOR_RATE = 1.0e12
# Imports and compiling a sweep's programs (the persistent cache not yet filled).
START_SECONDS = 8.0
# Feature bytes the store reader decodes per second (float16, Zstandard).
READ_BYTES_PER_SECOND = 2.0e8


@dataclasses.dataclass(frozen=True)
class StepCost:
    """The estimated cost of a full-batch sweep: `step_seconds` per step, `start_seconds`
    once (start-up, compiling, reading the store in memory), and the device it assumes."""

    step_seconds: float
    start_seconds: float
    device: str

    def seconds(self, steps: int) -> float:
        """Estimated seconds of a sweep of `steps` full-batch steps."""
        return self.start_seconds + steps * self.step_seconds


def device_rate(platform: str, cores: int, devices: int = 1) -> float:
    """Multiply-adds per second of the probe's step on `devices` devices of `platform`
    ("cpu": `cores` CPU cores in all; "gpu", "tpu" and others: per device)."""
    if platform == "cpu":
        return CPU_RATE_PER_CORE * max(1, cores)
    return ACCELERATOR_RATE * max(1, devices)


def local_device() -> tuple[str, int]:
    """(platform of JAX's default device, CPU cores this process may use)."""
    import jax

    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return jax.devices()[0].platform, cores


def step_cost(num_examples: int, dim: int, num_classes: int, num_runs: int, *, platform: str,
              cores: int, devices: int = 1, streamed: bool = False,
              feature_bytes: int = 2) -> StepCost:
    """The estimated cost of a full-batch sweep (module docstring).

    Args:
      num_examples, dim, num_classes: the train split's N, d (all features of a row, views
        included) and C.
      num_runs: the runs trained together (P).
      platform, cores, devices: the device (`local_device`; `devices` > 1 shards the rows).
      streamed: the train split is read from disk at every step.
      feature_bytes: bytes per stored feature (2: float16).

    Returns:
      The `StepCost`.
    """
    rate = device_rate(platform, cores, devices)
    compute = num_examples * dim * num_classes * num_runs / rate
    read = num_examples * dim * feature_bytes / READ_BYTES_PER_SECOND
    where = f"{platform}, {cores} cores" if platform == "cpu" else f"{devices} {platform}"
    return StepCost(step_seconds=compute + (read if streamed else 0.0),
                    start_seconds=START_SECONDS + (0.0 if streamed else read), device=where)
