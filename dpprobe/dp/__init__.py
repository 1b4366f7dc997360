"""dpprobe's DP mechanism, for any model: JAX, imports only `accounting`.

  * `dp.noise`: secret keys from OS entropy, the Gaussian sampler (no hard float32 support),
    noise for any pytree;
  * `dp.sampling`: Poisson batch selection (jax_privacy) and the one pad-and-mask helper;
  * `dp.clipping`: the clipper interface (params, batch, C, mask) -> (clipped sum, norms), null
    records, and the general per-example clipper (`jax_privacy.clipped_grad`);
  * `dp.bookkeeping`: book-keeping clipping of whole NNX networks (ghost norms, Bu et al.
    2023): one forward and one backward pass, layer rules in `dp.taps` (Flax's `nnx.Conv` in
    `dp.flax_rules`), its rounding-safe norm bounds in `dp.norm_bounds`;
  * `dp.norms`: per-example gradient norms of a dense layer from its inputs and output
    gradients (the ghost norm), bounded under float32 rounding; the linear probe's closed
    form is its one-layer case;
  * `dp.accumulate`: float64 and compensated sums of clipped gradients (over rows, chunks,
    physical batches), so that one example moves the computed sum by at most C (1 + 1e-6);
  * `dp.optimizers`: the privatizer as an optax transformation, and the DP step as
    `optax.chain(privatizer(stddev, key), optax.scale(1 / expected_batch_size), optimizer)`
    with any optax optimizer and schedule;
  * `dp.auditing`: lower bounds on epsilon from canary scores, for any trainer;
  * `dp.canaries`, `dp.canary_rows`: the white-box audit's Dirac gradient canaries on the
    model's own coordinates, inside both clippers, and their one-run bound and estimate.

`probe/` (the linear probe) and `finetune/` (whole networks) both stand on it; neither imports
the other.

Every name is imported on first use (PEP 562), so that importing one module of `dp` (the
probe's sums, noise and optimizers) loads neither SciPy (`dp.auditing`) nor Flax
(`dp.bookkeeping`).
"""

import importlib

_LAZY = {
    "CompensatedSum": "dpprobe.dp.accumulate",
    "add_float64": "dpprobe.dp.accumulate",
    "add_parts": "dpprobe.dp.accumulate",
    "row_block_sum": "dpprobe.dp.accumulate",
    "x64_jit": "dpprobe.dp.accumulate",
    "AuditBounds": "dpprobe.dp.auditing",
    "audit_bounds": "dpprobe.dp.auditing",
    "choose_thresholds": "dpprobe.dp.auditing",
    "empirical_auroc": "dpprobe.dp.auditing",
    "gdp_mu_bounds": "dpprobe.dp.auditing",
    "one_run_epsilon_bound": "dpprobe.dp.auditing",
    "tradeoff_curve": "dpprobe.dp.auditing",
    "bookkeeping_clipper": "dpprobe.dp.bookkeeping",
    "ClippedSum": "dpprobe.dp.clipping",
    "Clipper": "dpprobe.dp.clipping",
    "NULL_LABEL": "dpprobe.dp.clipping",
    "null_if_nonfinite": "dpprobe.dp.clipping",
    "per_example_clipper": "dpprobe.dp.clipping",
    "valid_labels": "dpprobe.dp.clipping",
    "zero_nonfinite_rows": "dpprobe.dp.clipping",
    "add_noise": "dpprobe.dp.noise",
    "gaussian_noise": "dpprobe.dp.noise",
    "make_keys": "dpprobe.dp.noise",
    "noise_stddev": "dpprobe.dp.noise",
    "dense_grad_norms": "dpprobe.dp.norms",
    "input_gram": "dpprobe.dp.norms",
    "DEFAULT_LEARNING_RATES": "dpprobe.dp.optimizers",
    "OPTIMIZERS": "dpprobe.dp.optimizers",
    "make_optimizer": "dpprobe.dp.optimizers",
    "private_optimizer": "dpprobe.dp.optimizers",
    "privatizer": "dpprobe.dp.optimizers",
    "PoissonStep": "dpprobe.dp.sampling",
    "pad_rows": "dpprobe.dp.sampling",
    "poisson_batches": "dpprobe.dp.sampling",
}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "DEFAULT_LEARNING_RATES",
    "NULL_LABEL",
    "OPTIMIZERS",
    "AuditBounds",
    "ClippedSum",
    "Clipper",
    "CompensatedSum",
    "PoissonStep",
    "add_float64",
    "add_noise",
    "add_parts",
    "audit_bounds",
    "bookkeeping_clipper",
    "choose_thresholds",
    "dense_grad_norms",
    "empirical_auroc",
    "gaussian_noise",
    "gdp_mu_bounds",
    "input_gram",
    "make_keys",
    "make_optimizer",
    "noise_stddev",
    "null_if_nonfinite",
    "one_run_epsilon_bound",
    "pad_rows",
    "per_example_clipper",
    "poisson_batches",
    "private_optimizer",
    "privatizer",
    "row_block_sum",
    "tradeoff_curve",
    "valid_labels",
    "x64_jit",
    "zero_nonfinite_rows",
]
