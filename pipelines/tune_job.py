"""The tune job: private hyperparameter search with the linear scaling rule on a feature store
(`pipelines.search`: the algorithm, and whether a search pays), then the final probe, ledger.
`linear_scaling_search` reads as the steps it takes (`pipelines.tune_steps`)."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

import accounting
from pipelines import config as cfg
from pipelines import preflight, reporting, search
from pipelines import tune_steps as steps
from pipelines.tune_calls import load_public_validation, private_standardization

__all__ = ["TuneConfig", "linear_scaling_search", "load_public_validation",
           "private_standardization", "run_tune"]


@dataclasses.dataclass(frozen=True)
class TuneConfig:
    """What `run_tune` and `linear_scaling_search` do; `dpprobe tune --help` explains each.

    Attributes:
      store: feature store with complete train and test splits.
      epsilon, delta: the total budget of the job, tuning and selection included.
      eps0, eps1: budgets of the two search stages (default epsilon/20 and epsilon/10).
      eps_select: budget of the noisy selection counts of both stages with selection "train"
        (default epsilon/20).
      trials: trials per stage.
      search: "auto" (default: search when it pays, `pipelines.search.decide_search`, from
        public quantities), "random" (log-uniform r), "grid" (geometric grid of r), or "none"
        (spend the whole budget on the default recipe's r, `pipelines.recipe`).
      r_range: range of r for the first stage.
      extrapolation: how r* at the final run's epsilon is read off the two stages
        (`pipelines.search.extrapolate`: "linear" as Panda et al., "clipped" to the searched
        range, or "log", a power law).
      steps_choices: T values a trial's r is decomposed over (lr = r / T).
      final_steps: T of the final run (default 300; None: the largest of `steps_choices`).
      optimizer: update rule (Panda et al.: "momentum", 0.9).
      clip_norm, loss: as for `run_probe`.
      normalization, groups: per-example feature normalization, as for `run_probe`; None
        (default) chooses it from the store's backbone (`pipelines.recipe`): GroupNorm over
        ScatterNet's channel groups, none otherwise. `groups` alone implies "group".
      standardize: standardize every feature with a privately released mean and scale
        (`probe.private_standardizer`, Tramer & Boneh's data normalization) after the
        per-example normalization; None (default): when that normalization bounds the norm of
        an example ("group" or "l2"), which the standardization's sensitivity needs.
      eps_standardize: budget of the standardization's two releases (default epsilon/10).
      selection: "train" (default), "holdout" or "public" (the default with a
        `public_validation`), see `pipelines.search`.
      validation_fraction: share of train held out with selection "holdout".
      public_validation: `npz:PATH` or (features, labels), public.
      seed: drives only data-independent randomness: the r proposals and the holdout split.
        Noise and counts always draw from OS entropy.
      out, save_model: write results JSON, and the final probe as a model file
        (`pipelines.model_files.tune_model`; `run_tune` only).
    """

    store: str
    epsilon: float
    delta: float = 1e-5
    eps0: float | None = None
    eps1: float | None = None
    eps_select: float | None = None
    trials: int = 5
    search: str = "auto"
    r_range: tuple[float, float] = (1.0, 1000.0)
    extrapolation: str = "clipped"
    steps_choices: tuple[int, ...] = (25, 50, 100)
    final_steps: int | None = 300
    optimizer: str = "momentum"
    loss: str = "softmax"
    clip_norm: float = 1.0
    normalization: str | None = None
    groups: int | None = None
    standardize: bool | None = None
    eps_standardize: float | None = None
    selection: str | None = None
    validation_fraction: float = 0.1
    public_validation: str | tuple[np.ndarray, np.ndarray] | None = None
    seed: int | None = None
    out: str | None = None
    save_model: str | None = None
    quiet: bool = False

    def __post_init__(self):
        epsilon = cfg.check_epsilon("epsilon", self.epsilon, allow_inf=False)
        selection = self.selection
        if self.public_validation is not None:
            if selection not in (None, "public"):
                raise ValueError(f"--public-validation scores trials exactly on public data; it "
                                 f"does not combine with --selection {selection}")
            selection = "public"
        elif selection == "public":
            raise ValueError("selection 'public' needs a public validation set "
                             "(--public-validation)")
        selection = selection or "train"
        if selection not in search.SELECTIONS:
            raise cfg.ConfigError("selection", f"must be one of {search.SELECTIONS}, got "
                                  f"{selection!r}")
        eps_select = self.eps_select
        if selection == "train":
            eps_select = epsilon / 20 if eps_select is None else eps_select
        elif eps_select is not None:
            raise ValueError(f"--eps-select applies to --selection train, not {selection}")
        budgets = {"eps0": epsilon / 20 if self.eps0 is None else self.eps0,
                   "eps1": epsilon / 10 if self.eps1 is None else self.eps1}
        if eps_select is not None:
            budgets["eps_select"] = eps_select
        if self.standardize is False:
            if self.eps_standardize is not None:
                raise ValueError("--eps-standardize is the budget of the standardization; it "
                                 "does not combine with --no-standardize")
        else:
            budgets["eps_standardize"] = (epsilon / 10 if self.eps_standardize is None
                                          else self.eps_standardize)
        budgets = {k: cfg.check_number(k, v, 0) for k, v in budgets.items()}
        budgets.setdefault("eps_select", None)
        budgets.setdefault("eps_standardize", None)
        low, high = (cfg.check_number("r_range", r, 0) for r in self.r_range)
        if not low < high:
            raise ValueError(f"--r-min ({low:g}) must be below --r-max ({high:g})")
        cfg.freeze(self, store=str(self.store), epsilon=epsilon,
                   delta=cfg.check_delta("delta", self.delta), selection=selection,
                   **budgets, r_range=(low, high),
                   steps_choices=cfg.check_ints("steps_choices", self.steps_choices),
                   clip_norm=cfg.check_number("clip_norm", self.clip_norm, 0),
                   validation_fraction=cfg.check_number(
                       "validation_fraction", self.validation_fraction, 0, 1, high_open=True))
        cfg.check_int("trials", self.trials)
        if self.final_steps is not None:
            cfg.check_int("final_steps", self.final_steps, 1, cfg.MAX_STEPS)
        if self.normalization is None and self.groups is not None:
            cfg.freeze(self, normalization="group")
        if self.normalization is not None:
            cfg.check_groups(self.groups, self.normalization)
        if self.standardize and self.normalization == "none":
            raise ValueError("--standardize needs a per-example normalization that bounds each "
                             "example's norm (--normalize group or l2), the sensitivity of its "
                             "released statistics")
        if self.extrapolation not in search.EXTRAPOLATIONS:
            raise cfg.ConfigError("extrapolation", f"must be one of {search.EXTRAPOLATIONS}, "
                                  f"got {self.extrapolation!r}")
        if self.search not in search.SEARCH_CHOICES:
            raise cfg.ConfigError("search", f"must be one of {search.SEARCH_CHOICES}, got "
                                  f"{self.search!r}")
        # Fails fast when the search budgets leave nothing for the final run.
        search.budget_split(self.epsilon, self.delta, self.eps0, self.eps1, self.eps_select,
                            self.eps_standardize)


def run_tune(config: TuneConfig | str, /, **options) -> dict:
    """`linear_scaling_search` on a store; writes results JSON (and the model file).

    Takes a `TuneConfig`, or the store and the config's fields as keywords.
    """
    config = cfg.make_config(TuneConfig, config, "store", **options)
    preflight.check_tune_job(config)
    results = linear_scaling_search(config)
    params, standardizer = results.pop("params"), results.pop("standardizer")
    if config.save_model:
        from pipelines import model_files

        model_files.tune_model(config, results, params, standardizer)
        results["model_file"] = str(config.save_model)
    if config.out:
        reporting.write_json(config.out, results)
    results["params"] = params
    return results


def linear_scaling_search(config: TuneConfig | str, epsilon: float | None = None,
                          delta: float | None = None, /, **options) -> dict:
    """Tune r = lr x T privately with the linear scaling rule, then train the final probe.

    `linear_scaling_search(TuneConfig(...))`, or `linear_scaling_search(store, epsilon, delta,
    ...)` with the config's other fields as keywords.

    Returns:
      A results dict: the chosen (lr, T, r), the fitted line, every trial with its (noisy)
      score, the final test accuracy and the ledger (its composition is the job's epsilon);
      plus "params", the final probe.
    """
    if not isinstance(config, TuneConfig):
        options |= {"epsilon": epsilon} if epsilon is not None else {}
        options |= {"delta": delta} if delta is not None else {}
    config = cfg.make_config(TuneConfig, config, "store", **options)
    start_time = time.perf_counter()
    rng = np.random.default_rng(config.seed)  # data-independent choices only

    # Inputs: the store; search or not (public quantities); what trains, what scores.
    data = steps.load_store(config)
    decision, public = steps.decide_search(config, data)
    parts = steps.split_data(config, data, public, decision.search, rng)

    # The probe and the budget of every mechanism; private standardization (in the ledger).
    spec = steps.probe_spec(config, data)
    budget, why = steps.plan_budget(config, spec, parts, decision.search)
    ledger = accounting.PrivacyLedger()
    standardization, parts = steps.standardize(spec, parts, budget, why, ledger)
    train = steps.trainer(parts, standardization, config.quiet)

    # Alg. 1: two searches, the line through their best r, r* at the final run's epsilon
    # (every trial and every count in the ledger); without a search, the default recipe's r.
    run_stage = steps.stage_runner(config, spec, parts, budget, train, ledger)
    line = steps.total_step_size(config, decision.search, run_stage, parts, budget, rng, ledger)

    # Alg. 1's final run: r* = lr x T on the remaining budget, then the (public) test split.
    final = steps.final_run(config, spec, data, parts, budget, line["r_star"], train, ledger)

    # Record: DP outputs and public inputs only.
    return steps.record(config, data, decision, parts, spec, standardization, budget, line,
                        final, ledger) | {"wall_seconds": time.perf_counter() - start_time}
