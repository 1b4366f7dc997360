import atexit
import contextlib
import ctypes
import gc
import os
import shutil
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# torch's OpenMP threads spin between operations by default, on cores another pytest-xdist worker
# (or XLA's threads) could use: waiting passively, two workers used 6-9% less CPU on average
# over interleaved runs (docs/development.md, "Threads that wait without spinning"). A value
# already set wins; libgomp reads it when torch first loads it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# What the CLI caches (Hugging Face, timm) goes to a fresh folder, never the user's ~/.cache or
# $XDG_CACHE_HOME. The process that made it (pytest-xdist's controller, whose environment its
# workers and their CLI subprocesses inherit) removes it when it exits.
#
# XLA's compiled programs are kept between runs instead: JAX's persistent compilation cache
# (with the CLI's stored programs beside it, `probe.programs`) in the checkout's git-ignored
# .cache/jax-tests. A program compiled by one test, worker or subprocess is loaded, not
# recompiled, by the next, and by the next run of the suite. An entry is keyed by what it is
# compiled from (JAX's: the program's HLO, its compile options, XLA_FLAGS and the versions; a
# stored program's: every source file of `dpprobe` too), so an edited program is compiled
# again, never stood in for, and results are bit-identical either way. Measured (the whole
# suite on 2 workers, one run after the other): 1,329 s on an empty folder, 1,185 s on the
# next run (docs/development.md). DPPROBE_TESTS_JAX_CACHE=fresh compiles every program, in the
# fresh folder, as a fresh clone (CI) does; another value is the folder to use. The first
# process empties .cache/jax-tests once it holds more than 2 GiB. JAX reads these variables
# when it is first imported.
_KEPT_JAX_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                               ".cache", "jax-tests")
_KEPT_JAX_CACHE_BYTES = 2 << 30


def _folder_bytes(folder: str) -> int:
    """Bytes of the files under `folder` (0 where it does not exist)."""
    total = 0
    for parent, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.lstat(os.path.join(parent, name)).st_size
            except OSError:
                pass
    return total


if "DPPROBE_TESTS_CACHE" not in os.environ:  # the first process
    os.environ["DPPROBE_TESTS_CACHE"] = tempfile.mkdtemp(prefix="dpprobe-tests-")
    atexit.register(shutil.rmtree, os.environ["DPPROBE_TESTS_CACHE"], ignore_errors=True)
    _jax_cache = os.environ.get("DPPROBE_TESTS_JAX_CACHE", _KEPT_JAX_CACHE)
    if _jax_cache == "fresh":
        _jax_cache = os.path.join(os.environ["DPPROBE_TESTS_CACHE"], "jax")
    elif _jax_cache == _KEPT_JAX_CACHE and _folder_bytes(_jax_cache) > _KEPT_JAX_CACHE_BYTES:
        shutil.rmtree(_jax_cache, ignore_errors=True)
    os.environ["DPPROBE_TESTS_JAX_CACHE"] = _jax_cache  # its workers inherit the folder
os.environ["XDG_CACHE_HOME"] = os.environ["DPPROBE_TESTS_CACHE"]
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ.get(  # never a user's own cache
    "DPPROBE_TESTS_JAX_CACHE", os.path.join(os.environ["DPPROBE_TESTS_CACHE"], "jax"))
# Every program goes into that cache, not only those that took 0.1 s to compile (the CLI's
# threshold): the suite compiles some 7,400 small programs, at -O0 about 24 ms each, and reads
# one back in about 9 ms. Measured on `tests/probe` and `tests/dp` (243 tests, two workers,
# fresh caches, runs interleaved): warm 240 and 257 s at 0.1 s against 222 and 230 s at 0
# (XLA's backend 94-104 -> 43-45 test-seconds); the first, cold run 323 vs 321 s. The whole
# suite, warm: 969 s against 1,131 s the same day (docs/development.md). A value already in
# the environment wins.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# Half the suite's time is XLA compiling its many small programs. With XLA:CPU's LLVM backend
# at -O0 they compile in about half the time and run slower (the 30-run canary audit: 72 ->
# 138 s), a net gain: the suite on 2 workers 1,286 -> 1,094-1,126 s; test_bookkeeping.py and
# test_finetune_job.py 246 -> 211 s, 473 -> 393 CPU s (a parallel codegen split count of 1
# instead of 32: no gain, 228 s). The HLO, its fusions and buffers are the same; the machine
# code may add a reduction's terms in another order than -O3's vector loops (the bounds under
# test hold for any order; the suite passes at both levels). A flag already in XLA_FLAGS wins:
# XLA_FLAGS=--xla_backend_optimization_level=3 tests the released code generation.
#
# XLA:CPU's MLIR fusion emitters compile a fusion in more time than its older elemental IR
# emitters: with those (`--xla_cpu_use_fusion_emitters=false`) the compile time of
# tests/test_contract.py's ResNet-18 class and ConvNeXt leave-one-out test fell from 47.0 to
# 30.4-35.2 s and their time from 75.7 to 57-61 s (one process each, in turn, cold caches).
# Both emitters lower the same fused HLO; the released CLI keeps XLA's default, and a flag
# already in XLA_FLAGS wins here too.
_LEVEL = "--xla_backend_optimization_level"
_EMITTERS = "--xla_cpu_use_fusion_emitters"
# Whether the user's XLA_FLAGS chose the level, decided once by the first process (pytest-xdist's
# controller): its workers inherit the flags this file adds.
os.environ.setdefault("DPPROBE_TESTS_USER_LEVEL",
                      str(int(_LEVEL in os.environ.get("XLA_FLAGS", ""))))
