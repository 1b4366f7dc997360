"""The released-model file: one safetensors file, the arrays as tensors and one JSON document
(the schema below) in the header's metadata, under the key `dpprobe_model`.

safetensors is a plain format (an 8-byte header length, a JSON header, the raw tensor bytes)
that every framework reads without running code, unlike pickle: a model file can be inspected
with `safetensors.safe_open` or any other safetensors reader. The JSON document says what the
arrays are (README, "Model file format"):

    format "dpprobe-model", format_version, dpprobe_version, job, kind ("linear" for a
    probe on features, "network" for a fine-tuned model on images), class_names, input,
    transforms (every step from the raw input to the logits, in order), head / architecture,
    parameters (which were released: the final iterate or its EMA), backbone (the store's
    public provenance), privacy (epsilon, delta, accountant, neighbouring relation, the
    ledger), training (the recipe, the reported test accuracy). No time of the run (it depends
    on the private records); files written before dpprobe dropped it hold a `created` time,
    which readers ignore.

Formal guarantee: a file holds only what its job publishes, DP outputs (the noised parameters,
the privately released standardization, accuracies on the public test split) and public inputs
(arguments, the backbone's identity, the class list, N); `tests/test_privacy.py` checks it on
neighbouring datasets.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np

__all__ = ["FORMAT", "FORMAT_VERSION", "METADATA_KEY", "ModelFileError", "encode_model",
           "file_document", "is_model_file", "json_default", "read_model_file",
           "safetensors_metadata"]

FORMAT = "dpprobe-model"
FORMAT_VERSION = 1
METADATA_KEY = "dpprobe_model"
# A safetensors header is JSON of at most this size (the library's own limit).
_MAX_HEADER = 100_000_000


class ModelFileError(ValueError):
    """A file that is not a readable dpprobe model (damaged, cut short, another format, or a
    newer format version); the message names the file."""


def encode_model(arrays: dict[str, np.ndarray], document: dict) -> bytes:
    """The bytes of a model file holding `arrays` and the JSON `document` (the jobs write them
    with `dpprobe.files.atomic_write_bytes`)."""
    from safetensors.numpy import save

    document = file_document(arrays, document)
    arrays = {name: np.ascontiguousarray(value) for name, value in arrays.items()}
    return save(arrays, metadata={METADATA_KEY: json.dumps(document, default=json_default)})


def file_document(arrays: dict[str, np.ndarray], document: dict) -> dict:
    """`document` as a model file holding `arrays` records it (what `read_model_file` returns):
    with its format, version and array names, so that a model built in memory reads the same."""
    return {"format": FORMAT, "format_version": FORMAT_VERSION} | document | {
        "arrays": sorted(arrays)}


def json_default(value):
    """`json.dumps(default=...)` for the values dpprobe's documents hold beyond JSON's own:
    NumPy scalars and arrays, paths (as strings)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _header(path: str) -> tuple[dict, int]:
    """The safetensors header of `path` and the size the file must have, or ModelFileError."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelFileError(f"{path} is not a dpprobe model file (too short to be "
                                     "safetensors)")
            (length,) = struct.unpack("<Q", head)
            if length > min(_MAX_HEADER, size - 8):
                raise ModelFileError(f"{path} is not a dpprobe model file (no safetensors "
                                     "header; damaged or another format)")
            header = json.loads(f.read(length))
    except OSError as err:
        raise ModelFileError(f"{path}: cannot read the model file ({err.strerror})") from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelFileError(f"{path} is not a dpprobe model file (its header is not JSON: "
                             "damaged or another format)") from err
    if not isinstance(header, dict):
        raise ModelFileError(f"{path} is not a dpprobe model file (bad header)")
    try:
        ends = [int(entry["data_offsets"][1]) for key, entry in header.items()
                if key != "__metadata__"]
    except (TypeError, KeyError, IndexError, ValueError) as err:
        raise ModelFileError(f"{path} is not a dpprobe model file (a damaged safetensors "
                             "header)") from err
    return header, 8 + length + max(ends, default=0)


def safetensors_metadata(path: str | os.PathLike) -> dict:
    """The string metadata of a safetensors file ({} for any other file)."""
    try:
        header, _ = _header(os.fspath(path))
    except ModelFileError:
        return {}
    metadata = header.get("__metadata__")
    return metadata if isinstance(metadata, dict) else {}


def is_model_file(path: str | os.PathLike) -> bool:
    """Whether `path` holds a dpprobe model file (by its header, not its name)."""
    try:
        header, _ = _header(os.fspath(path))
    except ModelFileError:
        return False
    return METADATA_KEY in (header.get("__metadata__") or {})


def read_model_file(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict]:
    """(arrays, document) of a model file.

    Raises:
      ModelFileError (one line naming the file): not safetensors, cut short, not a dpprobe
        model, a format version newer than this dpprobe reads, or arrays the document names
        but the file lacks.
    """
    from safetensors.numpy import load

    path = os.fspath(path)
    header, expected_size = _header(path)
    if METADATA_KEY not in (header.get("__metadata__") or {}):
        raise ModelFileError(f"{path} is a safetensors file but not a dpprobe model (no "
                             f"{METADATA_KEY!r} metadata)")
    try:
        document = json.loads(header["__metadata__"][METADATA_KEY])
    except json.JSONDecodeError as err:
        raise ModelFileError(f"{path}: the model's description is damaged ({err})") from err
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ModelFileError(f"{path} is not a dpprobe model file (format "
                             f"{document.get('format') if isinstance(document, dict) else None!r})")
    version = document.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise ModelFileError(f"{path}: unknown model format version {version!r}")
    if version > FORMAT_VERSION:
        raise ModelFileError(f"{path} has model format version {version}, newer than this "
                             f"dpprobe reads ({FORMAT_VERSION}); upgrade dpprobe (the file was "
                             f"written by dpprobe {document.get('dpprobe_version')})")
    size = os.path.getsize(path)
    if size != expected_size:
        raise ModelFileError(f"{path} is cut short or damaged ({size} bytes, its header "
                             f"promises {expected_size})")
    try:
        with open(path, "rb") as f:
            arrays = load(f.read())
    except Exception as err:  # noqa: BLE001 - safetensors raises its own errors
        raise ModelFileError(f"{path}: the arrays are damaged ({type(err).__name__}: "
                             f"{str(err).strip().splitlines()[0] if str(err).strip() else ''})"
                             ) from err
    missing = [name for name in document.get("arrays", []) if name not in arrays]
    if missing:
        raise ModelFileError(f"{path} lacks the arrays {missing[:3]} its description names")
    for name, value in arrays.items():
        if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
            raise ModelFileError(f"{path}: array {name} holds NaN or Inf; the file is damaged")
    return arrays, document
