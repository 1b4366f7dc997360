"""The ScatterNet of CPU extraction: kymatio's `Scattering2D` (max_order 2, its own filters) as
one compiled XLA program per image size, run on blocks of images.

kymatio 0.3's torch frontend runs the transform path by path (1 + 16 + 64 paths at J = 2,
L = 8, each with its own products, Fourier periodizations, FFTs and modulus): on a 2-core CPU
most of its time is spent creating and copying small tensors, not transforming.
`BatchedScattering2D` (torch, the scales batched) removes the loop but not the copies.
Here the same arithmetic is one `jax.jit` program, in which XLA fuses each product with its
Fourier periodization and each modulus with its transform, so that a block of images makes
few passes over memory. Two rewrites, exact in real arithmetic, save most of the work left:

- The low-pass outputs (order 0, 1 and 2: `unpad(real(ifft(periodize(fft(U) phi))))`) are
  separable linear maps `A U B^T`, because kymatio's `phi` is a periodized Gaussian (its
  Fourier filter is the outer product of two 1-D filters: checked at construction, rank-1
  to float32 rounding). `A` and `B` (h x n, w x m) are built in float64 from kymatio's
  float32 filter, so the 81 low-pass paths cost two small matrix products each, not a
  forward FFT, a product, a periodization and an inverse FFT.
- The first order at the finest scale is kept in Fourier only where the second order needs
  it (scales j1 < J - 1).

The features equal kymatio's within float32 rounding (~3e-7 of the largest coefficient of
the image; `tests/extract/test_scattering_xla.py` checks 1e-5 against kymatio and against a
float64 reference), which is below the store's float16 quantization, so stores written with
kymatio's module stay valid and resume with this one. The speed, old vs new in one run, is
in `benchmarks/scatternet.py` and docs/performance.md.

Images whose padding would reach their own size (sides under 2^J + 1 or so; kymatio pads them
by a special case) are left to kymatio's module (`Scattering`).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

__all__ = ["BLOCK_BYTES", "MAX_BLOCK", "ScatteringXLA", "lowpass_operator", "padding"]

# Images per call of the compiled program: at most MAX_BLOCK, fewer where one image's
# second-order temporaries (complex, L^2 paths at half the padded size) would pass BLOCK_BYTES,
# so that a block's temporaries stay in cache at small sizes and in memory at large ones.
# Every block has the same shape (the last one is padded with zeros), so one program serves a
# whole job, and an image's features never depend on which block it was in.
MAX_BLOCK = 64
BLOCK_BYTES = 2**26


def padding(shape: tuple[int, int], J: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """kymatio's reflect padding of an (M, N) image for J scales: ((top, bottom), (left,
    right)), to the padded size `compute_padding` gives (a multiple of 2^J, at least 2^J more)."""
    from kymatio.scattering2d.utils import compute_padding

    padded = compute_padding(*shape, J)
    return tuple(((p - s) // 2, (p - s + 1) // 2) for s, p in zip(shape, padded, strict=True))


def _dft(n: int, inverse: bool = False) -> np.ndarray:
    """The n-point DFT matrix (inverse: with kymatio's 1/n), from k m mod n in integers."""
    k = np.arange(n)
    angle = 2 * np.pi * (np.outer(k, k) % n) / n
    return np.exp(1j * angle) / n if inverse else np.exp(-1j * angle)


def lowpass_operator(phi: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(A, B), float64, such that kymatio's low-pass output of a real n x m signal U,
    `unpad(real(ifft2(periodize_k(fft2(U) * phi))))`, is `A @ U @ B.T`.

    Args:
      phi: kymatio's Fourier low-pass filter at U's resolution (n, m), real.
      k: the subsampling factor (the periodization's period count per axis).

    Returns:
      A (n/k - 2, n) and B (m/k - 2, m): per axis, the DFT, the filter's 1-D factor,
      periodization, inverse DFT and the unpadding of one coefficient at each border.
    """
    phi = np.asarray(phi, np.float64)
    u, s, vt = np.linalg.svd(phi)
    if s[1:].sum() > 1e-6 * s[0]:  # a Gaussian's filter is an outer product (float32 apart)
        raise ValueError(f"the low-pass filter is not separable (singular values {s[:3]})")
    factors = (u[:, 0] * np.sqrt(s[0]), vt[0] * np.sqrt(s[0]))
    operators = []
    for factor in factors:
        n = factor.size
        m = n // k
        periodize = np.zeros((m, n))
        for alias in range(k):
            periodize[np.arange(m), alias * m + np.arange(m)] = 1.0 / k
        operator = _dft(m, inverse=True) @ periodize @ (factor[:, None] * _dft(n))
        # A real, even filter maps real signals to real ones: the imaginary part is the float32
        # filter's rounding (~5e-8), and enters the real output only as its square.
        if np.abs(operator.imag).max() > 1e-6 * np.abs(operator.real).max():
            raise ValueError("the low-pass filter is not even: its output would be complex")
        operators.append(operator.real[1:-1])
    return operators[0], operators[1]


def _filters(shape: tuple[int, int], J: int, L: int) -> dict:
    """kymatio's filter bank for `shape` (its float32 values, as its torch module holds them):
    the wavelets of each scale j at each level, and each level's low-pass (A, B) pair."""
    from kymatio.scattering2d.filter_bank import filter_bank
    from kymatio.scattering2d.utils import compute_padding

    bank = filter_bank(*compute_padding(*shape, J), J, L)
    psi = {}  # (j, level) -> (L, n, m) float32, in kymatio's order of angles
    for wavelet in bank["psi"]:
        for level, values in enumerate(wavelet["levels"]):
            psi.setdefault((wavelet["j"], level), []).append(np.asarray(values, np.float32))
    lowpass = [lowpass_operator(np.asarray(phi, np.float32), 2 ** (J - level))
               for level, phi in enumerate(bank["phi"]["levels"])]
    return {"psi": {key: np.stack(value) for key, value in psi.items()},
            "lowpass": [(a.astype(np.float32), b.astype(np.float32)) for a, b in lowpass]}


def _scatter(images, psi, lowpass, *, pad, J: int):
    """The scattering of a block (B, M, N) -> (B, K, h, w), kymatio's output order: order 0,
    order 1 by (j1, theta1), order 2 by (j1, theta1, j2, theta2)."""
    import jax
    import jax.numpy as jnp

    highest = jax.lax.Precision.HIGHEST

    def low(signal, level):  # (..., n, m) real -> (..., h, w)
        a, b = lowpass[level]
        return jnp.einsum("hn,...nm,wm->...hw", a, signal, b, precision=highest)

    def band(spectrum, wavelets, k):  # |ifft2(periodize_k(spectrum * wavelets))|
        product = spectrum * wavelets
        if k > 1:
            *lead, n, m = product.shape
            product = product.reshape(*lead, k, n // k, k, m // k).mean((-4, -2))
        return jnp.abs(jnp.fft.ifft2(product))

    batch = images.shape[0]
    padded = jnp.pad(images, ((0, 0), *pad), mode="reflect")
    spectrum = jnp.fft.fft2(padded)
    orders = [low(padded, 0)[:, None]], []
    for j1 in range(J):
        first = band(spectrum[:, None], psi[(j1, 0)], 2 ** j1)  # (B, L, n1, m1)
        orders[0].append(low(first, j1))
        if j1 == J - 1:
            continue
        first_spectrum = jnp.fft.fft2(first)[:, :, None]  # (B, L, 1, n1, m1)
        second = [low(band(first_spectrum, psi[(j2, j1)], 2 ** (j2 - j1)), j2)
                  for j2 in range(j1 + 1, J)]  # each (B, L, L, h, w)
        second = jnp.concatenate(second, axis=2)
        orders[1].append(second.reshape(batch, -1, *second.shape[-2:]))
    return jnp.concatenate(orders[0] + orders[1], axis=1)


@functools.cache
def _program(pad: tuple, J: int):
    """One jitted program per (padding, J): modules built again for the same image size (a
    predict after an extract, in one process) reuse its compiled code."""
    import jax

    return jax.jit(functools.partial(_scatter, pad=pad, J=J))


class ScatteringXLA(torch.nn.Module):
    """kymatio's `Scattering2D(J, shape, L)` (max_order 2, array output) on the CPU, as one
    XLA program: (..., M, N) float32 tensors -> (..., K, M / 2^J, N / 2^J), K = 1 + J L +
    L^2 J (J - 1) / 2, equal to kymatio's within float32 rounding.

    Args:
      shape: the images' (M, N).
      J: scales (at least 1; 2^J at most the smaller side).
      L: angles.
    """

    def __init__(self, shape: tuple[int, int], J: int = 2, L: int = 8):
        super().__init__()
        import jax

        if J < 1 or 2 ** J > min(shape):
            raise ValueError(f"J must be >= 1 with 2^J <= the image's sides, got J={J} for "
                             f"{shape}")
        self.shape, self.J, self.L = tuple(int(s) for s in shape), int(J), int(L)
        self.pad = padding(self.shape, self.J)
        filters = _filters(self.shape, self.J, self.L)
        self.device = jax.devices("cpu")[0]
        put = functools.partial(jax.device_put, device=self.device)
        self._psi = {key: put(value) for key, value in filters["psi"].items()}
        self._lowpass = [(put(a), put(b)) for a, b in filters["lowpass"]]
        self.channels = 1 + J * L + L * L * J * (J - 1) // 2
        self.out_shape = tuple(s // 2 ** J for s in self.shape)
        half = [(s + sum(p)) // 2 for s, p in zip(self.shape, self.pad, strict=True)]
        per_image = 8 * L * L * half[0] * half[1] * 3  # complex64 second order, a few copies
        self.block = int(max(1, min(MAX_BLOCK, 2 ** int(np.log2(max(1, BLOCK_BYTES
                                                                      // per_image))))))
        self._program = _program(self.pad, self.J)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., M, N) -> (..., K, h, w), as kymatio's module."""
        if tuple(x.shape[-2:]) != self.shape:
            raise RuntimeError(f"Tensor must be of spatial size {self.shape}, got "
                               f"{tuple(x.shape[-2:])}")
        lead = x.shape[:-2]
        images = np.ascontiguousarray(x.detach().cpu().reshape(-1, *self.shape).numpy(),
                                      dtype=np.float32)
        out = np.empty((len(images), self.channels, *self.out_shape), np.float32)
        pending = None  # (start, stop, result): the previous block, fetched after the next
        for start in range(0, len(images), self.block):  # is dispatched (XLA runs async)
            block = images[start:start + self.block]
            stop = start + len(block)
            if len(block) < self.block:
                block = np.concatenate([block, np.zeros((self.block - len(block), *self.shape),
                                                        np.float32)])
            result = self._program(self._put(block), self._psi, self._lowpass)
            if pending is not None:
                out[pending[0]:pending[1]] = np.asarray(pending[2])[:pending[1] - pending[0]]
            pending = (start, stop, result)
        if pending is not None:
            out[pending[0]:pending[1]] = np.asarray(pending[2])[:pending[1] - pending[0]]
        return torch.from_numpy(out).reshape(*lead, self.channels, *self.out_shape)

    def _put(self, block: np.ndarray):
        import jax

        return jax.device_put(block, self.device)
