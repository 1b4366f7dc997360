"""The defaults of `dpprobe probe` and `dpprobe tune` that depend on the store, chosen from
public quantities only: the store's backbone (its provenance), the feature shape, the declared
class count, the number of training examples N (public under zero-out neighbours), epsilon and
delta. Choosing from them costs no privacy; nothing here reads a feature or a label.

* **Normalization from the backbone.** Measured on Fashion-MNIST ScatterNet features
  (`benchmarks/tune_recipe.py`, epsilon 3, free selection over r, T = 100): without
  normalization the best r of the linear scaling search lies far outside any sensible range and
  the tuned model reaches 78.7-81.5%; Tramer & Boneh's GroupNorm over ScatterNet's channel
  groups gives 89.4-89.8%, with 9, 27 or 81 groups alike (within run-to-run noise); 27 is
  their choice.
* **The total step size r = lr x T from the linear scaling rule** (Panda et al. 2023): for
  full-batch DP-SGD the noise the weights accumulate is about lr sqrt(T) sigma C / N = r C /
  (mu N) (sigma = sqrt(T) / mu for T Gaussian steps at mu-GDP), and the signal about r times
  the mean clipped gradient, so the best r grows with mu N:
  r = R_PER_MU_N x mu(min(epsilon, SATURATION_EPSILON), delta) x N. The constant is
  measured, not derived: the r* that `dpprobe tune` found on Fashion-MNIST (60,000 examples:
  81 / 196 / 302 / 417 / 841 at epsilon 0.5 / 1 / 2 / 3 / 8, README) are 0.0084-0.012 mu N,
  and a grid of r on scikit-learn digits (1,438 examples, `benchmarks/probe_defaults.py`)
  peaks at 0.008-0.015 mu N at every epsilon from 0.5 to 8. Past epsilon 8 the noise no longer
  limits the probe, and more r overfits (digits without noise: best r 30 = 0.013 mu_8 N), so
  r stops growing there; the non-private reference takes the same r as epsilon 8.
* **Full-batch momentum 0.9, T = 300, C = 1** (Panda et al.'s setting; tune's final run): the
  noise depends on r, not on how r splits into lr x T, but more steps optimize better at the
  same r: on Fashion-MNIST, T = 300 beats T = 100 by 0.3 points at epsilon 1 and 3 and by
  about 1 point at epsilon 8 and without noise (one run each, `benchmarks/probe_defaults.py`
  measures the defaults). T = 20 shifts the best r up and loses up to a point (digits).
* **Fewer steps as the store grows** (`default_steps`): T = 300 for stores of up to
  MEASURED_ROWS = 60,000 rows (Fashion-MNIST's size, where T = 300 was measured: T = 100 lost
  up to a point there). Beyond, a full-batch step costs about N d C multiply-adds per run
  (the logits in float32, the clipped sum's reduction in float64: `dp.accumulate`), and T is
  the largest that fits STEP_SECONDS_BUDGET = 30 s of steps on the local device (the rest of
  a sweep, reading the store, compiling and testing, takes seconds more), so that the
  defaults finish in about a minute: on 2 CPU cores T = 31 on 200,000 x 512 x 10 classes, 3 on
  10^6 x 1024 x 10, and 1 on an ImageNet-shaped store, where Mehta et al. (2022,
  https://arxiv.org/abs/2205.02973) train their best probes: a single full-batch step (from
  zero weights one step's argmax does not depend on its learning rate). The rates per device
  (`device_rate`) are public constants, measured on CPU (`benchmarks/probe_recipe_speed.py`);
  the expected time is printed before training.
* **The learning rate is at most 6** (momentum 0.9: a step of up to 60 mean clipped
  gradients), so that shorter runs do not overshoot: at T = 100 on Fashion-MNIST, r = 1100
  (lr 11) gave 88.9-90.0% at epsilon 8 from run to run and 90.0-90.2% without noise, r = 600
  (lr 6) 90.15% and 90.46%. At T = 300 the cap binds only for large N (above about 98,000
  rows at epsilon 8 and for the non-private reference, 228,000 at 3, 1.15M at 0.5): on
  Fashion-MNIST lr <= 3.7; on an ImageNet-sized store every epsilon trains at 6 (not measured
  there).
"""

from __future__ import annotations

import dataclasses
import math

from dpprobe import accounting
from dpprobe.choices import given_or_default
from dpprobe.probe.cost import StepCost

