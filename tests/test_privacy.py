"""What the guarantee needs: every published leaf is a DP output or a public input, every
example's contribution stays within C on every trainer path, and the noise is secret and has no
hard float32 support."""

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpprobe import accounting, dp, probe
from dpprobe.model import read_model_file
from dpprobe.pipelines import cli

# --------------------------------------------------------------------------------------------
# Neighbour test: a job on D and on D minus one row; only DP outputs may differ.
# --------------------------------------------------------------------------------------------

# Leaves allowed to differ: DP outputs (functions of the noised models and noisy scores) and
# the dataset size N (public under zero-out neighbours; removing a row changes it, replacing a
# row by a null record does not). No time: a run's duration and the store's created/completed
# times depend on the records (the owner's timing file has them, `dpprobe.timings`).
ALLOWED = [
    r"runs\[\*\]\.(test_accuracy|test_top5_accuracy|per_class_accuracy\[\*\]|learning_rate)",
    r"summary\[\*\]\.test_(top5_)?accuracy_(mean|std)",
    r"stages\[\*\]\.(best_r|trials\[\*\]\.(score|r|learning_rate))",
    r"line\.(alpha|b|exponent|r_star|r_line|clipped|fallback_used|searched\[\*\])",
    r"chosen\.(r|learning_rate)",
    r"final\.(test_accuracy|test_top5_accuracy|per_class_accuracy\[\*\])",
    r"ledger\.entries\[\*\]\.(r|learning_rate)",
    r"(num_train|provenance\.train\.(num_examples|dataset\.num_examples))",
    r"selection\.(num_scored|num_trained)",
    r"standardization\.(clip_norms\[\*\]|floor|num_floored)",  # from the released mean, N
    # The defaults' learning rates are a function of N (public): r = 0.011 mu N (recipe.py).
    r"recipe\.(num_examples|learning_rates\.[\w.]+\[\*\])", r"summary\[\*\]\.learning_rate",
    r"ledger\.entries\[\*\]\.name",  # a probe run's name holds its learning rate
    r"search\.(decision|score_noise)",  # tune's decisions: from N and the budgets
    r"standardization\.decision",
]


def _differing_leaves(a, b, path=""):
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            sub = f"{path}.{key}" if path else key
            if key not in a or key not in b:
                yield sub
            else:
                yield from _differing_leaves(a[key], b[key], sub)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for item_a, item_b in zip(a, b, strict=True):
            yield from _differing_leaves(item_a, item_b, f"{path}[*]")
    elif a != b:
        yield path


def _store(directory, features, labels, test_features, test_labels, monkeypatch):
    """emb.zarr in `directory` (same relative paths for D and D', so public inputs match)."""
    directory.mkdir()
    monkeypatch.chdir(directory)
    names = np.array(["a", "b", "c", "d"])
    np.savez("emb.npz", features=features, labels=labels, class_names=names)
    np.savez("test.npz", features=test_features, labels=test_labels, class_names=names)
    for split, source in (("train", "emb.npz"), ("test", "test.npz")):
        assert cli.main(["extract", "--backbone", "none", "--data", f"npz:{source}",
                         "--split", split, "--out", "emb.zarr", "--dtype", "float32",
                         "--quiet"]) == 0


@pytest.fixture(scope="module")
def neighbours():
    """D: 240 rows, 4 classes; the removed row is the only one of class 3 and has a huge norm
    (so it is clipped), i.e. it moves every exact statistic an earlier version published."""
    rng = np.random.default_rng(0)
    features = rng.normal(size=(240, 16)).astype(np.float32)
    labels = rng.integers(0, 3, size=240)
    features[17] *= 1e3
    labels[17] = 3
    test_features = rng.normal(size=(80, 16)).astype(np.float32)
    test_labels = rng.integers(0, 4, size=80)
    keep = np.arange(240) != 17
    return ((features, labels), (features[keep], labels[keep]), (test_features, test_labels))


