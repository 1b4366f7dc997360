"""Frozen backbones that map images to embeddings: any timm model, or a ScatterNet.

timm models give their pooled pre-logits (`num_classes=0`), with the preprocessing of their own
pretrained config (`timm.data`), optionally resized to R and center-cropped to S as in
Mehta et al. (2023) (384 -> 256). Weights come from the hub, a local file (`.safetensors` or
`.pth`, through timm's `pretrained_cfg_overlay`), or a seeded random init (tests).

`scatternet` is kymatio's Scattering2D with J=2, L=8 (Tramer & Boneh 2021): no weights at all,
so the pipeline runs fully offline. On the CPU it runs as one XLA program
(`scattering_xla`: kymatio's numbers within float32 rounding); on an accelerator, kymatio's
module. Images keep their channels (grayscale stays 1 channel).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

__all__ = ["Backbone", "Scattering", "create_backbone", "file_sha256", "input_mismatch",
           "resolve_device"]


@dataclasses.dataclass
class Backbone:
    """A frozen feature extractor: `transform` one PIL image, then `forward` a batch.

    Attributes:
      name: backbone name (timm model name with tag, or "scatternet").
      module: the torch module (eval mode, on `device`).
      transform: PIL image -> float tensor (C, H, W).
      provenance: what produced the embeddings (goes into the store's attributes).
      preprocessing: the resolved preprocessing config (goes into the store's attributes).
      device: torch device.
    """

    name: str
    module: torch.nn.Module
    transform: Callable
    provenance: dict
    preprocessing: dict
    device: torch.device

    @torch.inference_mode()
    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) preprocessed images -> (B, d) float32 embeddings."""
        out = self.module(batch.to(self.device, non_blocking=True))
        return out.reshape(out.shape[0], -1).float()


def resolve_device(device: str | None = None) -> torch.device:
    """`cuda` when available unless a device is named."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def create_backbone(
    name: str,
    *,
    weights: str | os.PathLike | None = None,
    random_init: bool = False,
    seed: int = 0,
    resize: int | None = None,
    crop: int | None = None,
    device: str | None = None,
    mode: str | None = None,
) -> Backbone:
    """Create a frozen backbone by name.

    Args:
      name: a timm model name, optionally with a pretrained tag
        (`vit_base_patch16_224.augreg_in21k`), or "scatternet".
      weights: local weights file (.safetensors/.pth) for a timm model instead of the hub.
      random_init: timm model with random weights (seeded by `seed`); for tests only.
      resize, crop: resize the short side to `resize` and center-crop `crop` x `crop`;
        `resize` alone crops the model's input side, or the whole `resize` x `resize`
        image where that is smaller.
      device: "cpu", "cuda", ... (default: cuda if available).
      mode: ScatterNet's channels, "L" or "RGB": every image converted to it (Pillow's
        conversion, as torchvision's `ImageFolder` reads files as RGB), so that one grayscale
        image among colour ones gets the same channels; None keeps each image's own (arrays,
        one mode by construction). timm models always take RGB.
    """
    dev = resolve_device(device)
    if crop is not None and crop < 1 or resize is not None and resize < 1:
        raise ValueError(f"resize and crop must be positive, got resize={resize} crop={crop}")
    if resize is not None and crop is not None and crop > resize:
        raise ValueError(f"crop ({crop}) cannot exceed resize ({resize})")
    if mode not in (None, "L", "RGB"):
        raise ValueError(f"mode must be None, 'L' or 'RGB', got {mode!r}")
    if name == "scatternet":
        if weights is not None or random_init:
            raise ValueError("scatternet has no weights: drop `weights`/`random_init`")
        return _scatternet(dev, resize=resize, crop=crop, mode=mode)
    if weights is not None and random_init:
        raise ValueError("`weights` and `random_init` exclude each other")
    return _timm_backbone(name, weights, random_init, seed, resize, crop, dev)


def _timm_backbone(name, weights, random_init, seed, resize, crop, device) -> Backbone:
    import timm
    import timm.data

    base, tag = timm.models.split_model_name_tag(name)
    if not timm.is_model(base):
        raise ValueError(f"unknown timm model {base!r} (see timm.list_models())")
    kwargs: dict = {"num_classes": 0}
    provenance = {
        "name": name,
        "architecture": base,
        "tag": tag or None,
        "library": "timm",
        "timm_version": timm.__version__,
        "torch_version": torch.__version__,
        "embedding": "pooled pre-logits (num_classes=0)",
    }
    if weights is not None:
        path = Path(weights)
        if not path.is_file():
            raise FileNotFoundError(f"weights file {path} does not exist")
        if path.suffix not in (".safetensors", ".pth", ".pt", ".bin"):
            raise ValueError(f"weights must be .safetensors or .pth, got {path.name}")
        kwargs["pretrained_cfg_overlay"] = {"file": str(path.resolve()), "source": "file"}
        provenance |= {
            "weights_source": "file",
            "weights_file": str(path.resolve()),
            "weights_sha256": file_sha256(path),
        }
    elif random_init:
        provenance |= {"weights_source": "random-init", "seed": seed}
    else:
        provenance |= {"weights_source": "hub"}
    if crop is None and resize is not None and resize < _default_side(name):
        # The short side resized to R below the model's input side S: the whole R x R image,
        # as `dpprobe finetune --resize R` takes it. timm's transform alone would resize to S
        # again (crop_pct 1), so R would change nothing but the resampling.
        crop = resize
    if crop is not None:
        kwargs["img_size"] = crop  # ViT-style models resample position embeddings on load
    pretrained = not random_init
    torch.manual_seed(seed)
    missing: list[str] = []
    try:
        with _missing_keys_of_timm_load(missing):
            try:
                model = timm.create_model(name, pretrained=pretrained, **kwargs)
            except TypeError as err:
                if "img_size" not in str(err):
                    raise
                kwargs.pop("img_size")  # convolutional nets take any input size
                model = timm.create_model(name, pretrained=pretrained, **kwargs)
    except Exception as err:  # noqa: BLE001 - safetensors, pickle, shape errors alike
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        if weights is None and pretrained:
            raise RuntimeError(
                f"could not load pretrained weights for {name!r} from the hub ({first}). "
                "Offline? Pass `weights=PATH` to a local .safetensors/.pth file, "
                "or `random_init=True` for a test run."
            ) from err
        raise ValueError(f"`weights={weights}`: could not load it into {name!r} "
                         f"({type(err).__name__}: {first})") from err
    if missing:
        # timm loads non-strictly (the classifier is dropped): a file of another architecture
        # would load nothing at all. Refuse any parameter of the model the file lacks.
        raise ValueError(f"`weights={weights}` does not fit {name!r}: it lacks {len(missing)} of "
                         f"the model's parameters (e.g. {missing[0]}); nothing was loaded")
    model = model.eval().to(device)
    for param in model.parameters():
        param.requires_grad_(False)

    data_config = timm.data.resolve_model_data_config(model)
    if crop is not None:
        data_config["input_size"] = (3, crop, crop)
        data_config["crop_pct"] = crop / resize if resize is not None else 1.0
        data_config["crop_mode"] = "center"
    elif resize is not None:
        side = data_config["input_size"][-1]
        data_config["crop_pct"] = min(1.0, side / resize)
    tf = timm.data.create_transform(**data_config, is_training=False)

    def transform(image):
        return tf(image.convert("RGB") if image.mode != "RGB" else image)

    preprocessing = {
        "kind": "timm",
        "input_size": list(data_config["input_size"]),
        "interpolation": data_config.get("interpolation"),
        "mean": list(data_config["mean"]),
        "std": list(data_config["std"]),
        "crop_pct": data_config.get("crop_pct"),
        "crop_mode": data_config.get("crop_mode", "center"),
        "resize": resize,
        "crop": crop,
        "grayscale_to_rgb": True,
        "transform": repr(tf),
    }
    return Backbone(name, model, transform, provenance, preprocessing, device)


def _default_side(name: str) -> int:
    """The input side of timm model `name`'s pretrained config (224 where it names none)."""
    import timm.models

    cfg = timm.models.get_pretrained_cfg(name)
    return int(cfg.input_size[-1]) if cfg is not None and cfg.input_size else 224


def input_mismatch(first: tuple, shape: tuple, image: str) -> str:
    """Why `image`, whose preprocessed tensor has `shape` (C, H, W), cannot join a batch whose
    first image gave `first`: the real cause (its channels, or its size) and its remedy."""
    first, shape = tuple(first), tuple(shape)
    if len(first) == len(shape) == 3 and first[0] != shape[0]:
        return (f"{image} preprocesses to {shape[0]} channel(s), the first image to {first[0]}: "
                "a backbone that keeps each image's channels was given grayscale and colour "
                "images; convert them to one mode (ScatterNet does when its mode is 'L' or "
                "'RGB', as `extract` sets for image files)")
    return (f"{image} preprocesses to {shape}, the first image to {first}: pass `resize=R` "
            "`crop=S` so that every image gets one size")


class _MissingKeys(logging.Handler):
    def __init__(self, found: list[str]):
        super().__init__(logging.INFO)
        self.found = found

    def emit(self, record: logging.LogRecord) -> None:
        match = re.match(r"Missing keys \((.*)\) discovered", record.getMessage())
        if match:
            self.found.extend(key.strip() for key in match.group(1).split(","))


@contextlib.contextmanager
def _missing_keys_of_timm_load(found: list[str]):
    """Collect the model keys a timm pretrained load did not find in the checkpoint (timm
    only logs them, at INFO, when it loads non-strictly). Its key lists are not printed: a
    refused load says what is wrong in one line."""
    logger = logging.getLogger("timm.models._builder")
    handler, level, propagate = _MissingKeys(found), logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


class Scattering(torch.nn.Module):
    """The ScatterNet feature map of images of `shape` as a torch module (kymatio's
    `Scattering2D`: J scales, L angles)."""

    def __init__(self, shape: tuple[int, int], J: int = 2, L: int = 8):
        super().__init__()
        from kymatio.torch import Scattering2D

        self.scattering = Scattering2D(J=J, shape=shape, L=L)

    def forward(self, x):
        return self.scattering(x)


def _scattering_module(shape: tuple[int, int], J: int, L: int,
                       device: torch.device) -> torch.nn.Module:
    """The ScatterNet for images of `shape` on `device`: on the CPU the compiled XLA program
    (`scattering_xla`, kymatio's numbers within float32 rounding, several times faster), on
    an accelerator (and for images so small that kymatio pads them by a special case)
    kymatio's own module."""
    from dpprobe.extract.scattering_xla import ScatteringXLA, padding

    fits = all(max(pad) < side for pad, side in zip(padding(shape, J), shape, strict=True))
    if device.type == "cpu" and fits and 2 ** J <= min(shape):
        return ScatteringXLA(shape, J, L)
    return Scattering(shape, J, L).to(device)


def _scatternet(device, *, resize=None, crop=None, mode=None, J: int = 2, L: int = 8) -> Backbone:
    import kymatio
    import torchvision.transforms.functional as TF

    def transform(image):
        if mode is not None and image.mode != mode:
            image = image.convert(mode)
        if resize is not None:
            image = TF.resize(image, resize, antialias=True)
        if crop is not None:
            image = TF.center_crop(image, crop)
        array = np.asarray(image, dtype=np.float32) / 255.0
        return torch.from_numpy(array[None] if array.ndim == 2 else array.transpose(2, 0, 1))

    class _Lazy(torch.nn.Module):
        """Builds the filters for the first batch's image size (ScatterNet needs it)."""

        def __init__(self):
            super().__init__()
            self.inner, self.shape = None, None

        def forward(self, x):
            shape = tuple(x.shape[-2:])
            if self.inner is None or self.shape != shape:
                self.inner, self.shape = _scattering_module(shape, J, L, x.device), shape
            return self.inner(x)

    module = _Lazy().to(device)
    provenance = {
        "name": "scatternet",
        "library": "kymatio",
        "kymatio_version": kymatio.__version__,
        "torch_version": torch.__version__,
        "J": J,
        "L": L,
        "coefficients_per_channel": 1 + J * L + L * L * J * (J - 1) // 2,
        "weights_source": "none (fixed wavelets)",
        "embedding": "flattened scattering coefficients (channels x (1 + J L + L^2 J (J-1)/2) x "
        "H/2^J x W/2^J), channel-major",
    }
    preprocessing = {"kind": "scatternet", "scale": "pixel / 255", "resize": resize, "crop": crop}
    if mode is not None:  # absent: each image keeps its own channels (as in earlier stores)
        preprocessing["mode"] = mode
    return Backbone("scatternet", module, transform, provenance, preprocessing, device)