__all__ = [
    "MAX_LEARNING_RATE",
    "MEASURED_ROWS",
    "PROBE_STEPS",
    "R_PER_MU_N",
    "SATURATION_EPSILON",
    "SCATTERNET_MAX_GROUPS",
    "STEP_SECONDS_BUDGET",
    "ProbeRecipe",
    "backbone_normalization",
    "decide_standardization",
    "default_steps",
    "normalization_for",
    "probe_recipe",
    "total_step_size",
]

# Tramer & Boneh (2021, https://arxiv.org/abs/2011.11660) normalize ScatterNet's 81 channels
# (J = 2, L = 8) in 27 groups.
SCATTERNET_MAX_GROUPS = 27
# r = lr x T per unit of mu N, for full-batch momentum 0.9 and clip norm 1 (module docstring).
R_PER_MU_N = 0.011
# Past this epsilon the rule's r stops growing (and the non-private reference takes its r).
SATURATION_EPSILON = 8.0
# tune's private standardization pays when its released mean is this precise, per feature of
# unit variance: std sqrt(2) / mu_std x (norm bound) / N. On digits (N = 1,438, d = 324) at
# 0.20 (epsilon 3) tune with it beat the default probe by 0.3 point; at 0.54 (epsilon 1) it
# lost 4.7 points (`benchmarks/tune_decision.py`). Fashion-MNIST: 0.09 at epsilon 0.5.
MAX_STANDARDIZATION_NOISE = 0.25
PROBE_STEPS = 300
# Up to this many training rows the default is T = PROBE_STEPS whatever it costs (module docstring).
MEASURED_ROWS = 60_000
# Seconds of full-batch steps the default T may take beyond MEASURED_ROWS.
STEP_SECONDS_BUDGET = 30.0
PROBE_OPTIMIZER = "momentum"
MAX_LEARNING_RATE = 6.0  # for momentum 0.9 (module docstring); sgd: 10x
# The rule is stated for momentum 0.9; plain SGD moves 1 / (1 - 0.9) = 10x less per step.
_R_FACTOR = {"momentum": 1.0, "sgd": 10.0}


def backbone_normalization(backbone: dict | None) -> tuple[str, int | None]:
    """(normalization, groups) for a store whose backbone provenance is `backbone`.

    * ScatterNet: GroupNorm whose groups are whole scattering channels, the largest divisor of
      the coefficients per input channel that is at most 27 (27 for J = 2, L = 8). The features
      are channel-major, (input channels x coefficients x H x W), so a group of d / G
      contiguous features is a run of whole channels whenever G divides the coefficients per
      input channel, whatever the number of input channels and the spatial size.
    * timm backbones and precomputed embeddings: none. Not measured here (no pretrained weights
      offline); the pooled embeddings of ViTs leave the model through its final LayerNorm, and
      unit-norm ("l2") features would move the best total step size r by about sqrt(d), out of
      the default search range.
    """
    backbone = backbone or {}
    if backbone.get("name") == "scatternet":
        channels = int(backbone.get("coefficients_per_channel") or 0)
        if channels > 0:
            groups = max(g for g in range(1, SCATTERNET_MAX_GROUPS + 1) if channels % g == 0)
            return "group", groups
    return "none", None


def normalization_for(normalization: str | None, groups: int | None, backbone: dict | None
                      ) -> tuple[str, int | None, str | None]:
    """(normalization, groups, why) of a probe: the config's where it names them, else the
    backbone's (`backbone_normalization`); `--normalize group` without `--groups` takes the
    backbone's groups too (27 on ScatterNet), else 1. `why` says what was chosen, or None."""
    if normalization is None:
        normalization, groups = backbone_normalization(backbone)
        return normalization, groups, "from the store's backbone"
    if normalization == "group" and groups is None:
        default, groups = backbone_normalization(backbone)
        if default == "group":
            return normalization, groups, "groups from the store's backbone"
        return normalization, 1, None
    return normalization, groups, None


def decide_standardization(asked: bool | None, epsilon: float | None, delta: float,
                           norm_bound: float, num_examples: int) -> tuple[bool, str]:
    """Whether `dpprobe tune` standardizes its features privately, and why.

    Args:
      asked: `--standardize` (True), `--no-standardize` (False), or None: decide.
      epsilon, delta: the standardization's budget.
      norm_bound: the per-example normalization's norm bound (inf: none, which cannot be
        standardized: the releases' sensitivity is that bound).
      num_examples: N of the rows standardized.

    Returns:
      (standardize, the reason in words). When not asked, it standardizes when the released
      mean's noise per feature, sqrt(2) / mu x bound / N, is at most MAX_STANDARDIZATION_NOISE.

    Formal guarantee: a function of public quantities only; deciding costs no privacy.
    """
    if asked is not None and not (asked and not math.isfinite(norm_bound)):
        return asked, "asked for (--standardize)" if asked else "off (--no-standardize)"
    if not math.isfinite(norm_bound):
        if asked:
            raise ValueError("standardization needs a per-example normalization that bounds "
                             "each example's norm (group or l2), the sensitivity of its releases")
        return False, "off: the features have no norm bound (no per-example normalization)"
    noise = math.sqrt(2.0) / accounting.gdp_mu(epsilon, delta) * norm_bound / num_examples
    if noise > MAX_STANDARDIZATION_NOISE:
        return False, (f"off: with N = {num_examples} and epsilon {epsilon:.3g} the released "
                       f"means would carry noise of std {noise:.2g} per feature (more than "
                       f"{MAX_STANDARDIZATION_NOISE:g}); --standardize forces it")
    return True, (f"on: the released means carry noise of std {noise:.2g} per feature "
                  "(--no-standardize turns it off)")