@pytest.mark.parametrize("job", [
    ["probe", "emb.zarr", "--epsilons", "1,4", "--seeds", "2", "--optimizer", "momentum",
     "--steps", "5", "--lr", "0.5"],
    ["probe", "emb.zarr", "--epsilons", "2", "--seeds", "2", "-q", "0.3", "--steps", "4",
     "--optimizer", "sgd", "--lr", "1", "--physical-batch-size", "32"],
    ["probe", "emb.zarr", "--epsilons", "1,inf", "--seeds", "2"],  # the defaults, from N
    ["tune", "emb.zarr", "--epsilon", "2", "--trials", "2", "--steps-choices", "3,6",
     "--r-max", "30", "--seed", "3", "--search", "random"],
    ["tune", "emb.zarr", "--epsilon", "2", "--trials", "2", "--steps-choices", "3,6",
     "--r-max", "30", "--seed", "3", "--normalize", "group", "--groups", "4", "--standardize",
     "--search", "random"],
    ["tune", "emb.zarr", "--epsilon", "2", "--final-steps", "5", "--normalize", "group",
     "--groups", "4"],  # too small to search: the default recipe's r, from N
], ids=["probe-full-batch", "probe-poisson", "probe-defaults", "tune", "tune-standardized",
        "tune-no-search"])
def test_job_on_neighbouring_datasets_differs_only_in_dp_outputs(job, neighbours, tmp_path,
                                                                 monkeypatch):
    (d, d_minus), test = neighbours[:2], neighbours[2]
    outputs = []
    for name, (features, labels) in (("D", d), ("D_minus_one_row", d_minus)):
        _store(tmp_path / name, features, labels, *test, monkeypatch)
        assert cli.main([*job, "--delta", "1e-4", "--out", "results.json", "--quiet"]) == 0
        outputs.append(json.loads((tmp_path / name / "results.json").read_text()))
    differing = sorted(set(_differing_leaves(*outputs)))
    assert differing, "the two runs should differ somewhere (the noise, at least)"
    leaked = [p for p in differing if not any(re.fullmatch(a, p) for a in ALLOWED)]
    assert not leaked, f"non-DP leaves differ between D and D minus one row: {leaked}"


# The model files (`probe --save-model`, `tune --save-model`): their descriptions may differ
# only in DP outputs, N and what follows from them (no time); the arrays are DP outputs (the
# noised head, the released standardization).
MODEL_ALLOWED = [
    r"training\.reported\.(test_accuracy|test_top5_accuracy)",
    r"training\.num_train", r"backbone\.train_split\.num_examples",
    r"backbone\.train_split\.dataset\.num_examples",
    r"training\.(chosen\.(r|learning_rate)|line\.(alpha|b|exponent|r_star|clipped|"
    r"fallback_used|searched\[\*\]))",
    r"privacy\.ledger\.entries\[\*\]\.(r|learning_rate)",
    r"transforms\[\*\]\.(clip_norms\[\*\]|floor|num_floored|plan\.(r|learning_rate))",
]


@pytest.mark.parametrize("job", [
    ["probe", "emb.zarr", "--epsilons", "1,4", "--seeds", "2", "--optimizer", "momentum",
     "--steps", "5", "--lr", "0.5", "--save-model", "models"],
    ["tune", "emb.zarr", "--epsilon", "2", "--trials", "2", "--steps-choices", "3,6",
     "--r-max", "30", "--seed", "3", "--normalize", "group", "--groups", "4", "--standardize",
     "--save-model", "models/tuned.safetensors"],
], ids=["probe", "tune-standardized"])
def test_model_files_on_neighbouring_datasets_differ_only_in_dp_outputs(job, neighbours,
                                                                       tmp_path, monkeypatch):
    (d, d_minus), test = neighbours[:2], neighbours[2]
    documents = []
    for name, (features, labels) in (("D", d), ("D_minus_one_row", d_minus)):
        _store(tmp_path / name, features, labels, *test, monkeypatch)
        assert cli.main([*job, "--delta", "1e-4", "--quiet"]) == 0
        files = sorted((tmp_path / name / "models").iterdir())
        assert files
        documents.append({f.name: read_model_file(f)[1] for f in files})
        text = json.dumps(documents[-1])
        assert "fingerprint" not in text and "clipped_fraction" not in text
    assert documents[0].keys() == documents[1].keys()
    for file in documents[0]:
        differing = sorted(set(_differing_leaves(documents[0][file], documents[1][file])))
        leaked = [p for p in differing if not any(re.fullmatch(a, p) for a in MODEL_ALLOWED)]
        assert not leaked, f"{file}: non-DP leaves differ between D and D minus one row: {leaked}"


