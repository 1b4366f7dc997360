"""The data owner's check of raw data (`dpprobe verify --data SPEC`): every record that a
publishing job's per-record rule (`extract.defects`) would make a null record, clamp, or
resize, named by file or row, with its value.

Publishing jobs apply the rule in silence (naming a record, or counting them, would publish
something of the private data); this is where the owner finds the bad rows. Its report is
private: it quotes the data, and is no DP output.
"""

from __future__ import annotations

import collections
import dataclasses
import os

from dpprobe.extract.defects import NULL, RESIZED, Defect, decoding, open_image, unreadable

__all__ = ["HEADER", "DataReport", "check_data", "check_one_size"]

HEADER = ("for the data's owner only, not a DP output: records of {spec} that a publishing job "
          "(finetune) would train as null records, clamp or resize, with their values; do not "
          "publish this")


@dataclasses.dataclass
class DataReport:
    """What `check_data` found: per split, its size and the records the rule would change."""

    spec: str
    splits: dict[str, tuple[int, list[tuple[str, Defect]]]]

    @property
    def ok(self) -> bool:
        """No record would be changed by the rule."""
        return not any(found for _, found in self.splits.values())

    def text(self) -> str:
        """The report, for people: the header, then one line per split and per record."""
        lines = [HEADER.format(spec=self.spec)]
        for name, (size, found) in self.splits.items():
            kinds = collections.Counter(defect.kind for _, defect in found)
            summary = ", ".join(f"{kind}: {count}" for kind, count in sorted(kinds.items()))
            lines.append(f"{name}: {size} records" + (f"; {summary}" if found else
                                                      ", none changed by the rule"))
            lines += [f"  {where}: {defect.kind}: {defect.detail}" for where, defect in found]
        lines.append("OK" if self.ok else "records above are changed by the rule")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """`dpprobe verify --data --json`: each record the rule would change (for the data's
        owner only)."""
        return {"ok": self.ok, "spec": self.spec, "for": "the data's owner only",
                "splits": {name: {"records": size, "changed": [
                    {"record": where, "kind": defect.kind, "detail": defect.detail}
                    for where, defect in found]} for name, (size, found) in self.splits.items()}}


def check_data(spec: str, *, data_dir: str | os.PathLike | None = None,
               num_classes: int | None = None) -> DataReport:
    """Every record of `spec` that the publishing rule would change.

    Args:
      spec: a data spec (`extract.open_source`) of images.
      data_dir: Fashion-MNIST's directory.
      num_classes: the declared class count of a source without class names.

    Returns:
      a `DataReport`: per split, (its size, [(file or row, `Defect`)]). Image files are each
      decoded: an unreadable one is a null record; one whose size or mode differs from the
      split's most common one is listed as resized (a job brings it to the model's input with
      --resize, --crop and the channel rule).
    """
    from dpprobe.extract.sources import open_source

    splits = open_source(spec, data_dir=data_dir, num_classes=num_classes, strict=False)
    found = {}
    for name, split in splits.items():
        defects = list(split.defects)
        if split.array is None:
            defects += _file_defects(split, {d.row for d in defects if d.kind == NULL})
        defects.sort(key=lambda defect: defect.row)
        found[name] = (len(split), [(split.describe(d.row), d) for d in defects])
    return DataReport(spec, found)


def _file_defects(split, null: set[int]) -> list[Defect]:
    """Decode every image file: the unreadable ones (null records), and those whose size or
    mode is not the split's most common one (resized or converted by the rule)."""
    shapes, defects = {}, []
    for row in range(len(split)):
        if row in null:
            continue
        try:
            with decoding():
                shapes[row] = _size_and_mode(split, row)
        except Exception as err:  # noqa: BLE001 - PIL raises many kinds for bad files
            defects.append(unreadable(row, err))
    if shapes:
        (usual_size, usual_mode), _ = collections.Counter(shapes.values()).most_common(1)[0]
        for row, (size, mode) in shapes.items():
            if (size, mode) != (usual_size, usual_mode):
                defects.append(Defect(row, RESIZED, f"{size[0]}x{size[1]} {mode}, unlike most "
                                      f"({usual_size[0]}x{usual_size[1]} {usual_mode}): brought "
                                      "to the model's input by --resize/--crop and RGB"))
    return defects


def _size_and_mode(split, row: int) -> tuple[tuple[int, int], str]:
    """Image `row` decoded by the rule (which raises for a record it makes null); its size and
    its mode as stored (a file's own, before the reader converts a mode other than L or RGB)."""
    image = split.load(row)
    if split.files is None:
        return image.size, image.mode
    with open_image(split.files[row]) as stored:  # its header alone
        return stored.size, stored.mode


def check_one_size(split, preprocessing: dict) -> None:
    """Before a store is written: every image file of `split` (sizes from their headers, no
    decoding) must come out of ScatterNet's `resize` at one size when no `crop` fixes it, so
    that a folder of mixed sizes is refused at once, not at its first odd image after chunks
    were written (which a rerun with other options could not replace without `overwrite`).

    Raises:
      ValueError: naming the first image whose size differs, and the remedy.
    """
    from PIL import Image

    if (preprocessing.get("kind") != "scatternet" or preprocessing.get("crop")
            or getattr(split, "array", None) is not None or getattr(split, "files", None) is None):
        return
    resize, first = preprocessing.get("resize"), None
    for row, file in enumerate(split.files):
        try:
            with Image.open(file) as image:
                (width, height), mode = image.size, image.mode
            size, header = _resized((width, height), resize), f"{width}x{height} {mode}"
        except (OSError, ValueError):  # the reader's rule says what is wrong with this one
            continue
        if first is None:
            first = (row, size)
        elif size != first[1]:
            raise ValueError(
                f"image {split.describe(row)} ({header}) comes to {size[0]}x{size[1]}, image "
                f"{split.describe(first[0])} to {first[1][0]}x{first[1][1]}: ScatterNet takes "
                "one size; pass `resize=R` `crop=S` (nothing was written)")


def _resized(size: tuple[int, int], resize: int | None) -> tuple[int, int]:
    """(width, height) after torchvision's `resize(image, resize)`: the short side to it."""
    width, height = size
    if resize is None:
        return width, height
    if width <= height:
        return resize, int(resize * height / width)
    return int(resize * width / height), resize