def total_step_size(epsilon: float, delta: float, num_examples: int) -> float:
    """The linear scaling rule's r = lr x T for full-batch momentum 0.9.

    Args:
      epsilon, delta: the run's target (epsilon inf, the non-private reference, takes
        epsilon 8's r).
      num_examples: N, the train split's size.

    Returns:
      R_PER_MU_N x mu x N, mu the Gaussian-DP mu of (min(epsilon, 8), delta).

    Formal guarantee: a function of public quantities only (N is public under zero-out
    neighbours); choosing r with it costs no privacy.
    """
    mu = accounting.gdp_mu(min(epsilon, SATURATION_EPSILON), delta)
    return R_PER_MU_N * mu * num_examples


@dataclasses.dataclass(frozen=True)
class ProbeRecipe:
    """What `dpprobe probe` trains, each choice given or chosen from public quantities.

    Attributes:
      normalization, groups, optimizer, steps: as for `ProbeConfig`.
      learning_rates: the given learning rates; None: one per (epsilon, T) from the linear
        scaling rule (momentum, sgd) or the optimizer's default (adam, sign, lamb).
      num_examples, delta: the public quantities the rule reads.
      chosen: the fields chosen (not given), with why.
      sampling_probability: q of Poisson-sampled minibatches; 1: full batch.
      cost: the estimated cost of the sweep (`probe.cost`), when known.
    """

    normalization: str
    groups: int | None
    optimizer: str
    steps: tuple[int, ...]
    learning_rates: tuple[float, ...] | None
    num_examples: int
    delta: float
    chosen: dict[str, str]
    sampling_probability: float = 1.0
    cost: StepCost | None = None

    @property
    def scaled(self) -> bool:
        """Whether the learning rate comes from the linear scaling rule."""
        return self.learning_rates is None and self.optimizer in _R_FACTOR

    def learning_rate(self, epsilon: float, steps: int, given: float | None = None) -> float:
        """The learning rate of a run at `epsilon` with T = `steps`."""
        if given is not None:
            return given
        if self.scaled:
            r = total_step_size(epsilon, self.delta, self.num_examples)
            return _R_FACTOR[self.optimizer] * min(r / steps, MAX_LEARNING_RATE)
        from dpprobe.dp import DEFAULT_LEARNING_RATES

        return DEFAULT_LEARNING_RATES[self.optimizer]

    def to_dict(self, epsilons) -> dict:
        """The recipe for results.json: public inputs only (N and the arguments)."""
        return {
            "normalization": self.normalization, "groups": self.groups,
            "optimizer": self.optimizer, "steps": list(self.steps),
            "learning_rate": ("linear scaling rule: lr = min(r / T, "
                              f"{MAX_LEARNING_RATE:g}), r = {R_PER_MU_N:g} x mu(min(epsilon, "
                              f"{SATURATION_EPSILON:g}), delta) x N"
                              f"{'; x 10 (sgd)' if self.optimizer == 'sgd' else ''}"
                              if self.scaled else "given" if self.learning_rates
                              else "the optimizer's default"),
            "learning_rates": {f"{e:g}": [self.learning_rate(e, t, lr)
                                          for t in self.steps
                                          for lr in (self.learning_rates or (None,))]
                               for e in epsilons},
            "num_examples": self.num_examples,
            "chosen": dict(self.chosen),
        }

    def describe(self, epsilons) -> str:
        """One line per choice, for the terminal: what trains and where each choice came from."""
        normalization = self.normalization + (f" ({self.groups} groups)"
                                              if self.normalization == "group" else "")
        why = {k: f" [{v}]" for k, v in self.chosen.items()}
        if self.scaled:
            rates = ", ".join(f"epsilon {e:g}: {self.learning_rate(e, self.steps[0]):.3g}"
                              for e in epsilons)
            lr = (f"lr = r / T (at most {MAX_LEARNING_RATE:g}) by the linear scaling rule r = "
                  f"{R_PER_MU_N:g} x mu x N (N = {self.num_examples}; T = {self.steps[0]}: "
                  f"{rates})")
        else:
            lr = "lr " + (",".join(f"{v:g}" for v in self.learning_rates) if self.learning_rates
                          else f"{self.learning_rate(0.0, 1):g} (the optimizer's default)")
        batches = ("full-batch" if self.sampling_probability >= 1
                   else f"Poisson-sampled (q = {self.sampling_probability:g})")
        expected = ""
        if self.cost is not None and self.sampling_probability >= 1:
            expected = (f"; expected time about {_seconds(self.cost.seconds(max(self.steps)))}"
                        f" ({self.cost.device}: {_seconds(self.cost.step_seconds)} per step)")
        return (f"recipe: per-example normalization {normalization}{why.get('normalization', '')}"
                f", {batches} {self.optimizer}{why.get('optimizer', '')}, T = "
                f"{','.join(map(str, self.steps))}{why.get('steps', '')}, {lr}"
                f"{why.get('learning_rates', '')}{expected}")


