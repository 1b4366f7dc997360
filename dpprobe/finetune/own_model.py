"""Your own Flax NNX module as the finetune job's model (`dpprobe.finetune(model=module)`).

The module takes a float batch of images (n, H, W, C), the data's channels as they are, scaled
to [-1, 1] ((pixel / 255 - 0.5) / 0.5, public constants), and returns logits (n, classes): it
must end in as many outputs as the data has classes. `train="head"` trains its attribute
`head`, `train="bias"` its parameters named `bias` and the head (`finetune.modes`). Its initial
parameters are the run's starting point and are treated as public: they must not come from the
private data.

Clipping: book-keeping (`dp.bookkeeping`) on the layers it has rules for (`nnx.Linear`,
`nnx.Conv` incl. grouped and depthwise, `dp.flax_rules`), per-example offsets for norms and
embeddings (`nnx.LayerNorm`, `nnx.GroupNorm`, `nnx.RMSNorm`, `nnx.Embed`, `nnx.BatchNorm` with
frozen statistics); any other layer with parameters is clipped exactly through per-example
gradients and named in a one-line notice on stderr. An `nnx.BatchNorm` that normalizes with
batch statistics is refused: under DP-SGD each example's forward pass must be its own.

Released: the model file holds the trained parameters and the module's class name
(`dpmodel.network`, family "own_module"); the class itself is your code, so
`dpprobe.load_model(path, module=<an instance of it>)` rebuilds the model from it (the job's
own `JobResult.models` already does).
"""

from __future__ import annotations

from typing import Any

__all__ = ["OWN_MEAN_STD", "check_own_module", "own_model_parts", "own_module",
           "own_module_name"]

OWN_MEAN_STD = (0.5, 0.5)  # every channel's (mean, std): images in [-1, 1]


def own_module(model: Any) -> Any:
    """`model` when it is a module (not a name, not None), else None."""
    return None if model is None or isinstance(model, str) else model


def own_module_name(model: Any) -> Any:
    """The qualified class name of a module; a name or None unchanged."""
    if own_module(model) is None:
        return model
    cls = type(model)
    return f"{cls.__module__}.{cls.__qualname__}"


def check_own_module(module: Any, config: Any) -> None:
    """ValueError (one line) for what an own module cannot take.

    Args:
      module: the given `model`.
      config: the job's `FinetuneConfig` (its `train`, `weights`, `random_init`).
    """
    from flax import nnx

    if not isinstance(module, nnx.Module):
        raise ValueError(f"`model` is a name or a Flax NNX module (`flax.nnx.Module`), got "
                         f"{type(module).__name__}")
    if config.weights or config.random_init:
        raise ValueError("`weights` and `random_init` are for a timm model; an own module "
                         "starts from its own parameters")
    if config.train == "lora":
        raise ValueError("`train=lora` adapts a ViT's attention and MLP layers; an own module: "
                         "train all, head or bias")
    for path, layer in nnx.iter_modules(module):
        if isinstance(layer, nnx.BatchNorm) and not layer.use_running_average:
            raise ValueError(f"`model`'s BatchNorm {'.'.join(map(str, path))} normalizes by "
                             "the batch's statistics, which mix examples: build it with "
                             "use_running_average=True (frozen statistics)")


def own_model_parts(module: Any, image_size: int, channels: int, num_classes: int) -> tuple:
    """(a copy of the module, mean, std, its public description) for the job.

    Args:
      module: the given module (never changed: the job trains a copy).
      image_size, channels: the model's input side and channels.
      num_classes: the data's classes: ValueError unless the module gives that many logits.

    Returns:
      The job's (model, per-channel mean, per-channel std, description).
    """
    import jax
    from flax import nnx

    shape = nnx.eval_shape(lambda m, x: m(x), module, jax.ShapeDtypeStruct(
        (2, image_size, image_size, channels), jax.numpy.float32)).shape
    if tuple(shape) != (2, num_classes):
        raise ValueError(f"`model` maps 2 images of {image_size} x {image_size} x {channels} to "
                         f"{tuple(shape)}; the data needs (2, {num_classes}) logits")
    mean, std = OWN_MEAN_STD
    return nnx.clone(module), (mean,) * channels, (std,) * channels, {
        "name": own_module_name(module), "family": "own_module",
        "weights": "the given module's own parameters",
        "input": f"{image_size} px, scaled to [-1, 1]"}
