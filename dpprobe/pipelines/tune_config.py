"""What a tune job is asked: `TuneConfig`, its fields' checks and command-line options."""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from dpprobe import checks
from dpprobe.options import (
    OPTIMIZERS,
    RangeEnd,
    delta_option,
    flag,
    integer,
    integers,
    number,
    option,
)
from dpprobe.pipelines.probe_config import (
    clip_norm_option,
    groups_option,
    loss_option,
    normalization_option,
    store_option,
)
from dpprobe.probe import search
from dpprobe.probe.search import EXTRAPOLATIONS, SEARCH_CHOICES

__all__ = ["CLI_SELECTIONS", "TuneConfig"]

# The selections a command line offers: "public" follows from --public-validation.
CLI_SELECTIONS = tuple(s for s in search.SELECTIONS if s != "public")


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
      search: "auto" (default: search when it pays, `probe.search.decide_search`, from
        public quantities), "random" (log-uniform r), "grid" (geometric grid of r), or "none"
        (spend the whole budget on the default recipe's r, `probe.recipe`).
      r_range: range of r for the first stage.
      extrapolation: how r* at the final run's epsilon is read off the two stages
        (`probe.search.extrapolate`: "linear" as Panda et al., "clipped" to the searched
        range, or "log", a power law).
      steps_choices: T values a trial's r is decomposed over (lr = r / T).
      final_steps: T of the final run (default 300; None: the largest of `steps_choices`).
      optimizer: update rule (Panda et al.: "momentum", 0.9).
      clip_norm, loss: as for `run_probe`.
      normalization, groups: per-example feature normalization, as for `run_probe`; None
        (default) chooses it from the store's backbone (`probe.recipe`): GroupNorm over
        ScatterNet's channel groups, none otherwise. `groups` alone implies "group".
      standardize: standardize every feature with a privately released mean and scale
        (`probe.private_standardizer`, Tramer & Boneh's data normalization) after the
        per-example normalization; None (default): when that normalization bounds the norm of
        an example ("group" or "l2"), which the standardization's sensitivity needs, and the
        mean's noise per feature is at most 0.25 (`probe.recipe.decide_standardization`).
      eps_standardize: budget of the standardization's two releases (default epsilon/10).
      selection: "train" (default), "holdout" or "public" (the default with a
        `public_validation`), see `probe.search`.
      validation_fraction: share of train held out with selection "holdout".
      public_validation: `npz:PATH` or (features, labels), public.
      seed: drives only data-independent randomness: the r proposals and the holdout split.
        Noise and counts always draw from OS entropy.
      out, save_model: write results JSON, and the final probe as a model file
        (`dpprobe.model_files.tune_model`; `run_tune` only).
    """

    store: str = store_option()
    epsilon: float = option(type=number, help="total epsilon, tuning included")
    delta: float = delta_option("delta")
    eps0: float | None = option(
        None, type=number, help="budget of the first search stage (default epsilon/20)")
    eps1: float | None = option(
        None, type=number, help="budget of the second search stage (default epsilon/10)")
    eps_select: float | None = option(
        None, type=number, help="budget of the noisy selection counts with --selection train "
        "(default epsilon/20)")
    trials: int = option(5, type=integer, help="trials per stage (default %(default)s)")
    search: str = option(
        "auto", choices=SEARCH_CHOICES, help="auto: search when "
        "N and epsilon let it tell r apart, else spend all on the default r (default); random "
        "(log-uniform) or grid search over r; none: never search")
    r_range: tuple[float, float] = option((1.0, 1000.0), flags=(
        flag("--r-min", type=number, action=RangeEnd, end=0,
             help="smallest r of stage 0 (default 1)"),
        flag("--r-max", type=number, action=RangeEnd, end=1,
             help="largest r of stage 0 (default 1000)")))
    extrapolation: str = option(
        "clipped", choices=EXTRAPOLATIONS, help="how r* is read "
        "off the two stages: Panda et al.'s line (linear), the line clipped to the searched r "
        "range (clipped), or a power law (log)")
    steps_choices: tuple[int, ...] = option(
        (25, 50, 100), type=integers, help="T values r is decomposed over, lr = r / T "
        "(default 25,50,100)")
    final_steps: int | None = option(300, type=integer,
                                     help="T of the final run (default %(default)s)")
    optimizer: str = option("momentum", choices=OPTIMIZERS, metavar="NAME", help="%(choices)s: "
                            "update rule (default momentum 0.9, as Panda et al.)")
    loss: str = loss_option()
    clip_norm: float = clip_norm_option()
    normalization: str | None = normalization_option()
    groups: int | None = groups_option()
    standardize: bool | None = option(
        None, action=argparse.BooleanOptionalAction, help="standardize each feature with a "
        "privately released mean and scale (Tramer & Boneh), paid from --eps-standardize "
        "(default: on after group or l2 normalization, unless the noise per feature would "
        "exceed 0.25)")
    eps_standardize: float | None = option(
        None, type=number, help="budget of the standardization (default epsilon/10)")
    selection: str | None = option(
        None, choices=CLI_SELECTIONS, help="how trials are "
        "scored, privately: noisy correct counts on the training data, paid from --eps-select "
        "(train, default), or on a held-out part of train that composes in parallel (holdout)")
    validation_fraction: float = option(
        0.1, type=number, help="share of train held out with --selection holdout "
        "(default %(default)s)")
    public_validation: str | tuple[np.ndarray, np.ndarray] | None = option(
        None, metavar="npz:PATH", help="score trials exactly on this PUBLIC validation set "
        "(features in the store's feature space, labels): costs no privacy")
    seed: int | None = option(
        None, type=integer, help="seed the r proposals and the holdout split (never the noise, "
        "which always draws from OS entropy; the seed is not written to results)")
    out: str | None = option(None, help="write results JSON (with the ledger) here")
    save_model: str | None = option(None, "--save-model", "--model",
                                    help="write the model file here")
    quiet: bool = option(False, action="store_true", help="no progress output")

    def __post_init__(self):
        epsilon = checks.check_epsilon("epsilon", self.epsilon, allow_inf=False)
        selection = self.selection
        if self.public_validation is not None:
            if selection not in (None, "public"):
                raise ValueError(f"`public_validation` scores trials exactly on public data; it "
                                 f"does not combine with `selection={selection}`")
            selection = "public"
        elif selection == "public":
            raise ValueError("selection 'public' needs a public validation set "
                             "(`public_validation`)")
        selection = selection or "train"
        if selection not in search.SELECTIONS:
            raise checks.ConfigError("selection", f"must be one of {search.SELECTIONS}, got "
                                  f"{selection!r}")
        eps_select = self.eps_select
        if selection == "train":
            eps_select = epsilon / 20 if eps_select is None else eps_select
        elif eps_select is not None:
            raise ValueError(f"`eps_select` applies to `selection=train`, not {selection}")
        budgets = {"eps0": epsilon / 20 if self.eps0 is None else self.eps0,
                   "eps1": epsilon / 10 if self.eps1 is None else self.eps1}
        if eps_select is not None:
            budgets["eps_select"] = eps_select
        if self.standardize is False:
            if self.eps_standardize is not None:
                raise ValueError("`eps_standardize` is the budget of the standardization; it "
                                 "does not combine with `standardize=False`")
        else:
            budgets["eps_standardize"] = (epsilon / 10 if self.eps_standardize is None
                                          else self.eps_standardize)
        budgets = {k: checks.check_number(k, v, 0) for k, v in budgets.items()}
        budgets.setdefault("eps_select", None)
        budgets.setdefault("eps_standardize", None)
        low, high = (checks.check_number("r_range", r, 0) for r in self.r_range)
        if not low < high:
            raise checks.ConfigError("r_range", f"the low end ({low:g}) must be below the high end "
                                  f"({high:g})")
        checks.freeze(self, store=str(self.store), epsilon=epsilon,
                   delta=checks.check_delta("delta", self.delta), selection=selection,
                   **budgets, r_range=(low, high),
                   steps_choices=checks.check_ints("steps_choices", self.steps_choices),
                   clip_norm=checks.check_number("clip_norm", self.clip_norm, 0),
                   validation_fraction=checks.check_number(
                       "validation_fraction", self.validation_fraction, 0, 1, high_open=True))
        checks.check_int("trials", self.trials)
        checks.check_optional_ints(self, ("final_steps",), 1, checks.MAX_STEPS)
        checks.check_groups(self)
        if self.standardize and self.normalization == "none":
            raise ValueError("`standardize=True` needs a per-example normalization that bounds "
                             "each example's norm (`normalization` group or l2), the sensitivity "
                             "of its released statistics")
        if self.extrapolation not in search.EXTRAPOLATIONS:
            raise checks.ConfigError("extrapolation", f"must be one of {search.EXTRAPOLATIONS}, "
                                  f"got {self.extrapolation!r}")
        if self.search not in search.SEARCH_CHOICES:
            raise checks.ConfigError("search", f"must be one of {search.SEARCH_CHOICES}, got "
                                  f"{self.search!r}")
        # Fails fast when the search budgets leave nothing for the final run.
        search.budget_split(self.epsilon, self.delta, self.eps0, self.eps1, self.eps_select,
                            self.eps_standardize)