_LEVEL_CHOSEN_BY_USER = os.environ["DPPROBE_TESTS_USER_LEVEL"] == "1"
for _flag, _value in ((_LEVEL, "0"), (_EMITTERS, "false")):
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}={_value}".strip()


def with_test_xla_flags(flags: str = "") -> str:
    """`flags` (an XLA_FLAGS value for a subprocess) and the suite's code-generation flags."""
    ours = [f for f in os.environ["XLA_FLAGS"].split() if f.startswith((_LEVEL, _EMITTERS))]
    return " ".join([flags, *ours]).strip()


import numpy as np  # noqa: E402
import pytest  # noqa: E402

from dpprobe.pipelines.cli import _use_jax_compilation_cache  # noqa: E402 (imports no JAX)

_use_jax_compilation_cache()  # the CLI's settings, in the folder chosen above

FASHION_MNIST = "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"


def _map_counts() -> tuple[int, int]:
    """This process's memory mappings and the kernel's limit on them (0, 0 off Linux)."""
    try:
        with open("/proc/self/maps", "rb") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except OSError:
        return 0, 0


def _resident_bytes() -> int:
    """This process's resident memory in bytes (0 off Linux)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


# A worker whose resident memory grew this much since its last clearing drops its programs.
_RESIDENT_GROWTH = 3 << 30
_resident_after_clearing = [0]


def _release_memory() -> None:
    """Drop JAX's compiled programs, collect, and hand freed heap back to the kernel."""
    jax = sys.modules.get("jax")  # None where no test loaded JAX: nothing to drop
    if jax is not None:
        jax.clear_caches()
    gc.collect()
    try:  # glibc keeps freed heap pages mapped until asked; elsewhere nothing to ask
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    _resident_after_clearing[0] = _resident_bytes()