# --------------------------------------------------------------------------------------------
# Leave-one-out sensitivity, on every trainer path.
# --------------------------------------------------------------------------------------------


# The leave-one-out contract of every clipper and trainer: tests/contract.py.


def test_selection_counts_never_count_null_records(rng):
    """The selection counts have sensitivity 1 only if a null record (NaN features, a label
    outside the class set) never counts as correct, whatever the model predicts."""
    features = rng.normal(size=(30, 4)).astype(np.float32)
    labels = np.arange(30) % 3
    params = {"w": rng.normal(size=(2, 4, 3)).astype(np.float32), "b": np.zeros((2, 3), np.float32)}
    base = probe.correct_counts(params, features, labels)
    nulled, bad = labels.copy(), features.copy()
    nulled[[1, 2]] = [-1, 7]
    bad[[1, 2]] = np.nan
    for x, y in ((features, nulled), (bad, labels)):
        counts = probe.correct_counts(params, x, y)
        hits = probe.correct_counts(params, features[[1, 2]], labels[[1, 2]])
        np.testing.assert_array_equal(counts, base - hits)


def test_clipper_keeps_antipodal_views_within_c_at_random_params(rng):
    """At random (non-zero) parameters, with cancelling views: the closed form's contribution,
    recomputed exactly in float64 from the per-view gradients, is at most C."""
    params = {"w": rng.normal(size=(1, 6, 3)).astype(np.float32) * 1e-6,
              "b": rng.normal(size=(1, 3)).astype(np.float32)}
    for scale in (1e3, 1e4, 3e4):
        x = rng.normal(size=(1, 2, 6))
        x[0, 1] = -x[0, 0] * (1 + 1e-4)
        x = (x / np.linalg.norm(x[0, 0]) * scale).astype(np.float32)
        onehot = jax.nn.one_hot(jnp.array([1]), 3)
        sums, _ = probe.clipped_grad_sum(params, x, onehot, jnp.array([1.0]), loss="softmax")
        contribution = np.concatenate([np.asarray(sums["w"], np.float64).ravel(),
                                       np.asarray(sums["b"], np.float64).ravel()])
        assert np.linalg.norm(contribution) <= 1.0 + 1e-6, scale


@pytest.mark.parametrize("loss", ["softmax", "sigmoid"])
@pytest.mark.parametrize("views", [1, 2])
def test_tiny_residuals_do_not_flush_the_norm_to_zero(loss, views):
    """At parameters where a row's residual is ~1e-20 (its square flushes to zero in float32),
    a feature norm near 1.8e19 must still be clipped: the contribution stays within C."""
    for gap in (46.0, 50.0, 60.0):
        first = gap if loss == "sigmoid" else 0.0  # the true class's residual is tiny too
        params = {"w": jnp.zeros((1, 4, 3), jnp.float32),
                  "b": jnp.array([[first, -gap, -gap]], jnp.float32)}
        x = np.zeros((1, views, 4), np.float32)
        x[0, :, 0] = 1.8e19
        for clip in (0.1, 1.0):
            sums, _ = probe.clipped_grad_sum(params, x, jax.nn.one_hot(jnp.array([0]), 3),
                                             jnp.array([clip]), loss=loss)
            contribution = np.concatenate([np.asarray(sums["w"], np.float64).ravel(),
                                           np.asarray(sums["b"], np.float64).ravel()])
            assert np.linalg.norm(contribution) <= clip * (1 + 1e-6), (gap, clip)


