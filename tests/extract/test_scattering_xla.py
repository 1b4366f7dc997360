"""The CPU ScatterNet (`extract.scattering_xla`) against kymatio's module (today's stores) and
against kymatio's algorithm in float64 (the exact numbers both round), on random and real
images; its low-pass operators against the FFT route they replace."""

import numpy as np
import pytest
import torch

from dpprobe import extract
from dpprobe.extract.scattering_xla import ScatteringXLA, lowpass_operator

TOLERANCE = 1e-5  # of the largest coefficient of the image and channel


def _kymatio_float64(images: np.ndarray, J: int, L: int) -> np.ndarray:
    """kymatio 0.3's `scattering2d` loop (its core, path by path) in float64 numpy, with its
    filters in float64: (B, M, N) -> (B, K, M / 2^J, N / 2^J)."""
    from kymatio.scattering2d.filter_bank import filter_bank
    from kymatio.scattering2d.utils import compute_padding

    shape = images.shape[-2:]
    padded_shape = compute_padding(*shape, J)
    bank = filter_bank(*padded_shape, J, L)
    phi = [np.asarray(level, np.float64) for level in bank["phi"]["levels"]]
    psi = [(w["j"], [np.asarray(level, np.float64) for level in w["levels"]])
           for w in bank["psi"]]
    pad = [((p - s) // 2, (p - s + 1) // 2) for s, p in zip(shape, padded_shape, strict=True)]
    x = np.pad(images.astype(np.float64), [(0, 0), *pad], mode="reflect")

    def periodize(u, k):
        b, n, m = u.shape
        return u.reshape(b, k, n // k, k, m // k).mean(axis=(1, 3))

    def low(u, j):
        s = np.fft.ifft2(periodize(u * phi[j], 2 ** (J - j))).real
        return s[:, 1:-1, 1:-1]

    u0 = np.fft.fft2(x)
    out = [low(u0, 0)]
    second = []
    for j1, levels1 in psi:
        u1 = np.fft.fft2(np.abs(np.fft.ifft2(periodize(u0 * levels1[0], 2 ** j1))))
        out.append(low(u1, j1))
        for j2, levels2 in psi:
            if j2 > j1:
                u2 = np.abs(np.fft.ifft2(periodize(u1 * levels2[j1], 2 ** (j2 - j1))))
                second.append(low(np.fft.fft2(u2), j2))
    return np.stack(out + second, axis=1)


def _relative_error(ours, reference):
    ours, reference = np.asarray(ours, np.float64), np.asarray(reference, np.float64)
    scale = np.abs(reference).max(axis=(-3, -2, -1), keepdims=True)
    return float((np.abs(ours - reference) / scale).max())


@pytest.mark.parametrize("shape,J,L,channels", [((28, 28), 2, 8, 1), ((12, 12), 2, 8, 2),
                                                 ((32, 32), 3, 4, 3), ((24, 20), 2, 6, 1),
                                                 ((17, 23), 1, 8, 1)])
def test_equals_kymatio_and_float64_on_random_images(rng, shape, J, L, channels):
    from kymatio.torch import Scattering2D

    x = rng.normal(size=(4, channels, *shape)).astype(np.float32)
    x[1] *= 1e4  # large and small inputs, a constant image
    x[2] = 0.5
    ours = ScatteringXLA(shape, J=J, L=L)(torch.from_numpy(x)).numpy()
    theirs = Scattering2D(J=J, shape=shape, L=L)(torch.from_numpy(x)).numpy()
    assert ours.shape == theirs.shape
    assert _relative_error(ours, theirs) <= TOLERANCE
    exact = _kymatio_float64(x.reshape(-1, *shape), J, L).reshape(theirs.shape)
    assert _relative_error(ours, exact) <= TOLERANCE
    # as close to the exact numbers as kymatio's float32 module is (within a factor of 10)
    assert _relative_error(ours, exact) <= 10 * max(_relative_error(theirs, exact), 1e-7)


def test_equals_kymatio_on_real_images():
    from kymatio.torch import Scattering2D

    sources = ["digits"] + (["fashion-mnist"] if extract.sources.FASHION_MNIST_DIR.exists()
                            else [])
    for name in sources:
        split = extract.open_source(name, split="test")["test"]
        images = split.array[:16].astype(np.float32) / 255.0
        shape = images.shape[-2:]
        x = torch.from_numpy(images)[:, None]
        ours = ScatteringXLA(shape)(x).numpy()
        theirs = Scattering2D(J=2, shape=shape, L=8)(x).numpy()
        assert _relative_error(ours, theirs) <= TOLERANCE, name
        assert _relative_error(ours, _kymatio_float64(images, 2, 8)[:, None]) <= TOLERANCE
        # and absolutely: pixels in [0, 1] give coefficients below 1
        assert np.abs(ours - theirs).max() <= TOLERANCE


def test_an_images_features_do_not_depend_on_its_batch(rng):
    """Blocks have one shape (the last one padded), so resumed and sharded extractions,
    whose batches differ, store bitwise the same features."""
    module = ScatteringXLA((16, 16))
    x = torch.from_numpy(rng.uniform(size=(module.block + 3, 1, 16, 16)).astype(np.float32))
    whole = module(x)
    assert torch.equal(module(x[5:6]), whole[5:6])
    assert torch.equal(module(x[module.block:]), whole[module.block:])


@pytest.mark.parametrize("n,m,J,level", [(36, 36, 2, 0), (36, 36, 2, 1), (20, 24, 2, 0),
                                         (40, 40, 3, 2)])
def test_lowpass_operator_is_the_fft_route(rng, n, m, J, level):
    from kymatio.scattering2d.filter_bank import filter_bank

    phi = np.asarray(filter_bank(n, m, J, 8)["phi"]["levels"][level], np.float32)
    k = 2 ** (J - level)
    a, b = lowpass_operator(phi, k)
    assert a.shape == (phi.shape[0] // k - 2, phi.shape[0])
    assert b.shape == (phi.shape[1] // k - 2, phi.shape[1])
    u = rng.normal(size=phi.shape)
    spectrum = np.fft.fft2(u) * phi.astype(np.float64)
    periodized = spectrum.reshape(k, phi.shape[0] // k, k, phi.shape[1] // k).mean(axis=(0, 2))
    expected = np.fft.ifft2(periodized).real[1:-1, 1:-1]
    np.testing.assert_allclose(a @ u @ b.T, expected, atol=1e-6 * np.abs(expected).max())
    with pytest.raises(ValueError, match="not separable"):
        lowpass_operator(phi + rng.normal(size=phi.shape).astype(np.float32) * phi.max() * 1e-3,
                         k)


def test_the_cpu_backbone_runs_the_xla_program(rng):
    backbone = extract.create_backbone("scatternet", device="cpu")
    backbone.forward(torch.zeros(1, 1, 28, 28))
    assert isinstance(backbone.module.inner, ScatteringXLA)
    backbone.forward(torch.zeros(1, 1, 4, 4))  # padded by kymatio's special case: its module
    assert not isinstance(backbone.module.inner, ScatteringXLA)
