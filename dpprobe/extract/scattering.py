"""kymatio's torch Scattering2D for ONNX export: one scale at a time instead of one filter at
a time, its Fourier transforms as matrix products.

kymatio 0.3's torch frontend runs the scattering transform filter by filter: for J = 2, L = 8
that is 1 + 16 + 64 paths, each with its own product, Fourier subsampling, FFTs and modulus,
about 500 torch calls per forward. The ONNX exporter traces every call, and the FFTs become
ONNX DFT operators, which onnxruntime runs slowly (90% of an exported model's time). Measured
on a 28 px scatternet_cnn_linear (`benchmarks/export.py`, 2-core CPU): 66.7 s to export, an
11.8 MB file, 29 images/s in onnxruntime. No library ships a batched torch ScatterNet, so
`BatchedScattering2D` is hand-written here: a subclass of kymatio's `Scattering2D` (same
constructor, same filters, same buffers `tensor0..`, so the same state dict) whose
`scattering` applies every wavelet of one scale in one broadcast product: the first order in
one pass per scale j1, the second order in passes of as many first-order paths as fit
`PATH_BYTES` per image (all 8 at 28 px; one at 224 px, whose L wavelets of j2 side by side
already take L times kymatio's per-path temporaries). With dft "matrix" each 2-D DFT is two
products with the DFT's cosine and sine matrices (float32, built in float64; not in the state
dict), so the graph holds only real matrix products: the same model exports in 9.6 s to a 1.4
MB file that onnxruntime runs at 441 images/s. `torch` exports batch with FFTs (`dft="fft"`):
229 graph operations instead of kymatio's 3,039, so `torch.export` takes 3 s instead of 41 s and
`torch.export.load` 1.3 s instead of 14 s; the loaded program runs small batches faster (16
images at 28 px: 781 vs 198 images/s) and large ones slower (1,024: 340 vs 701; kymatio's small
per-path temporaries stay in cache). `Model.to_torch` keeps kymatio's module; CPU extraction
runs `scattering_xla` (one XLA program, several times faster than either).

`dft="fft"` is kymatio's arithmetic: the same products, Fourier periodization as means in the
same order, `torch.fft` of the same sizes, and kymatio's output order (order 0, then order 1 in
its filter order, then order 2 by (n1, n2)); it checks the batching against kymatio's module
(within 1e-6 of the largest coefficient, `tests/extract/test_extract.py`; bit for bit in its J = 2
cases on this machine: batched FFTs may round differently from single ones). `dft="matrix"`
differs from kymatio by float32 rounding (~1e-6 of the largest coefficient).

Other configurations (max_order 1, pre_pad, list output, a filter order not grouped by scale)
fall back to kymatio's loop. For inference (export) only: the modulus is a plain square root,
whose gradient at 0 is NaN where kymatio's `ModulusStable` gives 0.
"""

from __future__ import annotations

import numpy as np
import torch
from kymatio.torch import Scattering2D

__all__ = ["PATH_BYTES", "BatchedScattering2D", "batch_scatterings"]

PATH_BYTES = 2**20  # per image: the second order's products of one pass (memory only)