def test_every_matmul_of_the_clipped_sum_runs_at_highest_precision(rng):
    """TF32 or bf16 passes (GPUs, TPUs) would break the bound: every dot is HIGHEST."""
    onehot = jax.nn.one_hot(jnp.zeros(4, int), 3)
    params = {"w": jnp.zeros((2, 5, 3)), "b": jnp.zeros((2, 3))}
    for shape in ((4, 5), (4, 3, 5)):
        jaxpr = jax.make_jaxpr(lambda p, x: probe.clipped_grad_sum(
            p, x, onehot, jnp.ones(2), loss="softmax"))(params, np.zeros(shape, np.float32))
        dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
        assert dots
        for eqn in dots:
            precision = eqn.params["precision"]
            assert precision is not None and all(
                p == jax.lax.Precision.HIGHEST for p in precision), precision


# --------------------------------------------------------------------------------------------
# Randomness: secret keys, no seeded noise, no hard support.
# --------------------------------------------------------------------------------------------


def _leaves(tree, path=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, f"{path}.{key}")
    elif isinstance(tree, list):
        for value in tree:
            yield from _leaves(value, f"{path}[*]")
    else:
        yield path, tree


def test_same_seed_draws_different_noise_and_the_seed_is_never_written(digits_store, tmp_path):
    outputs = []
    for name in ("a", "b"):
        out = tmp_path / f"{name}.json"
        model = tmp_path / f"{name}.safetensors"
        assert cli.main(["tune", digits_store, "--epsilon", "2", "--trials", "2",
                         "--steps-choices", "5", "--r-max", "50", "--normalize", "group",
                         "--groups", "27", "--seed", "12345", "--search", "random",
                         "--out", str(out), "--model", str(model), "--quiet"]) == 0
        outputs.append((json.loads(out.read_text()), read_model_file(model)[0]["head/w"]))
    (a, w_a), (b, w_b) = outputs
    # Same seed, same r proposals of stage 0 (the seed drives only them) ...
    assert [t["r"] for t in a["stages"][0]["trials"]] == [t["r"] for t in b["stages"][0]["trials"]]
    # ... but fresh noise: different scores and a different final model.
    assert [t["score"] for t in a["stages"][0]["trials"]] != [
        t["score"] for t in b["stages"][0]["trials"]]
    assert not np.array_equal(w_a, w_b)
    for path, value in _leaves(a):
        assert value != 12345 and "12345" not in str(value), path
    assert a["privacy"]["noise_keys"] == "os-entropy" and a["privacy"]["seed"] == "given"


def test_probe_has_no_seed_option(digits_store):
    assert cli.main(["probe", digits_store, "--seed", "1"]) == 2


