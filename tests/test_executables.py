"""The on-disk executable cache runs the program jax.jit would run, and never a stale one."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from probe import executables


def _make():
    """A fresh jitted function (never traced) and the list its traces append to."""
    traces = []

    @functools.partial(jax.jit, static_argnames=("scale",))
    def noisy(x, keys, *, scale):
        traces.append(scale)  # runs only when traced
        noise = jax.vmap(lambda k: jax.random.normal(k, x.shape[1:]))(keys)
        return jnp.tanh(x) * scale + noise

    return noisy, traces


_noisy, _ = _make()


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh executable cache, and JAX's persistent cache off (CLI tests turn it on in this
    process): an executable JAX loaded from it is refused by `cached_call`, not stored."""
    monkeypatch.setenv(executables.ENV, str(tmp_path / "executables"))
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield tmp_path / "executables"
    jax.config.update("jax_enable_compilation_cache", enabled)


def _args(rng, rows=3):
    x = rng.normal(size=(rows, 5)).astype(np.float32)
    return x, jax.random.wrap_key_data(rng.integers(0, 2**32, (rows, 2), dtype=np.uint32))


def test_cached_executable_equals_jit_and_skips_tracing(rng, cache_dir):
    x, keys = _args(rng)
    first_fn, first_traces = _make()
    first = executables.cached_call(first_fn, x, keys, scale=2.0)  # miss: compiled, stored
    assert len(list(cache_dir.iterdir())) == 1 and first_traces == [2.0]
    again_fn, again_traces = _make()  # as in a new process: nothing traced yet
    again = executables.cached_call(again_fn, x, keys, scale=2.0)  # hit: loaded, not traced
    assert again_traces == []
    expected = again_fn(x, keys, scale=2.0)  # the plain jit call
    np.testing.assert_array_equal(first, expected)
    np.testing.assert_array_equal(again, expected)


def test_static_arguments_and_shapes_key_the_cache(rng, cache_dir):
    x, keys = _args(rng)
    x4, keys4 = _args(rng, rows=4)
    key = executables._key(_noisy, (x, keys), {"scale": 2.0})
    assert key == executables._key(_noisy, (x + 1, keys), {"scale": 2.0})  # values don't
    assert key != executables._key(_noisy, (x, keys), {"scale": 3.0})
    assert key != executables._key(_noisy, (x4, keys4), {"scale": 2.0})
    assert key != executables._key(_noisy, (x.astype(np.float16), keys), {"scale": 2.0})
    for args, scale in (((x, keys), 3.0), ((x4, keys4), 2.0)):
        np.testing.assert_array_equal(executables.cached_call(_noisy, *args, scale=scale),
                                      _noisy(*args, scale=scale))


def test_a_broken_entry_is_replaced(rng, cache_dir):
    x, keys = _args(rng)
    executables.cached_call(_noisy, x, keys, scale=2.0)
    entry = cache_dir / f"noisy-{executables._key(_noisy, (x, keys), {'scale': 2.0})}.pkl"
    entry.parent.mkdir(parents=True, exist_ok=True)  # (nothing is stored where JAX's
    entry.write_bytes(b"not a pickled executable")    # in-process caches were used first)
    out = executables.cached_call(_noisy, x, keys, scale=2.0)
    np.testing.assert_array_equal(out, _noisy(x, keys, scale=2.0))
    assert not entry.exists() or entry.read_bytes() != b"not a pickled executable"


def test_off_without_the_environment_variable(rng, tmp_path, monkeypatch):
    monkeypatch.delenv(executables.ENV, raising=False)
    x, keys = _args(rng)
    np.testing.assert_array_equal(executables.cached_call(_noisy, x, keys, scale=2.0),
                                  _noisy(x, keys, scale=2.0))
    assert not any(tmp_path.iterdir())
