"""`Model`: a released model loaded from its file, predicting from features or images.

`load_model(path)` reads the file (`dpmodel.format`) and rebuilds what it describes: a linear
probe (`dpmodel.linear`; given images, the recorded backbone runs first, `dpmodel.backbone`)
or a fine-tuned network (`dpmodel.network`). Logits come from the functions the jobs evaluate
with, so predictions on a job's test split are the ones it scored.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from dpprobe.model.format import read_model_file

__all__ = ["EMBED_BATCH", "Model", "Privacy", "load_model"]

# Images per backbone forward pass (memory only).
EMBED_BATCH = 64


@dataclasses.dataclass(frozen=True)
class Privacy:
    """The model's privacy claim: (epsilon, delta)-DP for `neighboring_relation`, computed by
    `accountant` from the mechanisms in `ledger` (epsilon inf: no guarantee)."""

    epsilon: float
    delta: float
    accountant: str
    neighboring_relation: str
    neighboring_relation_text: str = dataclasses.field(repr=False)
    ledger: dict = dataclasses.field(repr=False)


def load_model(path: str | os.PathLike, *, module=None) -> Model:
    """The model in a dpprobe model file (written by probe --save-model, tune --save-model or
    finetune --out). Raises `ModelFileError` (one line naming the file) for a damaged,
    truncated or newer-format file.

    Args:
      path: the model file.
      module: for a network finetuned from your own Flax NNX module (`dpprobe.finetune(
        model=module)`), an instance of its class (any parameters: the file's replace them in
        a copy); unused otherwise.

    Returns:
      The `Model`."""
    path = os.fspath(path)
    arrays, document = read_model_file(path)
    return Model(path, arrays, document, module=module)


class Model:
    """A released dpprobe model.

    Attributes:
      path: the file it was loaded from.
      document: the file's JSON description (README, "Model file format").
      kind: "linear" (a probe on features) or "network" (a fine-tuned model on images).
      class_names: the declared classes, in logit order.
      privacy: the `Privacy` claim.
    """

    def __init__(self, path: str, arrays: dict[str, np.ndarray], document: dict, *,
                 module=None):
        from dpprobe.model.format import ModelFileError

        self.path, self.arrays, self.document = path, arrays, document
        self.kind = document.get("kind")
        if self.kind not in ("linear", "network"):
            raise ModelFileError(f"{path}: unknown model kind {self.kind!r}")
        self.class_names = [str(c) for c in document["class_names"]]
        claim = document["privacy"]
        self.privacy = Privacy(float(claim["epsilon"]), float(claim["delta"]),
                               claim["accountant"], claim["neighboring_relation"],
                               claim.get("neighboring_relation_text", ""),
                               claim.get("ledger", {}))
        self._network = None
        self._backbone = None
        self.weights: str | None = None  # a relocated copy of the backbone's weights file
        if self.kind == "linear":
            w = arrays["head/w"]
            if w.shape != (self.feature_dim, len(self.class_names)) or arrays["head/b"].shape != (
                    len(self.class_names),):
                raise ModelFileError(f"{path}: head {w.shape} does not fit "
                                     f"{self.feature_dim} features and "
                                     f"{len(self.class_names)} classes")
        else:
            from dpprobe.model.network import rebuild_network

            self._network = rebuild_network(arrays, document, path, module)

    def __repr__(self) -> str:
        return (f"Model({self.path!r}, {self.kind}, {len(self.class_names)} classes, "
                f"epsilon={self.privacy.epsilon:g}, delta={self.privacy.delta:g})")

    # ------------------------------------------------------------------------------------------
    # What it takes

    @property
    def feature_dim(self) -> int | None:
        """d of a linear probe's features (None for a network)."""
        return int(self.document["input"]["dim"]) if self.kind == "linear" else None

    @property
    def takes_images(self) -> bool:
        """Whether images can be given: a network, or a probe whose backbone is recorded."""
        if self.kind == "network":
            return True
        name = ((self.document.get("backbone") or {}).get("backbone") or {}).get("name")
        return name not in (None, "none")

    # ------------------------------------------------------------------------------------------
    # Predictions

    def logits(self, inputs) -> np.ndarray:
        """Logits (n, C) of features (n, d) (a probe) or images: a uint8 array (n, H, W[, C]),
        PIL images, or image file paths."""
        chunks = list(self.iter_logits([inputs]))
        return np.concatenate(chunks) if chunks else np.zeros((0, len(self.class_names)))

    def predict_proba(self, inputs) -> np.ndarray:
        """Class probabilities (n, C): softmax, or per-class sigmoids for a one-vs-all probe."""
        return self.probabilities(self.logits(inputs))

    def predict(self, inputs) -> np.ndarray:
        """The predicted class names (n,) (argmax of the logits; ties to the lower index)."""
        return np.asarray(self.class_names, dtype=object)[np.argmax(self.logits(inputs), -1)]

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """Probabilities of logits, as the model's loss defines them."""
        logits = np.asarray(logits, np.float64)
        if self.kind == "linear" and self.document["head"]["loss"] == "sigmoid":
            return 1.0 / (1.0 + np.exp(-logits))
        shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
        return shifted / shifted.sum(axis=-1, keepdims=True)

    def iter_logits(self, batches: Iterable) -> Iterator[np.ndarray]:
        """Logits of consecutive batches of inputs (each as for `logits`), streamed: one array
        per block of rows, in order. Features go through the model as they are; images through
        its transforms (and a probe's recorded backbone)."""
        if self.kind == "network":
            yield from self._network_logits(batches)
        else:
            yield from self._linear_logits(self._features(batch) for batch in batches)

    def _linear_logits(self, feature_chunks) -> Iterator[np.ndarray]:
        from dpprobe.model.linear import linear_logits_chunks

        yield from linear_logits_chunks(self.arrays, self.document, feature_chunks)

    def _features(self, batch) -> np.ndarray:
        """A batch as the probe's features: given, or embedded by the backbone."""
        if _is_features(batch):
            features = np.asarray(batch)
            if features.ndim != 2 or features.shape[1] != self.feature_dim:
                raise ValueError(f"features of shape {features.shape} given to {self.path}, "
                                 f"which takes (n, {self.feature_dim})")
            return features
        if not self.takes_images:
            raise ValueError(f"{self.path} was trained on precomputed embeddings (backbone "
                             "none): give it features (n, "
                             f"{self.feature_dim}), not images")
        images = _pil_images(batch)
        if not images:
            return np.zeros((0, self.feature_dim), np.float32)
        features = self._embed(images)
        if features.shape[1] != self.feature_dim:
            raise ValueError(
                f"the backbone turns these images ({images[0].size[0]}x{images[0].size[1]} "
                f"{images[0].mode}) into {features.shape[1]} features, {self.path} takes "
                f"{self.feature_dim}: give images of the size and channels it was trained on")
        return features

    def _embed(self, images: list) -> np.ndarray:
        import torch

        from dpprobe.extract.backbones import input_mismatch
        from dpprobe.model.backbone import load_backbone

        if self._backbone is None:
            self._backbone = load_backbone(self.document["backbone"], self.path,
                                           weights=self.weights, dim=self.feature_dim)
        backbone = self._backbone
        out = []
        for start in range(0, len(images), EMBED_BATCH):
            tensors = [backbone.transform(image) for image in images[start:start + EMBED_BATCH]]
            for i, tensor in enumerate(tensors):
                if tensor.shape != tensors[0].shape:
                    image = images[start + i]
                    raise ValueError(f"{self.path}: " + input_mismatch(
                        tensors[0].shape, tensor.shape,
                        f"image {start + i} ({image.size[0]}x{image.size[1]} {image.mode})"))
            batch = torch.stack(tensors)
            out.append(backbone.forward(batch).cpu().numpy())
        return np.concatenate(out)

    def _network_logits(self, batches) -> Iterator[np.ndarray]:
        from dpprobe import finetune

        normalize = self.document["transforms"][3]
        for batch in batches:
            images = self.network_input(batch)
            if len(images):
                yield from finetune.iter_logits(self._network, images, mean=normalize["mean"],
                                                std=normalize["std"])

    def network_input(self, batch) -> np.ndarray:
        """Images as the network's input, uint8 (n, S, S, C): resized and cropped as in
        training, channels checked (grayscale repeated for a model trained on RGB)."""
        from dpprobe.finetune.images import as_channels, images_to_array

        arch = self.document["architecture"]
        resize_crop, channels = self.document["transforms"][0], self.document["transforms"][1]
        side, want = arch["image_size"], arch["in_channels"]
        array = np.asarray(batch) if isinstance(batch, np.ndarray) else None
        if (array is not None and array.dtype == np.uint8 and array.ndim in (3, 4)
                and not resize_crop["resize"] and not resize_crop["crop"]
                and array.shape[1] == array.shape[2]):
            array = as_channels(array, channels["grayscale_to_rgb"])
        else:  # image by image: one of another size or mode is named
            images = _pil_images(batch)
            if not images:
                return np.zeros((0, side, side, want), np.uint8)
            arrays = [images_to_array([image], resize_crop["resize"], resize_crop["crop"],
                                      channels["grayscale_to_rgb"]) for image in images]
            for i, one in enumerate(arrays):
                self._check_input(one, f"{_image_name(batch, images, i)}: ")
            return np.concatenate(arrays)
        self._check_input(array, "")
        return array

    def _check_input(self, array: np.ndarray, name: str) -> None:
        """Refuse images (n, H, W, C) that are not the network's input size and channels."""
        side, want = self.document["architecture"]["image_size"], self.document[
            "architecture"]["in_channels"]
        if array.shape[-1] != want:
            raise ValueError(f"{name}images with {array.shape[-1]} channel(s) given to "
                             f"{self.path}, which takes {want}")
        if array.shape[1:3] != (side, side):
            raise ValueError(f"{name}images of {array.shape[1]}x{array.shape[2]} pixels (after "
                             f"the model's resize and crop) given to {self.path}, which takes "
                             f"{side}x{side}")

    # ------------------------------------------------------------------------------------------
    # Export

    def to_torch(self):
        """The model as one `torch.nn.Module` (eval mode): float NCHW images in [0, 1] at the
        model's input size (features (n, d) for a probe without a backbone) -> logits."""
        from dpprobe.model.torch_export import to_torch

        return to_torch(self)