def test_inf_is_opt_in_and_labelled(digits_store, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert cli.main(["probe", digits_store, "--seeds", "1", "--out", str(out), "--quiet"]) == 0
    results = json.loads(out.read_text())
    assert all(math.isfinite(r["epsilon"]) for r in results["runs"])  # the default sweep
    table = capsys.readouterr().out
    assert "inf" not in table.split("\n")[2]
    assert cli.main(["probe", digits_store, "--epsilons", "1,inf", "--seeds", "2", "--out",
                     str(out), "--quiet"]) == 0
    table = capsys.readouterr().out
    assert "non-private, no guarantee" in table and "seeds composed" in table
    assert "full batch (q = 1)" in table.splitlines()[0]
    assert "all 2 private runs together" in table
    results = json.loads(out.read_text())
    reference = [r for r in results["runs"] if r["epsilon"] == "inf"]
    assert reference and all(r["guarantee"].startswith("none") for r in reference)
    row = next(r for r in results["summary"] if r["epsilon"] == 1.0)
    # The mean over 2 seeds costs the composition of the 2 runs.
    assert row["epsilon_row"] == pytest.approx(
        accounting.gdp_epsilon(math.sqrt(2) * accounting.gdp_mu(1.0, 1e-5), 1e-5), rel=1e-6)


def test_gaussian_noise_reaches_past_the_float32_support():
    """The extreme 53-bit uniforms map to about +-8.3 sigma: no endpoint at -5.42 / 5.22."""
    for key in range(3):
        draws = np.asarray(jax.jit(dp.gaussian_noise, static_argnums=1)(
            jax.random.key(key), 10_000_000))
        # A hard endpoint with mass 2^-23 piles up ~1.2 draws per 1e7 on one value.
        assert (draws == draws.max()).sum() == 1 and (draws == draws.min()).sum() == 1
        assert abs(draws.mean()) < 6 / math.sqrt(1e7) and abs(draws.std() - 1) < 1e-3
    from dpprobe.dp.noise import _normal_from_words

    with jax.enable_x64(True):
        extremes = np.asarray(_normal_from_words(jnp.array([0, 1, 2**64 - 2, 2**64 - 1],
                                                           jnp.uint64)))
    assert extremes[0] > 8.2 and extremes[1] < -8.2
    assert abs(extremes[2]) < 1e-12 and abs(extremes[3]) < 1e-12


def test_the_unrolled_threefry_is_the_librarys():
    """`dp.noise._threefry_2x32` (one fusion on CPU) gives the library's threefry-2x32 bits for
    any key and counters, so the noise is the same stream as before: the hash is the library's,
    only its lowering differs."""
    from jax.extend.random import threefry_2x32

    from dpprobe.dp.noise import _normal_from_words, _threefry_2x32

    rng = np.random.default_rng(0)
    for _ in range(3):
        key_data = jnp.asarray(rng.integers(0, 2**32, 2, dtype=np.uint32))
        x0, x1 = (jnp.asarray(rng.integers(0, 2**32, 1000, dtype=np.uint32)) for _ in range(2))
        ours = jax.jit(_threefry_2x32)(key_data, x0, x1)
        library = threefry_2x32(key_data, jnp.concatenate([x0, x1])).reshape(2, -1)
        np.testing.assert_array_equal(np.stack(ours), library)
    key = dp.make_keys(1)[0]  # gaussian_noise hashes the counters (i, size + i)
    with jax.enable_x64(True):
        bits = threefry_2x32(jax.random.key_data(key), jnp.arange(2 * 999, dtype=jnp.uint32))
        words = (bits[:999].astype(jnp.uint64) << 32) | bits[999:].astype(jnp.uint64)
        np.testing.assert_array_equal(dp.gaussian_noise(key, 999, jnp.float64),
                                      _normal_from_words(words))


def test_gaussian_noise_from_any_key_kind():
    """Threefry keys (`dp.make_keys`) take one block per 64-bit word; other key kinds go through
    `jax.random.bits`: both give standard normal draws, different for different keys. The
    draws compiled as one program, as a training step makes them (op by op: 5.3 s, not 3.0)."""
    noise = jax.jit(dp.gaussian_noise, static_argnums=(1, 2))
    for key in (dp.make_keys(2)[1], jax.random.key(5, impl="rbg")):
        with jax.enable_x64(True):  # float64 draws: float32 ones would collide by chance
            draws = np.asarray(noise(key, 200_000, jnp.float64))
        assert abs(draws.mean()) < 6 / math.sqrt(2e5) and abs(draws.std() - 1) < 0.01
        assert np.unique(draws).size == draws.size
    first, second = dp.make_keys(2)
    assert not np.array_equal(dp.gaussian_noise(first, 10), dp.gaussian_noise(second, 10))
    tree = {"a": jnp.ones(3, jnp.bfloat16), "b": jnp.ones(2, jnp.float32)}  # dtypes kept
    assert {k: v.dtype for k, v in dp.add_noise(tree, 1.0, first).items()} == {
        "a": jnp.bfloat16, "b": jnp.float32}
    with pytest.raises(ValueError, match="2\\^31"):
        jax.eval_shape(lambda: dp.gaussian_noise(first, 2**31))
