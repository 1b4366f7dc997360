"""What one record at the publishing rule's caps costs to load: time and memory.

A publishing job reads an image file or an `hf:` image by `extract.defects.read_capped` (the
byte cap, `MAX_FILE_BYTES`, from its size) and `load_image` (the pixel cap, `MAX_PIXELS`, from
its header; decoded; float and 16/32-bit images through `pixel_rule`), then resizes and crops it
(`finetune.images.resize_and_crop`), as `finetune.data` does. This writes records at
the caps, in the formats whose decoding costs most, and times that path for each in a fresh
process (its peak resident memory above what the process held when it began the record):

  png-chunk-at-byte-cap   a valid 16x16 PNG with one private chunk, MAX_FILE_BYTES in all
  png-over-byte-cap       the same one byte longer: a null record, told from its size
  png-rgb-at-pixel-cap    random RGB pixels (incompressible), MAX_PIXELS of them
  png-rgba16-at-pixel-cap 16-bit RGBA of one pixel repeated (zlib inflates 8 bytes a pixel)
  tiff-float-at-pixel-cap a mode-F TIFF (float32, uncompressed): through `pixel_rule`
  jpeg-at-pixel-cap       a random RGB JPEG (quality 95)
  over-pixel-cap          a 1-bit PNG one row over MAX_PIXELS: a null record, told from its
                          header

Run: .venv/bin/python benchmarks/record_caps.py [--crop 224] [--repeats 3] [--dir DIR]
     [--cases png-rgb-at-pixel-cap,...]
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import _path  # noqa: F401 - first: keeps this folder off the import path
import numpy as np

CASES = ["png-chunk-at-byte-cap", "png-over-byte-cap", "png-rgb-at-pixel-cap",
         "png-rgba16-at-pixel-cap", "tiff-float-at-pixel-cap", "jpeg-at-pixel-cap",
         "over-pixel-cap"]


def _side() -> int:
    from dpprobe.extract.defects import MAX_PIXELS

    return math.isqrt(MAX_PIXELS)


def _png_with_chunk(size: int) -> bytes:
    """A valid 16x16 PNG with one private ancillary chunk, `size` bytes in all."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buffer, "PNG")
    png = buffer.getvalue()
    extra = size - len(png) - 12
    body = b"prVt" + bytes(extra)
    return png[:33] + struct.pack(">I", extra) + body + struct.pack(">I", zlib.crc32(body)) + \
        png[33:]


def write(case: str, folder: Path) -> Path:
    """The record of `case`, written in `folder`."""
    from PIL import Image

    from dpprobe.extract.defects import MAX_FILE_BYTES, MAX_PIXELS

    side, rng = _side(), np.random.default_rng(0)
    path = folder / f"{case}.{'tif' if 'tiff' in case else 'jpg' if 'jpeg' in case else 'png'}"
    if case in ("png-chunk-at-byte-cap", "png-over-byte-cap"):
        path.write_bytes(_png_with_chunk(MAX_FILE_BYTES + (case == "png-over-byte-cap")))
    elif case == "png-rgb-at-pixel-cap":
        Image.fromarray(rng.integers(0, 256, (side, side, 3), np.uint8)).save(
            path, compress_level=1)
    elif case == "png-rgba16-at-pixel-cap":
        _png_rgba16(path, side)
    elif case == "tiff-float-at-pixel-cap":
        Image.fromarray(rng.random((side, side), np.float32) * 2).save(path)
    elif case == "jpeg-at-pixel-cap":
        Image.fromarray(rng.integers(0, 256, (side, side, 3), np.uint8)).save(path, quality=95)
    else:
        Image.new("1", (side, MAX_PIXELS // side + 1)).save(path)
    return path


def _png_rgba16(path: Path, side: int) -> None:
    """A 16-bit RGBA PNG of one repeated pixel (small: zlib inflates 8 bytes a pixel), written
    row by row (Pillow writes no 16-bit RGBA)."""
    row = np.tile(np.array([4660, 22136, 39612, 65535], ">u2"), side).tobytes()
    compressor, chunks = zlib.compressobj(6), []
    for _ in range(side):
        chunks.append(compressor.compress(b"\0" + row))
    chunks.append(compressor.flush())

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(
            ">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", side, side, 16, 6, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) +
                     chunk(b"IDAT", b"".join(chunks)) + chunk(b"IEND", b""))


def measure(path: Path, crop: int) -> dict:
    """The publishing path for one record, in this process: seconds and peak memory (MiB)."""
    from dpprobe.extract.defects import decoding, load_image, read_capped
    from dpprobe.finetune.images import resize_and_crop

    start_rss = _memory_kib("VmRSS")
    start = time.perf_counter()
    try:
        with decoding():
            image = load_image(read_capped(path))
            np.asarray(resize_and_crop(image.convert("RGB"), crop, crop))
        outcome = "kept"
    except Exception as err:  # noqa: BLE001 - the rule's refusal: a null record
        outcome = f"null record ({str(err)[:60]})"
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_mib": (_memory_kib("VmHWM") - start_rss) / 1024,
            "outcome": outcome}


def _memory_kib(field: str) -> int:
    """This process's resident memory (VmRSS) or its peak (VmHWM), KiB, from /proc (Linux):
    unlike `ru_maxrss`, which keeps the parent's peak across exec."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--crop", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write the records (a temp dir)")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # a child's file
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(Path(args.measure), args.crop)))
        return
    from dpprobe.extract.defects import MAX_FILE_BYTES, MAX_PIXELS

    print(f"caps: {MAX_FILE_BYTES} bytes, {MAX_PIXELS} pixels; crop {args.crop}; best and "
          f"worst of {args.repeats} fresh processes")
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        for case in args.cases.split(","):
            path = write(case, Path(folder))
            runs = [json.loads(subprocess.run(
                [sys.executable, __file__, "--measure", str(path), "--crop", str(args.crop)],
                check=True, capture_output=True, text=True).stdout)
                for _ in range(args.repeats)]
            seconds = sorted(run["seconds"] for run in runs)
            print(f"{case:26s} {path.stat().st_size / 2**20:8.1f} MiB  "
                  f"{seconds[0]:6.2f}-{seconds[-1]:5.2f} s  peak +"
                  f"{max(run['peak_mib'] for run in runs):6.0f} MiB  {runs[0]['outcome']}")
            path.unlink()


if __name__ == "__main__":
    main()
