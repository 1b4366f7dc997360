"""BEiT (`finetune.models.beit`): timm's relative position index, the weight map both ways
(strict loads into timm), LoRA and bias modes clipped as per-example clipping, and the whole
path `dpprobe finetune --model <timm BEiT name> --weights FILE` -> model file -> `dpprobe
export --format timm|torch|onnx`. The logits and the clipping of every parameter (tables, layer
scale, q/v biases) are the contract's (`tests/test_contract.py`, TestBeit*)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import dpprobe.finetune.models as fm
from dpprobe import finetune
from dpprobe import model as dpmodel
from dpprobe.finetune.models.beit import relative_position_index
from dpprobe.finetune.models.beit_weights import beit_timm_arrays, load_beit_into_timm
from dpprobe.pipelines import cli
from tests.model_helpers import nchw01, network_file, perturb_nnx, uint8_images

CLASSES = 4
TINY = {"img_size": 32, "patch_size": 8, "embed_dim": 64, "depth": 2, "num_heads": 2}
# A registry name for the tiny BEiT, so that the command line can build it by name (as it
# builds beit_base_patch16_224): the same constructor, timm's `_create_beit`.
TEST_NAME = "beit_test_patch8_32"


def beit_test_patch8_32(pretrained=False, **kwargs):
    """The tiny BEiT's timm entry point (beit_base_patch16_224's arguments at the tiny size)."""
    from timm.models.beit import _create_beit

    args = dict(TINY, use_abs_pos_emb=False, use_rel_pos_bias=True, init_values=0.1)
    return _create_beit(TEST_NAME, pretrained=pretrained, **dict(args, **kwargs))


def _default_cfgs() -> dict:
    from timm.models.beit import _cfg

    return {TEST_NAME: _cfg()}  # timm's BEiT defaults: the head is `head`, dropped on load


default_cfgs: dict = {}  # read by timm's `register_model` from this module


def _register_tiny_beit() -> None:
    import timm
    from timm.models import register_model

    if not timm.is_model(TEST_NAME):
        default_cfgs.update(_default_cfgs())
        register_model(beit_test_patch8_32)


def _timm_beit(seed: int, classes: int = CLASSES, **kwargs):
    """timm's beit_base_patch16_224 family at the tiny size, every tensor perturbed (timm
    zero-initializes the tables and q/v biases)."""
    import timm

    torch.manual_seed(seed)
    model = timm.create_model("beit_base_patch16_224", pretrained=False, num_classes=classes,
                              **TINY, **kwargs).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model


def test_relative_position_index_is_timms():
    from timm.models.beit import gen_relative_position_index

    for grid in [(4, 4), (2, 3), (3, 1)]:
        np.testing.assert_array_equal(relative_position_index(grid),
                                      gen_relative_position_index(grid).numpy())


@pytest.mark.parametrize("kwargs", [{}, {"use_rel_pos_bias": False,
                                         "use_shared_rel_pos_bias": True,
                                         "use_abs_pos_emb": True, "global_pool": "token"}])
def test_weight_map_round_trips_and_loads_strictly_into_timm(kwargs):
    """timm -> ours -> (every parameter changed) -> a fresh timm model (strict load): its
    logits are ours within 1e-4, and reading it back gives our parameters exactly."""
    ours = fm.beit_from_timm(_timm_beit(0, **kwargs), None, rngs=nnx.Rngs(0))
    key = jax.random.key(1)
    for i, (_, param) in enumerate(p for p in nnx.iter_graph(ours) if isinstance(p[1],
                                                                                nnx.Param)):
        param[...] = param[...] + 0.05 * jax.random.normal(jax.random.fold_in(key, i),
                                                           param.shape)
    target = _timm_beit(5, **kwargs)
    load_beit_into_timm(ours, target)
    x = np.random.default_rng(0).normal(size=(3, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        theirs = target(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(x.transpose(0, 2, 3, 1)))), theirs,
                               atol=1e-4, rtol=0)
    again = fm.beit_from_timm(target, None, rngs=nnx.Rngs(0))
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(ours, nnx.Param)),
                                 nnx.to_flat_state(nnx.state(again, nnx.Param)), strict=True):
        np.testing.assert_array_equal(a[...], b[...], err_msg=str(path))
    assert set(beit_timm_arrays(ours)) == set(target.state_dict())


def test_unsupported_variants_are_refused():
    import timm

    for kwargs, message in [({"scale_mlp": True}, "plain Mlp"),
                            ({"swiglu_mlp": True}, "plain Mlp")]:
        model = timm.create_model("beit_base_patch16_224", pretrained=False, **TINY, **kwargs)
        with pytest.raises(ValueError, match=message):
            fm.beit_from_timm(model, CLASSES, rngs=nnx.Rngs(0))
    other = fm.beit_from_timm(_timm_beit(0), None, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="architecture differs"):
        load_beit_into_timm(other, _timm_beit(0, use_abs_pos_emb=True))


@pytest.mark.parametrize("mode", ["lora", "bias"])
def test_lora_and_bias_modes_clip_as_per_example_clipping(mode, rng):
    """LoRA on every block's qkv, proj, fc1 and fc2 (the ViT's adapters), and the bias mode
    (q_bias and v_bias included): book-keeping and per-example clipping of the trained
    parameters give the same clipped sum within 1e-5 relative."""
    model = fm.beit_from_timm(_timm_beit(0), CLASSES, rngs=nnx.Rngs(0))
    if mode == "lora":
        finetune.add_lora(model, 2, rngs=nnx.Rngs(1))
        assert isinstance(model.blocks[1].mlp.fc2, nnx.LoRA)
    perturb_nnx(model, 0.1)  # the zero head and B = 0 too
    spec = finetune.FinetuneSpec(CLASSES, optimizer="sgd", learning_rate=0.5, ema_decay=None,
                                 mean=(0.5,) * 3, std=(0.5,) * 3, train=mode)
    graphdef, params, rest = finetune.split_trained(model, spec)
    names = {"/".join(map(str, k)) for k, _ in nnx.to_flat_state(params)}
    if mode == "bias":
        assert "blocks/0/attn/q_bias" in names and "blocks/1/attn/v_bias" in names
    else:
        assert "blocks/0/attn/qkv/lora_a" in names
    images, labels = uint8_images(6, 32, 3), rng.integers(0, CLASSES, 6)
    mask = np.array([1, 1, 1, 0, 1, 1], np.float32)
    sums = [finetune.clipped_sum(
        graphdef, params, rest, jnp.asarray(images), jnp.asarray(labels), jnp.asarray(mask),
        jnp.arange(6, dtype=jnp.int32), jnp.float32(0.5), jax.random.key(0), spec=spec,
        flags=finetune.FinetuneFlags(physical_batch_size=6, clipping=clipping))
        for clipping in ("bookkeeping", "per_example")]
    flat = [np.concatenate([np.ravel(v) for v in jax.tree.leaves(s)]).astype(np.float64)
            for s in sums]
    assert np.linalg.norm(flat[1]) > 0.1
    assert np.linalg.norm(flat[0] - flat[1]) <= 1e-5 * np.linalg.norm(flat[1])


def test_finetune_from_a_weights_file(rng, tmp_path, monkeypatch):
    """`dpprobe finetune --model <a BEiT registry name> --weights FILE` (timm's state dict,
    loaded by timm, refused if it lacks a tensor) builds our BEiT from the file and trains a
    DP step."""
    import timm

    from tests.pipelines.test_finetune_job import _finetune, _images, _write

    _register_tiny_beit()
    torch.manual_seed(0)
    source = timm.create_model(TEST_NAME, pretrained=False, num_classes=10)
    with torch.no_grad():
        for param in source.parameters():
            param.add_(0.05 * torch.randn_like(param))
    torch.save(source.state_dict(), tmp_path / "beit.pth")
    _write(tmp_path, _images(rng, 16, 32, 3), _images(rng, 8, 32, 3))
    monkeypatch.chdir(tmp_path)
    assert _finetune("--model", TEST_NAME, "--weights", "beit.pth", "--steps", "1",
                     "--batch-size", "8", "--physical-batch-size", "8", "--augmult", "1",
                     "--lr", "1e-5", "--ema-decay", "0", "--out", "run", "--quiet") == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["model"]["weights_source"] == "file"
    saved, _ = dpmodel.read_model_file(tmp_path / "run" / "model.safetensors")
    # One step at a tiny learning rate: the tensors are still the file's.
    for ours, theirs in [("blocks/1/attn/relative_position_bias_table",
                          source.blocks[1].attn.relative_position_bias_table),
                         ("blocks/0/attn/q_bias", source.blocks[0].attn.q_bias),
                         ("blocks/0/gamma_2", source.blocks[0].gamma_2)]:
        np.testing.assert_allclose(saved["params/" + ours], theirs.detach().numpy(), atol=1e-3)
    torch.save({k: v for k, v in source.state_dict().items() if "gamma_1" not in k},
               tmp_path / "partial.pth")
    assert _finetune("--model", TEST_NAME, "--weights", "partial.pth", "--steps", "1",
                     "--out", "run2", "--quiet") == 2


def test_a_finetuned_beit_exports_to_timm_torch_and_onnx(tmp_path):
    """A BEiT model file (every parameter perturbed): `--format timm` loads strictly into
    `timm.create_model(name, num_classes=K, img_size=S)` and gives `dpprobe predict`'s logits
    within 1e-4, as do the `--format torch` and `--format onnx` exports."""
    import safetensors.torch
    import timm

    from tests.model.test_export import _compare

    _register_tiny_beit()
    torch.manual_seed(0)
    model = fm.model_from_timm(timm.create_model(TEST_NAME, pretrained=False), CLASSES,
                               rngs=nnx.Rngs(0))
    perturb_nnx(model, 0.05)
    mean, std = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
    path = network_file(tmp_path / "beit.safetensors", model, name=TEST_NAME, side=32,
                        channels=3, mean=mean, std=std, rgb=True, timm_architecture=TEST_NAME)
    images = uint8_images(3, 32, 3)
    _compare(path, images, tmp_path)  # --format torch and onnx
    out = tmp_path / "beit_timm.safetensors"
    assert cli.main(["export", "--model", path, "--format", "timm", str(out), "--quiet"]) == 0
    loaded = timm.create_model(TEST_NAME, pretrained=False, num_classes=CLASSES, img_size=32)
    loaded.load_state_dict(safetensors.torch.load_file(out), strict=True)
    with torch.no_grad():
        theirs = loaded.eval()((torch.from_numpy(nchw01(images)) - 0.5) / 0.5).numpy()
    assert np.abs(theirs - dpmodel.load_model(path).logits(images)).max() <= 1e-4
