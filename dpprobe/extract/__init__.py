"""dpprobe's feature extractor: a frozen backbone, run once, into a chunked Zarr store.

Modules, in the order data flows through them:
  sources     data specs and `open_source` (datasets, cifar: the file readers; hf: Hugging Face
              `datasets` folders and cache; splits: what they yield)
  defects     the per-record rule a publishing job reads data by (`open_source(strict=False)`);
              data_check: what it would change, for the data's owner (`check_data`)
  backbones   the frozen models (timm, ScatterNet)
  extractor   `extract_split`: a source through a backbone into a store, resumably
  store       the store's format and invariants (writer: `SplitWriter`; read: `load_split`,
              `iter_split_chunks`; verify: `verify_store` and the chunk sha256 check;
              zarr_io: reaching the store's Zarr nodes, locally or by URL)

The store and data-source API import only NumPy (Zarr on first use); the backbone API (torch,
timm) is imported on first use too, so that jobs which only read a store start fast.

Called, the package runs its job: `dpprobe.extract(...)` is `dpprobe.jobs.extract` (installed by
`dpprobe/__init__.py`; this package never imports the job, which imports `pipelines`).
"""

import importlib

from dpprobe.extract.data_check import DataReport, check_data
from dpprobe.extract.defects import NULL_LABEL, Defect
from dpprobe.extract.info import format_store_info
from dpprobe.extract.read import iter_split_chunks, load_split
from dpprobe.extract.sources import (
    ImageSplit,
    PrecomputedSplit,
    from_torch_dataset,
    open_source,
    parse_data_spec,
)
from dpprobe.extract.splits import image_mode_of
from dpprobe.extract.store import (
    FORMAT,
    FORMAT_VERSION,
    DamagedStoreError,
    IncompleteSplitError,
    check_out_path,
    choose_rows_per_chunk,
    chunk_checksum,
    local_split_attrs,
    open_split,
    shard_chunks,
    split_attrs,
    store_summary,
)
from dpprobe.extract.verify import VerifyReport, verify_store
from dpprobe.extract.writer import SplitWriter, finalize_split

_LAZY = {
    "Backbone": "dpprobe.extract.backbones",
    "create_backbone": "dpprobe.extract.backbones",
    "file_sha256": "dpprobe.extract.backbones",
    "resolve_device": "dpprobe.extract.backbones",
    "ExtractReport": "dpprobe.extract.extractor",
    "AUGMENTATIONS": "dpprobe.extract.extractor",
    "augment_image": "dpprobe.extract.extractor",
    "embed_images": "dpprobe.extract.extractor",
    "extract_split": "dpprobe.extract.extractor",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AUGMENTATIONS",
    "FORMAT",
    "FORMAT_VERSION",
    "Backbone",
    "ExtractReport",
    "DamagedStoreError",
    "DataReport",
    "Defect",
    "ImageSplit",
    "IncompleteSplitError",
    "NULL_LABEL",
    "PrecomputedSplit",
    "SplitWriter",
    "VerifyReport",
    "augment_image",
    "check_out_path",
    "choose_rows_per_chunk",
    "check_data",
    "chunk_checksum",
    "create_backbone",
    "embed_images",
    "extract_split",
    "file_sha256",
    "finalize_split",
    "format_store_info",
    "from_torch_dataset",
    "image_mode_of",
    "iter_split_chunks",
    "load_split",
    "local_split_attrs",
    "open_source",
    "open_split",
    "parse_data_spec",
    "resolve_device",
    "shard_chunks",
    "split_attrs",
    "store_summary",
    "verify_store",
]
