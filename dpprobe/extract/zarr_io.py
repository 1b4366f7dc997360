"""Opening the Zarr nodes of a feature store, on local disk or at an fsspec URL, with errors
that name the file that is missing or unreadable.

The format itself (what the nodes must hold) is `extract.store`; this module only reaches them:
the root group, a split's group, an array, and the names of the splits present.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from typing import TYPE_CHECKING, TypeAlias

from dpprobe.extract.defects import first_line

if TYPE_CHECKING:
    import zarr

__all__ = [
    "DamagedStoreError",
    "StorePath",
    "check_url_backend",
    "first_line",
    "import_zarr",
    "is_local",
    "open_array",
    "open_group",
    "open_root",
    "read_json",
    "split_names",
]

# A store: a local path, or a URL (s3://, gs://, ...) that fsspec opens.
StorePath: TypeAlias = str | os.PathLike[str]

# Optional packages that fsspec needs for a store URL's scheme, and how to install them.
_URL_BACKENDS = {
    "s3": ("s3fs", "pip install s3fs"),
    "s3a": ("s3fs", "pip install s3fs"),
    "gs": ("gcsfs", "pip install gcsfs"),
    "gcs": ("gcsfs", "pip install gcsfs"),
    "http": ("aiohttp", "pip install aiohttp"),
    "https": ("aiohttp", "pip install aiohttp"),
    "az": ("adlfs", "pip install adlfs"),
    "abfs": ("adlfs", "pip install adlfs"),
}


class DamagedStoreError(ValueError):
    """A store whose files do not hold what its metadata promises (missing or corrupt chunks,
    unreadable or inconsistent metadata)."""


def import_zarr():
    """Zarr, imported on first use, so that `import extract` stays light for the commands that
    never open a store (`local_split_attrs` reads a local store's metadata without it)."""
    return importlib.import_module("zarr")


def is_local(store: StorePath) -> bool:
    """Whether `store` is a path on local disk (not a URL)."""
    return isinstance(store, str | os.PathLike) and "://" not in str(store)


def check_url_backend(store: StorePath) -> None:
    """Refuse a store URL whose fsspec backend is not installed, with the install command."""
    if is_local(store):
        return
    scheme = str(store).split("://", 1)[0].lower()
    backend = _URL_BACKENDS.get(scheme)
    if backend and importlib.util.find_spec(backend[0]) is None:
        raise ValueError(f"store {store}: {scheme}:// URLs need the {backend[0]} package; "
                         f"install it with `{backend[1]}`")


def read_json(path: str) -> dict | None:
    """The JSON object in the file at `path`, or None when it is missing, unreadable or not an
    object."""
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def open_root(store: StorePath, mode: str) -> zarr.Group:
    """The store's root group, refusing a missing store or unreadable metadata."""
    check_url_backend(store)
    if is_local(store) and mode == "r":
        if not os.path.isdir(store):
            raise FileNotFoundError(f"no feature store at {store}")
        if not os.path.exists(os.path.join(store, "zarr.json")):
            raise ValueError(f"{store} is not a dpprobe feature store (it has no zarr.json)")
    try:
        return import_zarr().open_group(store, mode=mode, zarr_format=3)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"no feature store at {store}") from err
    except (ValueError, TypeError, KeyError) as err:
        raise DamagedStoreError(f"{store}/zarr.json is unreadable or not a Zarr v3 group "
                                f"({type(err).__name__}: {first_line(err)})") from err


def open_group(root: zarr.Group, store: StorePath, split: str) -> zarr.Group:
    """root[split], refusing unreadable metadata with a message naming it."""
    try:
        group = root[split]
    except KeyError:
        raise
    except Exception as err:  # noqa: BLE001 - any metadata failure is damage
        raise DamagedStoreError(f"{store}/{split}/zarr.json is unreadable "
                                f"({type(err).__name__}: {first_line(err)})") from err
    if not isinstance(group, import_zarr().Group):
        raise DamagedStoreError(f"{store}/{split} is not a Zarr group")
    return group


def open_array(group: zarr.Group, store: StorePath, split: str, name: str) -> zarr.Array:
    """group[name], refusing missing or unreadable array metadata with a message naming it."""
    try:
        array = group[name]
    except Exception as err:  # noqa: BLE001 - a missing or unreadable zarr.json
        raise DamagedStoreError(f"{store}/{split}/{name}: array metadata missing or unreadable "
                                f"({type(err).__name__}: {first_line(err)})") from err
    if not isinstance(array, import_zarr().Array):
        raise DamagedStoreError(f"{store}/{split}/{name} is not a Zarr array")
    return array


def split_names(root: zarr.Group, store: StorePath) -> list[str]:
    """The splits ("train", "test") present in the store."""
    names = []
    for name in ("train", "test"):
        try:
            if name in root:
                names.append(name)
        except Exception as err:  # noqa: BLE001
            raise DamagedStoreError(f"{store}/{name}/zarr.json is unreadable "
                                    f"({type(err).__name__}: {first_line(err)})") from err
    return names
