"""dpprobe's DP mechanism, for any model: JAX, imports only `accounting`.

  * `dp.noise`: secret keys from OS entropy, the Gaussian sampler (no hard float32 support),
    noise for any pytree;
  * `dp.sampling`: Poisson batch selection (jax_privacy) and the one pad-and-mask helper;
  * `dp.clipping`: the clipper interface (params, batch, C, mask) -> (clipped sum, norms), null
    records, and the general per-example clipper (`jax_privacy.clipped_grad`);
  * `dp.bookkeeping`: book-keeping clipping of whole NNX networks (ghost norms, Bu et al.
    2023): one forward and one backward pass, layer rules in `dp.taps`, its rounding-safe
    norm bounds in `dp.norm_bounds`;
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
"""

from dpprobe.dp.accumulate import CompensatedSum, add_float64, add_parts, row_block_sum, x64_jit
from dpprobe.dp.auditing import (
    AuditBounds,
    audit_bounds,
    choose_thresholds,
    empirical_auroc,
    gdp_mu_bounds,
    one_run_epsilon_bound,
    tradeoff_curve,
)
from dpprobe.dp.bookkeeping import bookkeeping_clipper
from dpprobe.dp.clipping import (
    NULL_LABEL,
    ClippedSum,
    Clipper,
    null_if_nonfinite,
    per_example_clipper,
    valid_labels,
    zero_nonfinite_rows,
)
from dpprobe.dp.noise import add_noise, gaussian_noise, make_keys, noise_stddev
from dpprobe.dp.norms import dense_grad_norms, input_gram
from dpprobe.dp.optimizers import (
    DEFAULT_LEARNING_RATES,
    OPTIMIZERS,
    make_optimizer,
    private_optimizer,
    privatizer,
)
from dpprobe.dp.sampling import PoissonStep, pad_rows, poisson_batches

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