@pytest.fixture(autouse=True)
def _free_compiled_programs():
    """Drop JAX's compiled programs once this worker holds half the kernel's mappings, or its
    resident memory grew by 3 GiB since it last did.

    XLA:CPU maps each compiled fusion's code and data separately: a worker that runs a few
    hundred tests holds tens of thousands of mappings (14,256 at 44% of the suite on 2
    workers), and at `vm.max_map_count` (65,530 here) the next compilation's mmap fails and
    the worker dies of SIGSEGV inside XLA (seen late in the suite, in whichever test compiled
    next). `jax.clear_caches()` frees the programs no live object holds (100 programs'
    11,064 mappings -> 588); later tests recompile or load from the persistent cache. A
    worker late in the suite reached 11 GB resident and the kernel's OOM killer ended it on
    this 24 GB machine (two workers, other jobs beside them); the growth test drops what
    programs hold, but the suite's peak stayed 11.1 GB in one worker with it (measured), so
    something else holds most of that memory (not found yet).
    """
    yield
    count, limit = _map_counts()
    grown = _resident_bytes() - _resident_after_clearing[0] > _RESIDENT_GROWTH
    if (limit and count > limit // 2) or grown:
        _release_memory()


@pytest.fixture(autouse=True)
def _optimized_code_where_running_dominates(request):
    """The programs a test marked `runtime_bound` compiles get XLA's -O3, not the suite's -O0.

    Such a test spends its time running its programs, not compiling them (many steps of one
    model, audits of many runs): at -O0 their machine code runs 2-4x slower (an elementwise
    gradient on 4,000 x 4,000: 0.98 s vs 0.24 s). XLA takes the level per compilation, as
    `jax.jit(..., compiler_options=...)` passes it; the product's own `jax.jit` calls are not
    changed, so JAX's compile-options hook (`jax._src.compiler.get_compile_options`, a private
    function of the pinned JAX) adds it while the test runs. The compilation cache's key covers
    the options, so an -O0 and an -O3 program never stand in for each other; JAX's in-memory
    caches are cleared first, where an earlier test's -O0 programs would be found. A level in
    the user's XLA_FLAGS wins here too.
    """
    if request.node.get_closest_marker("runtime_bound") is None:
        yield
        return
    with optimized_compilation():
        yield


@contextlib.contextmanager
def optimized_compilation():
    """XLA's -O3 for what is compiled within (see `_optimized_code_where_running_dominates`),
    for a module-scoped fixture that runs its programs more than it compiles them: it is set
    up before any test's marker applies. A level in the user's XLA_FLAGS wins."""
    if _LEVEL_CHOSEN_BY_USER:
        yield
        return
    import jax
    from jax._src import compiler

    jax.clear_caches()  # programs an earlier test compiled at -O0 would be reused otherwise
    plain = compiler.get_compile_options

    def optimizing(*args, env_options_overrides=None, **kwargs):
        options = {"xla_backend_optimization_level": 3, **(env_options_overrides or {})}
        return plain(*args, env_options_overrides=options, **kwargs)

    compiler.get_compile_options = optimizing
    try:
        yield
    finally:
        compiler.get_compile_options = plain


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def random_problem(rng, n=64, d=12, c=5, views=None):
    """Random features, labels and a random (non-zero) stacked linear model."""
    shape = (n, d) if views is None else (n, views, d)
    features = rng.normal(size=shape).astype(np.float32) * 2.0
    labels = rng.integers(0, c, size=n)
    params = {
        "w": rng.normal(size=(1, d, c)).astype(np.float32) * 0.5,
        "b": rng.normal(size=(1, c)).astype(np.float32),
    }
    return features, labels, params


@pytest.fixture(scope="session")
def digits_store(tmp_path_factory):
    """scikit-learn digits through ScatterNet into a store (about 2 s)."""
    from dpprobe.pipelines import run_extract

    store = str(tmp_path_factory.mktemp("stores") / "digits.zarr")
    run_extract(backbone="scatternet", data="digits", out=store, progress=False)
    return store


requires_fashion_mnist = pytest.mark.skipif(
    not os.path.exists(FASHION_MNIST),
    reason="Debian's dataset-fashion-mnist is not installed "
    "(apt-get install dataset-fashion-mnist)",
)


def fixed_keys(count: int, seed: int):
    """Reproducible noise keys, for tests that compare two runs with the same noise. The
    product never derives noise from a seed (`dp.make_keys` reads OS entropy)."""
    import jax

    return jax.random.split(jax.random.key(seed), count)


def calibrated_runs(epsilons, steps, lr, q=1.0, delta=1e-5):
    """One `RunSpec` per epsilon, sigma calibrated (inf: non-private, no clipping)."""
    import math

    from dpprobe import accounting, probe

    out = []
    for eps in epsilons:
        sigma = accounting.calibrate_noise_multiplier(eps, delta, steps=steps,
                                                      sampling_probability=q)
        plan = accounting.DpPlan(sigma, steps, q, clip_norm=1.0 if sigma > 0 else math.inf)
        out.append(probe.RunSpec(plan, lr))
    return out


@pytest.fixture(scope="session")
def timm_probe(tmp_path_factory):
    """A store of a random-init timm ViT's features (weights from a local file), a probe
    trained on it, and the images."""
    import timm
    import torch

    from dpprobe.pipelines import cli
    from tests.pipelines.test_finetune_job import _images

    folder = tmp_path_factory.mktemp("timm_probe")
    rng = np.random.default_rng(1)
    torch.manual_seed(0)
    source = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    torch.save(source.state_dict(), folder / "vit.pth")
    for split, n in (("train", 64), ("test", 40)):
        images, labels = _images(rng, n, 32, 3)
        np.savez(folder / f"{split}.npz", images=images, labels=labels,
                 class_names=np.array(["a", "b", "c", "d"]))
        assert cli.main(["extract", "--backbone", "vit_tiny_patch16_224", "--weights",
                         str(folder / "vit.pth"), "--crop", "32", "--data",
                         f"npz:{folder / f'{split}.npz'}", "--split", split, "--out",
                         str(folder / "s.zarr"), "--dtype", "float32", "--quiet"]) == 0
    assert cli.main(["probe", str(folder / "s.zarr"), "--epsilons", "8", "--seeds", "1",
                     "--steps", "10", "--optimizer", "momentum", "--lr", "1",
                     "--save-model", str(folder / "m"), "--quiet"]) == 0
    return folder


@pytest.fixture
def world(base, tmp_path, monkeypatch):
    """A fresh copy of the requesting module's `base` folder (its own fixture), as the working
    directory: the hostile-input tests run each case in one."""
    import shutil

    here = tmp_path / "w"
    shutil.copytree(base, here)
    monkeypatch.chdir(here)
    return here