def _is_features(batch) -> bool:
    return (isinstance(batch, np.ndarray) and np.issubdtype(batch.dtype, np.floating)
            and batch.ndim == 2)


def _image_name(batch, images: list, i: int) -> str:
    """Image i of a batch by name: its path, its `filename`, else its place in the batch."""
    if isinstance(batch, Sequence) and isinstance(batch[i], str | os.PathLike):
        return os.fspath(batch[i])
    return getattr(images[i], "filename", "") or f"image {i} of the batch"


def _pil_images(batch) -> list:
    """A batch of images as PIL images: a uint8 array (n, H, W[, C]), PIL images or paths."""
    from PIL import Image

    if isinstance(batch, np.ndarray):
        if batch.dtype != np.uint8 or batch.ndim not in (3, 4):
            raise ValueError(f"images must be uint8 (n, H, W) or (n, H, W, C), got "
                             f"{batch.dtype} {batch.shape}")
        if batch.ndim == 4 and batch.shape[-1] == 1:
            batch = batch[..., 0]
        if batch.ndim == 4 and batch.shape[-1] != 3:
            raise ValueError(f"images must have 1 or 3 channels, got {batch.shape[-1]}")
        return [Image.fromarray(image) for image in batch]
    images = []
    for item in batch if isinstance(batch, Sequence) else list(batch):
        if isinstance(item, str | os.PathLike):
            try:  # a decompression bomb (Pillow's warning or error) is refused by name too
                with warnings.catch_warnings():
                    warnings.simplefilter("error", Image.DecompressionBombWarning)
                    with Image.open(item) as image:
                        image.load()
                        item = (image.convert("RGB") if image.mode not in ("L", "RGB")
                                else image.copy())
            except (OSError, ValueError, SyntaxError, Image.DecompressionBombError,
                    Image.DecompressionBombWarning) as err:
                raise ValueError(f"cannot read image {item}: {err}") from err
        elif not isinstance(item, Image.Image):
            raise ValueError(f"expected images (PIL images, file paths or a uint8 array), got "
                             f"{type(item).__name__}")
        elif item.mode not in ("L", "RGB"):
            item = item.convert("RGB")
        images.append(item)
    return images
