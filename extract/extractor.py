"""Run a frozen backbone once over a split and write the embeddings to the feature store."""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import torch
from tqdm.auto import tqdm

from extract.backbones import Backbone
from extract.sources import ImageSplit, PrecomputedSplit
from extract.store import SplitWriter

__all__ = ["ExtractReport", "extract_split", "embed_images"]


@dataclasses.dataclass
class ExtractReport:
    split: str
    num_examples: int
    feature_shape: tuple[int, ...]
    chunks_written: int
    num_chunks: int
    complete: bool
    resumed: bool


def embed_images(backbone: Backbone, split: ImageSplit, indices) -> np.ndarray:
    """Embeddings (len(indices), d) float32 of the given images of a split."""
    batch = torch.stack([backbone.transform(image) for image in split.images(indices)])
    return backbone.forward(batch).cpu().numpy()


def extract_split(
    split: ImageSplit | PrecomputedSplit,
    backbone: Backbone | None,
    store,
    *,
    split_name: str | None = None,
    batch_size: int = 256,
    dtype: str = "float16",
    rows_per_chunk: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> ExtractReport:
    """Embed every example of `split` and write it to `store/split_name`, resumably.

    Chunks already marked done by an earlier (interrupted) run of the same job are skipped;
    the split is marked complete only after its last chunk is written.

    Args:
      split: images (with a backbone) or precomputed embeddings (backbone None).
      backbone: the frozen feature extractor, or None for `PrecomputedSplit`.
      store: the Zarr store path.
      split_name: "train" or "test" (default: the split's own name).
      batch_size: images per forward pass.
      dtype: feature dtype in the store, "float16" (default) or "float32".
      rows_per_chunk: chunk height (default: chosen from rows x d, ~8 MiB per chunk).
      overwrite: replace an existing split written by a different job.
      progress: show a progress bar.
    """
    name = split_name or split.split
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if isinstance(split, PrecomputedSplit):
        if backbone is not None:
            raise ValueError("precomputed embeddings take no backbone (--backbone none)")
        feature_shape = tuple(split.features.shape[1:])
        backbone_provenance = {"name": "none", "weights_source": "precomputed embeddings"}
        preprocessing = {"kind": "none (precomputed)"}
    else:
        if backbone is None:
            raise ValueError("images need a backbone")
        feature_shape = tuple(embed_images(backbone, split, [0]).shape[1:])
        backbone_provenance, preprocessing = backbone.provenance, backbone.preprocessing
    writer = SplitWriter(
        store,
        name,
        num_rows=len(split),
        feature_shape=feature_shape,
        dtype=dtype,
        provenance={
            "backbone": backbone_provenance,
            "preprocessing": preprocessing,
            "dataset": split.provenance(),
        },
        rows_per_chunk=rows_per_chunk,
        overwrite=overwrite,
    )
    pending = writer.pending_chunks()
    total = sum(np.subtract(*writer.chunk_rows(c)[::-1]) for c in pending)
    bar = tqdm(
        total=int(total),
        unit="img",
        desc=f"extract {name}",
        disable=not progress,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    with bar:
        for chunk in pending:
            start, stop = writer.chunk_rows(chunk)
            if isinstance(split, PrecomputedSplit):
                features = split.features[start:stop]
                bar.update(stop - start)
            else:
                parts = []
                for lo in range(start, stop, batch_size):
                    hi = min(lo + batch_size, stop)
                    parts.append(embed_images(backbone, split, range(lo, hi)))
                    bar.update(hi - lo)
                features = np.concatenate(parts)
            writer.write_chunk(chunk, features, split.labels[start:stop])
    complete = writer.finalize()
    return ExtractReport(
        split=name,
        num_examples=len(split),
        feature_shape=feature_shape,
        chunks_written=len(pending),
        num_chunks=writer.num_chunks,
        complete=complete,
        resumed=writer.resumed,
    )
