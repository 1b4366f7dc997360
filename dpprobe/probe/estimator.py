"""`DPLinearProbe`: the DP linear probe of `dpprobe probe` as a scikit-learn estimator, for
features a user already has (NumPy arrays) or a store's split.

One fit is one run of the probe job: the same recipe (`recipe.probe_recipe`: normalization,
optimizer, T and the linear scaling rule's learning rate from public quantities), the same
calibration (`accounting.calibrate_noise_multiplier`), the same trainers (`probe.train_probe`,
`probe.train_probe_poisson` for q < 1) with noise keys from OS entropy (`dp.make_keys`), and the
same model (`dpmodel.Model`: predictions come from the function a loaded model file uses).

Formal guarantee: the fitted parameters are (epsilon, delta)-DP for zero-out neighbours (one row
of (X, y) replaced by a null row; N public) with respect to the rows given to `fit`. Anything
the user computed from X or y before `fit` (a scaler, a PCA, a class list read off y) is not
covered; the classes are declared, never read off y.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.exceptions import NotFittedError

from dpprobe import accounting, extract, probe
from dpprobe import model as dpmodel
from dpprobe.accounting import records
from dpprobe.files import atomic_write_bytes
from dpprobe.probe import recipe

__all__ = ["DPLinearProbe"]


class DPLinearProbe(ClassifierMixin, BaseEstimator):
    """A differentially private linear classifier on fixed features (`dpprobe probe`, one run).

    The options are `dpprobe probe`'s, by their command-line names, for one run: one epsilon,
    one T (`steps`), one learning rate (`lr`). None chooses as the probe does, from public
    quantities only (the features' backbone when fit on a store, N, epsilon and delta).

    Args:
      epsilon: the target epsilon (> 0; `math.inf` trains the non-private reference: the same
        recipe without noise, no guarantee, never saved).
      delta: the target delta (well below 1/N).
      classes: the class labels, in logit order; `y` holds these values. Declared, never read
        off `y` (the set of labels present is a statistic of the private data).
      num_classes: C instead of `classes`: `y` holds 0..C-1. Fit on a store, both default to
        the store's declared class list.
      optimizer: as `dpprobe probe --optimizer`.
      steps: T, one value (`--steps`).
      lr: the learning rate, one value (`--lr`).
      loss: as `--loss`.
      clip_norm: C, as `--clip-norm`.
      accountant: as `--accountant`.
      normalize: as `--normalize`.
      groups: as `--groups`.
      bias_init: as `--bias-init`.
      sampling_probability: as `--sampling-probability`.
      physical_batch_size: as `--physical-batch-size` (memory only).
      quiet: no recipe line and no progress bar on stderr.

    Attributes (after `fit`):
      classes_: the declared classes; coef_ (d, C), intercept_ (C,): the released parameters
      (DP outputs); n_features_in_: d; privacy_: the `dpmodel.Privacy` claim; plan_: the
      `accounting.DpPlan` that ran; learning_rate_: the learning rate it trained with;
      recipe_: what was chosen and why (public inputs); model_: the `dpmodel.Model` that
      `save` writes and `predict` runs.
    """

    def __init__(self, epsilon: float, delta: float = 1e-5, *, classes=None,
                 num_classes: int | None = None, optimizer: str | None = None,
                 steps: int | None = None, lr: float | None = None, loss: str = "softmax",
                 clip_norm: float = 1.0, accountant: str = "pld", normalize: str | None = None,
                 groups: int | None = None, bias_init: float | None = None,
                 sampling_probability: float = 1.0, physical_batch_size: int = 256,
                 quiet: bool = False):
        self.epsilon = epsilon
        self.delta = delta
        self.classes = classes
        self.num_classes = num_classes
        self.optimizer = optimizer
        self.steps = steps
        self.lr = lr
        self.loss = loss
        self.clip_norm = clip_norm
        self.accountant = accountant
        self.normalize = normalize
        self.groups = groups
        self.bias_init = bias_init
        self.sampling_probability = sampling_probability
        self.physical_batch_size = physical_batch_size
        self.quiet = quiet

    # ------------------------------------------------------------------------------------------
    # Training

    def fit(self, X, y=None, *, split: str = "train") -> DPLinearProbe:
        """Train the probe on the private rows (X, y).

        Args:
          X: features (N, d), floating point (float64 is cast to float32, as the trainer
            computes); or the path of a feature store (`dpprobe extract`), whose `split` is read
            with its labels (then `y` is None).
          y: (N,) labels, each one of the declared classes.

        Returns:
          self, fitted.

        Raises:
          ValueError: options the probe refuses, X not (N, d), len(y) != N, or a label that is
            not a declared class. The last check reads the labels: it is for the data's owner,
            who runs `fit` (as `dpprobe verify --data`), not an output to publish.
        """
        if not float(self.epsilon) > 0:
            raise ValueError(f"epsilon must be > 0, got {self.epsilon!r}")
        features, labels, classes, attrs, store = self._training_data(X, y, split)
        num_examples = len(labels)
        ask = _RecipeAsk(self)
        chosen = recipe.probe_recipe(ask, attrs, num_examples)
        (num_steps,) = chosen.steps
        spec = probe.ProbeSpec(num_classes=len(classes), loss=self.loss,
                               optimizer=chosen.optimizer, bias_init=self.bias_init,
                               normalization=chosen.normalization, groups=chosen.groups or 1)
        q = float(self.sampling_probability)
        sigma = accounting.calibrate_noise_multiplier(
            self.epsilon, self.delta, steps=num_steps, sampling_probability=q,
            accountant=self.accountant)
        plan = accounting.DpPlan(sigma, num_steps, q, self.clip_norm)
        learning_rate = chosen.learning_rate(self.epsilon, num_steps, ask.given_lr)
        run = probe.RunSpec(plan, learning_rate)
        for warning in records.warnings(attrs, delta=self.delta, num_examples=num_examples):
            _say(f"warning: {warning}", self.quiet)
        _say(chosen.describe([self.epsilon]), self.quiet)

        # Train: the probe job's trainers, keys from OS entropy (JAX loads here, not on import).
        from dpprobe import dp

        keys = dp.make_keys(1)
        if q < 1.0:
            flags = probe.PerformanceFlags(physical_batch_size=self.physical_batch_size)
            trained = probe.train_probe_poisson(features, labels, [run], keys, spec,
                                                flags=flags, progress=not self.quiet)
        else:
            trained = probe.train_probe(features, labels, [run], keys, spec,
                                        progress=not self.quiet)

        # Record: DP outputs (the parameters) and public inputs only.
        ledger = accounting.PrivacyLedger()
        ledger.record(f"epsilon={self.epsilon:g} T={num_steps} lr={learning_rate:g}", plan,
                      role="final" if plan.is_private else "non-private reference")
        spent = plan.epsilon(self.delta, self.accountant)
        covers = ("NOTHING: the non-private reference (epsilon inf)" if not plan.is_private
                  else f"every record of the store's {split} split" if store
                  else "the rows of X and y given to fit (not any preprocessing fitted on them)")
        self.classes_ = classes
        self.coef_ = np.asarray(trained.params["w"][0], np.float32)
        self.intercept_ = np.asarray(trained.params["b"][0], np.float32)
        self.n_features_in_ = int(features.shape[-1])
        self.plan_, self.learning_rate_ = plan, learning_rate
        self.recipe_ = chosen.to_dict([self.epsilon])
        document = _header(classes) | dpmodel.linear_document(
            dim=self.n_features_in_, num_classes=len(classes), loss=spec.loss,
            normalization=spec.normalization, groups=spec.groups,
            feature_dtype=str(features.dtype)) | {
            "parameters": {"released": "final iterate"},
            "backbone": ({**extract.store.store_identity(attrs), "store": str(store)} if store
                         else None),
            "privacy": {"epsilon": spent, "delta": self.delta, "accountant": self.accountant,
                        "neighboring_relation": accounting.NEIGHBORING_RELATION,
                        "neighboring_relation_text": accounting.NEIGHBORING_RELATION_TEXT,
                        "dataset_size_public": True, "covers": covers,
                        "ledger": ledger.to_dict(self.delta, self.accountant)},
            "training": {"recipe": spec.to_dict(), "chosen": self.recipe_,
                         "learning_rate": learning_rate, "steps": num_steps,
                         "noise_multiplier": sigma, "clip_norm": plan.clip_norm,
                         "sampling_probability": q, "num_train": num_examples},
        }
        arrays = dpmodel.linear_arrays(self.coef_, self.intercept_)
        self.model_ = dpmodel.Model("DPLinearProbe (in memory)", arrays,
                                    dpmodel.file_document(arrays, document))
        self.privacy_ = self.model_.privacy
        return self

    def _training_data(self, X, y, split: str):
        """(features, label indices, classes, store attrs, store path or None)."""
        if isinstance(X, str | os.PathLike):
            if y is not None:
                raise ValueError("fit on a store reads its labels: pass y=None")
            features, labels, attrs = extract.load_split(X, split, dtype=None)
            classes = self._declared(attrs.get("class_names"))
            if attrs.get("num_classes") != len(classes):
                raise ValueError(f"the store declares {attrs.get('num_classes')} classes, the "
                                 f"probe {len(classes)}")
            return features, labels, classes, attrs, os.fspath(X)
        classes = self._declared(None)
        features = _features(X)
        if y is None:
            raise ValueError("fit(X, y) needs the labels y")
        labels = _label_indices(y, classes)
        if len(labels) != len(features):
            raise ValueError(f"X has {len(features)} rows but y has {len(labels)} labels")
        return features, labels, classes, {}, None

    def _declared(self, store_classes) -> np.ndarray:
        """The declared classes: `classes`, else 0..`num_classes`-1, else the store's."""
        if self.classes is not None:
            classes = np.asarray(self.classes)
            if classes.ndim != 1 or len(set(classes.tolist())) != len(classes):
                raise ValueError(f"classes must be distinct labels, got {self.classes!r}")
            if self.num_classes is not None and self.num_classes != len(classes):
                raise ValueError(f"num_classes={self.num_classes} but {len(classes)} classes")
        elif self.num_classes is not None:
            if not (isinstance(self.num_classes, int | np.integer) and self.num_classes >= 2):
                raise ValueError(f"num_classes must be an integer >= 2, got {self.num_classes!r}")
            classes = np.arange(self.num_classes)
        elif store_classes is not None:
            classes = np.asarray(store_classes)
        else:
            raise ValueError("declare the classes: DPLinearProbe(classes=[...]) or "
                             "num_classes=C (reading them off y would leak which labels occur)")
        if store_classes is not None and [str(c) for c in classes] != [
                str(c) for c in store_classes]:
            raise ValueError(f"classes {classes.tolist()} differ from the store's "
                             f"{list(store_classes)}")
        if len(classes) < 2:
            raise ValueError(f"a classifier needs at least 2 classes, got {len(classes)}")
        return classes

    # ------------------------------------------------------------------------------------------
    # Predictions (post-processing of the released parameters)

    @property
    def privacy(self) -> dpmodel.Privacy:
        """The fitted model's claim: (epsilon, delta)-DP for zero-out neighbours, by the
        accountant, with its ledger."""
        return self._fitted().privacy

    def decision_function(self, X, *, split: str = "test") -> np.ndarray:
        """Logits (n, C) of features (n, d), a store's `split`, or images (a probe fit on a
        store whose backbone is recorded)."""
        return self._fitted().logits(self._inputs(X, split))

    def predict_proba(self, X, *, split: str = "test") -> np.ndarray:
        """Class probabilities (n, C): softmax, or per-class sigmoids (loss "sigmoid")."""
        return self._fitted().probabilities(self.decision_function(X, split=split))

    def predict(self, X, *, split: str = "test") -> np.ndarray:
        """The predicted classes (n,), values of `classes_` (argmax; ties to the lower
        index)."""
        classes = self._fitted_classes()
        return classes[np.argmax(self.decision_function(X, split=split), axis=-1)]

    def score(self, X, y=None, *, split: str = "test") -> float:
        """Accuracy on (X, y), or on a store's `split` (then y is None). On public or held-out
        data it is post-processing; on the training rows it is not DP."""
        if isinstance(X, str | os.PathLike):
            if y is not None:
                raise ValueError("score on a store reads its labels: pass y=None")
            features, labels, _ = extract.load_split(X, split, dtype=None)
            hits = np.argmax(self.decision_function(features), -1) == labels
            valid = labels >= 0  # a null record (a defect the store kept) is not scored
            return float(np.mean(hits[valid])) if valid.any() else math.nan
        labels = _label_indices(y, self._fitted_classes())
        logits = self.decision_function(X)
        if len(labels) != len(logits):
            raise ValueError(f"X has {len(logits)} rows but y has {len(labels)} labels")
        return float(np.mean(np.argmax(logits, -1) == labels))

    def save(self, path: str | os.PathLike) -> str:
        """Write the model file (`dpprobe.load_model` reads it; `dpprobe predict` and `export`
        take it). Returns the path written."""
        model = self._fitted()
        if not self.plan_.is_private:
            raise ValueError("the non-private reference (epsilon inf) has no guarantee; it is "
                             "not written as a model file")
        atomic_write_bytes(path, dpmodel.encode_model(model.arrays, model.document))
        return os.fspath(path)

    def _fitted(self) -> dpmodel.Model:
        if not hasattr(self, "model_"):
            raise NotFittedError("this DPLinearProbe is not fitted yet: call fit(X, y) first")
        return self.model_

    def _fitted_classes(self) -> np.ndarray:
        self._fitted()
        return self.classes_

    def _inputs(self, X, split: str):
        """Features (n, d) checked against the fit, a store split's features, or images."""
        if isinstance(X, str | os.PathLike):
            features, _, _ = extract.load_split(X, split, dtype=None)
            return self._check_dim(features)
        array = X if isinstance(X, np.ndarray) else None
        if isinstance(X, list | tuple) and X and isinstance(X[0], list | tuple | np.ndarray):
            array = np.asarray(X)  # rows of numbers
        if array is not None and array.ndim == 2:
            return self._check_dim(_features(array))
        return X  # images: the model's recorded backbone embeds them (or says it has none)

    def _check_dim(self, features: np.ndarray) -> np.ndarray:
        if features.shape[-1] != self.n_features_in_:
            raise ValueError(f"X has {features.shape[-1]} features, the probe was fit on "
                             f"{self.n_features_in_}")
        return features


class _RecipeAsk:
    """What `recipe.probe_recipe` reads off a probe config, from the estimator's options."""

    def __init__(self, estimator: DPLinearProbe):
        normalization, groups = estimator.normalize, estimator.groups
        if normalization is None and groups is not None:
            normalization = "group"  # as the CLI: --groups alone means --normalize group
        self.normalization, self.groups = normalization, groups
        self.optimizer = estimator.optimizer
        self.steps = None if estimator.steps is None else (int(estimator.steps),)
        self.given_lr = None if estimator.lr is None else float(estimator.lr)
        self.learning_rates = None if self.given_lr is None else (self.given_lr,)
        self.delta = float(estimator.delta)
        self.sampling_probability = float(estimator.sampling_probability)


def _header(classes) -> dict:
    """What a model file's description begins with (as the jobs' files)."""
    return {"dpprobe_version": records.VERSION, "job": "DPLinearProbe",
            "class_names": [str(c) for c in np.asarray(classes).tolist()]}


def _features(X) -> np.ndarray:
    """X as (n, d) floating-point features (shape and dtype only: values are private)."""
    features = np.asarray(X)
    if features.ndim != 2:
        raise ValueError(f"X must be features of shape (n, d), got shape {features.shape}")
    if features.dtype not in (np.float16, np.float32):
        if not (np.issubdtype(features.dtype, np.floating)
                or np.issubdtype(features.dtype, np.integer)):
            raise ValueError(f"X must hold numbers, got {features.dtype}")
        features = features.astype(np.float32)
    return features


def _label_indices(y, classes: np.ndarray) -> np.ndarray:
    """Each label's index in `classes`; ValueError naming a label that is not declared."""
    labels = np.asarray(y)
    if labels.ndim != 1:
        raise ValueError(f"y must be 1-D labels, got shape {labels.shape}")
    index = {c: i for i, c in enumerate(classes.tolist())}
    try:
        out = np.fromiter((index.get(label, -1) for label in labels.tolist()), np.int32,
                          len(labels))
    except TypeError as err:  # an unhashable label
        raise ValueError(f"y holds labels that are not classes: {err}") from err
    if (out < 0).any():
        unknown = labels[out < 0]
        raise ValueError(f"y holds {len(unknown)} label(s) outside the declared classes "
                         f"(e.g. {unknown[0]!r}); declare every class in `classes` or "
                         "`num_classes`")
    return out


def _say(line: str, quiet: bool) -> None:
    if not quiet:
        print(line, file=sys.stderr, flush=True)