def _dft_matrices(n: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of 2 pi k m / n, k, m < n (the n-point DFT is cos - i sin), from k m mod n
    in integers so large products lose no precision."""
    k = np.arange(n)
    angle = 2 * np.pi * (np.outer(k, k) % n) / n
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


def _subsample(x, k: int):
    """Subsampling by k in space as periodization in frequency (kymatio's
    `subsample_fourier`) of (..., H, W)."""
    if k == 1:
        return x
    *lead, height, width = x.shape
    y = x.reshape(-1, k, height // k, k, width // k).mean(3).mean(1)
    return y.reshape(*lead, height // k, width // k)


class BatchedScattering2D(Scattering2D):
    """`kymatio.torch.Scattering2D` (J, shape, L, ...) with the scales' filters batched;
    `dft` "fft" (kymatio's numbers) or "matrix" (DFTs as matrix products, for export)."""

    def __init__(self, J, shape, L=8, max_order=2, pre_pad=False, backend="torch",
                 out_type="array", *, dft: str = "fft"):
        super().__init__(J, shape, L=L, max_order=max_order, pre_pad=pre_pad, backend=backend,
                         out_type=out_type)
        if dft not in ("fft", "matrix"):
            raise ValueError(f"dft must be 'fft' or 'matrix', not {dft!r}")
        self.dft = dft
        sizes = {s // 2 ** j for s in (self._M_padded, self._N_padded) for j in range(J + 1)}
        for n in sorted(sizes):  # a few KiB; buffers, so they follow .to(device)
            cos, sin = _dft_matrices(n)
            self.register_buffer(f"dft_cos_{n}", torch.from_numpy(cos), persistent=False)
            self.register_buffer(f"dft_sin_{n}", torch.from_numpy(sin), persistent=False)

    def _fourier(self, re, im, *, inverse: bool):
        """The 2-D DFT (or its inverse) of re + i im over the last two axes (im None: 0)."""
        if self.dft == "fft":
            z = torch.complex(re, torch.zeros_like(re) if im is None else im)
            z = torch.fft.ifft2(z) if inverse else torch.fft.fft2(z)
            return z.real.contiguous(), z.imag.contiguous()
        sign = 1.0 if inverse else -1.0  # e^{+-i t} = cos t +- i sin t
        height, width = re.shape[-2:]
        cos, sin = getattr(self, f"dft_cos_{width}"), getattr(self, f"dft_sin_{width}")
        if im is None:  # along the rows: (re + i im) (cos + sign i sin)
            re, im = re @ cos, sign * (re @ sin)
        else:
            re, im = re @ cos - sign * (im @ sin), im @ cos + sign * (re @ sin)
        cos, sin = getattr(self, f"dft_cos_{height}"), getattr(self, f"dft_sin_{height}")
        re, im = re.transpose(-1, -2), im.transpose(-1, -2)  # along the columns (cos, sin are
        re, im = re @ cos - sign * (im @ sin), im @ cos + sign * (re @ sin)  # symmetric)
        re, im = re.transpose(-1, -2), im.transpose(-1, -2)
        if inverse:
            re, im = re / (height * width), im / (height * width)
        return re, im

    def scattering(self, input):
        phi, psi = self.load_filters()
        scales = sorted({p["j"] for p in psi})
        groups = {j: [n for n in range(len(psi)) if psi[n]["j"] == j] for j in scales}
        if (self.max_order != 2 or self.out_type != "array" or self.pre_pad
                or sum(groups.values(), []) != list(range(len(psi)))
                or not torch.is_tensor(input)
                or input.ndim < 2 or tuple(input.shape[-2:]) != tuple(self.shape)):
            return super().scattering(input)  # kymatio's loop (and its checks and messages)
        if not input.is_contiguous():
            raise RuntimeError("Tensor must be contiguous.")
        batch_shape, signal_shape = input.shape[:-2], input.shape[-2:]
        padded = self.pad(input.reshape((-1,) + signal_shape))[..., 0]
        u0 = self._fourier(padded, None, inverse=False)  # (n, H, W) each
        J = self.J

        def low(u, j):  # (n, F, H_j, W_j) pair -> the unpadded coefficients (n, F, h, w)
            k, f = 2 ** (J - j), phi["levels"][j][..., 0]
            re, _ = self._fourier(_subsample(u[0] * f, k), _subsample(u[1] * f, k),
                                  inverse=True)
            return self.unpad(re[..., None])

        def modulus_path(u, wavelets, k):  # |ifft(subsample(u psi))|, back in Fourier
            re, im = self._fourier(_subsample(u[0] * wavelets, k), _subsample(u[1] * wavelets, k),
                                   inverse=True)
            return self._fourier((re * re + im * im).sqrt(), None, inverse=False)

        def wavelets(group, level):  # (F, H_level, W_level)
            return torch.stack([psi[n]["levels"][level][..., 0] for n in group])

        out = [low((u0[0][:, None], u0[1][:, None]), 0)]
        second = []
        for j1 in scales:
            u1 = modulus_path((u0[0][:, None], u0[1][:, None]), wavelets(groups[j1], 0), 2 ** j1)
            out.append(low(u1, j1))  # u1: (n, F1, H_j1, W_j1) each
            later = {j2: wavelets(groups[j2], j1) for j2 in scales if j2 > j1}  # at level j1
            if not later:
                continue
            f2 = sum(len(groups[j2]) for j2 in later)  # first-order paths per pass: at most
            step = max(1, PATH_BYTES // (f2 * 8 * u1[0].shape[-1] * u1[0].shape[-2]))  # the budget
            for f in range(0, len(groups[j1]), step):
                parts = []
                for j2, psi2 in later.items():  # (n, c, F2, h, w): paths f.., n2 fastest
                    u2 = modulus_path((u1[0][:, f:f + step, None], u1[1][:, f:f + step, None]),
                                      psi2, 2 ** (j2 - j1))
                    parts.append(low(u2, j2))
                part = torch.cat(parts, dim=2)
                second.append(part.reshape(part.shape[0], -1, *part.shape[-2:]))
        s = torch.cat(out + second, dim=1)
        return s.reshape(batch_shape + s.shape[-3:])


def batch_scatterings(module: torch.nn.Module, *, dft: str = "matrix") -> torch.nn.Module:
    """`module` with each kymatio `Scattering2D` inside it replaced, in place, by a
    `BatchedScattering2D` of the same configuration and buffers."""
    for name, child in list(module.named_children()):
        if isinstance(child, Scattering2D) and not isinstance(child, BatchedScattering2D):
            batched = BatchedScattering2D(child.J, child.shape, L=child.L,
                                          max_order=child.max_order, pre_pad=child.pre_pad,
                                          out_type=child.out_type, dft=dft)
            batched.load_state_dict(child.state_dict())
            setattr(module, name, batched.to(next(child.buffers()).device))
        else:
            batch_scatterings(child, dft=dft)
    return module