def _seconds(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.2g} s" if seconds < 10 else f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def default_steps(num_examples: int, cost: StepCost | None) -> tuple[int, str]:
    """The default full-batch step count T of momentum and sgd, and why (module docstring).

    Args:
      num_examples: N.
      cost: the sweep's estimated cost on this device (`probe.cost.step_cost`); None: not
        known (T = PROBE_STEPS).

    Returns:
      (T, the reason in words): PROBE_STEPS up to MEASURED_ROWS rows; beyond, the most steps
      (at least 1, at most PROBE_STEPS) whose estimated time fits STEP_SECONDS_BUDGET.

    Formal guarantee: a function of public quantities only (N and the cost estimated from
    public shapes and the device); choosing T with it costs no privacy.
    """
    if cost is None:
        return PROBE_STEPS, "default"
    if num_examples <= MEASURED_ROWS:
        return PROBE_STEPS, f"default up to N = {MEASURED_ROWS:,}"
    steps = int(max(1, min(PROBE_STEPS, STEP_SECONDS_BUDGET // cost.step_seconds)))
    if steps == PROBE_STEPS:
        return steps, f"default: {steps} steps fit {STEP_SECONDS_BUDGET:g} s here"
    if steps == 1:
        return steps, (f"one step (Mehta et al.'s regime) at N = {num_examples:,}: a step takes "
                       f"about {_seconds(cost.step_seconds)} here")
    return steps, (f"the steps that fit {STEP_SECONDS_BUDGET:g} s at N = {num_examples:,} "
                   f"(at most {PROBE_STEPS})")


def probe_recipe(config, train_attrs: dict, num_examples: int,
                 cost: StepCost | None = None) -> ProbeRecipe:
    """The recipe of `run_probe(config)`: the config's choices where it makes them, else the
    defaults above.

    Args:
      config: a `ProbeConfig` (its None fields are chosen here).
      train_attrs: the store's train split attributes (only the backbone's provenance is read).
      num_examples: N.
      cost: the sweep's estimated cost on this device (`probe.cost.step_cost`, from public
        shapes), from which the default T is chosen (`default_steps`); None: T = 300.

    Returns:
      The `ProbeRecipe`, with what was chosen and why.

    Formal guarantee: reads only public quantities (the backbone's provenance, N, delta and
    the config, and the cost estimated from public shapes and the device); no feature or label,
    so the choice costs no privacy (`tests/test_privacy.py` runs the defaults on D and D minus
    one row).
    """
    chosen = {}
    normalization, groups, why = normalization_for(config.normalization, config.groups,
                                                   train_attrs.get("backbone"))
    if why is not None:
        chosen["normalization"] = why
    optimizer = given_or_default(chosen, "optimizer", config.optimizer, PROBE_OPTIMIZER,
                                 "default")
    steps = config.steps
    if steps is None:
        full_batch = config.sampling_probability >= 1
        default, chosen["steps"] = (default_steps(num_examples, cost if full_batch else None)
                                    if optimizer in _R_FACTOR else (1, "default"))
        steps = (default,)
    recipe = ProbeRecipe(normalization, groups, optimizer, tuple(steps),
                         config.learning_rates, int(num_examples), config.delta, chosen,
                         float(config.sampling_probability), cost)
    if recipe.learning_rates is None:
        chosen["learning_rates"] = ("from epsilon, delta and N" if recipe.scaled
                                    else "the optimizer's default")
    return recipe
