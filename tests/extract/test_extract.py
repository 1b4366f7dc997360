"""Extraction: backbones equal calling the model by hand; weights files load; precomputed
embeddings (the data sources are tested in test_sources.py)."""

import dataclasses

import numpy as np
import pytest
import torch

from dpprobe import extract


def _array_split(rng, n=20, size=28, channels=None, classes=3):
    shape = (n, size, size) if channels is None else (n, size, size, channels)
    images = rng.integers(0, 256, size=shape, dtype=np.uint8)
    labels = rng.integers(0, classes, size=n)
    return extract.ImageSplit("synthetic", "train", labels, [str(c) for c in range(classes)],
                              "fp", array=images)


# (name, crop, resize, the input side expected): `resize` alone below the model's side (160
# for test_resnet) embeds the whole resized image, not one resized back to the model's side.
@pytest.mark.parametrize("name,crop,resize,side", [
    ("test_vit", 64, None, 64), ("vit_tiny_patch16_224.augreg_in21k", 32, None, 32),
    ("test_resnet", None, None, None), ("test_resnet", None, 24, 24)])
def test_random_init_timm_extraction_equals_model_by_hand(tmp_path, rng, name, crop, resize,
                                                          side):
    import timm

    split = _array_split(rng, n=10, size=40)
    backbone = extract.create_backbone(name, random_init=True, seed=3, crop=crop, resize=resize,
                                       device="cpu")
    store = str(tmp_path / "s.zarr")
    extract.extract_split(split, backbone, store, batch_size=4, dtype="float32", progress=False)
    stored, labels, attrs = extract.load_split(store, "train")
    # By hand: the same architecture and seed, preprocessed with timm's own transform.
    torch.manual_seed(3)
    kwargs = {"img_size": crop} if crop else {}
    model = timm.create_model(name, pretrained=False, num_classes=0, **kwargs).eval()
    cfg = timm.data.resolve_model_data_config(model)
    if side:
        cfg |= {"input_size": (3, side, side), "crop_pct": 1.0, "crop_mode": "center"}
    tf = timm.data.create_transform(**cfg)
    batch = torch.stack([tf(img.convert("RGB")) for img in split.images(range(10))])
    with torch.no_grad():
        expected = model(batch).numpy()
    np.testing.assert_allclose(stored, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(labels, split.labels)
    assert attrs["backbone"]["name"] == name
    assert attrs["backbone"]["weights_source"] == "random-init"
    assert attrs["backbone"]["timm_version"] == timm.__version__
    assert attrs["preprocessing"]["grayscale_to_rgb"] is True
    assert attrs["dataset"]["fingerprint"] == "fp"
    assert attrs["feature_dim"] == expected.shape[1]
    assert attrs["preprocessing"]["input_size"][-1] == (side or 160)


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_local_weights_file_is_loaded(tmp_path, rng, suffix):
    import safetensors.torch
    import timm

    torch.manual_seed(123)
    source = timm.create_model("test_vit", pretrained=False).eval()  # with its 1000-class head
    path = tmp_path / f"weights{suffix}"
    if suffix == ".safetensors":
        safetensors.torch.save_file(source.state_dict(), str(path))
    else:
        torch.save(source.state_dict(), path)
    backbone = extract.create_backbone("test_vit", weights=path, device="cpu", seed=999)
    split = _array_split(rng, n=4, size=160, channels=3)
    features = extract.embed_images(backbone, split, range(4))
    batch = torch.stack([backbone.transform(img) for img in split.images(range(4))])
    with torch.no_grad():
        expected = source.forward_head(source.forward_features(batch), pre_logits=True).numpy()
    np.testing.assert_allclose(features, expected, rtol=1e-5, atol=1e-6)
    # A random init with the same seed differs: the file really was loaded.
    random = extract.create_backbone("test_vit", random_init=True, seed=999, device="cpu")
    assert not np.allclose(extract.embed_images(random, split, range(4)), expected, atol=1e-3)
    assert backbone.provenance["weights_source"] == "file"
    assert backbone.provenance["weights_sha256"] == extract.file_sha256(path)


def test_missing_weights_and_offline_hub_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        extract.create_backbone("test_vit", weights=tmp_path / "nope.pth", device="cpu")
    with pytest.raises(ValueError, match="unknown timm model"):
        extract.create_backbone("not_a_model_xyz", random_init=True, device="cpu")
    with pytest.raises(RuntimeError, match="`weights=PATH`"):
        extract.create_backbone("test_vit", device="cpu")  # HF_HUB_OFFLINE=1 in tests


def test_scatternet_equals_kymatio_by_hand(rng):
    from kymatio.torch import Scattering2D

    split = _array_split(rng, n=6, size=28)
    backbone = extract.create_backbone("scatternet", device="cpu")
    features = extract.embed_images(backbone, split, range(6))
    assert features.shape == (6, 81 * 7 * 7)
    x = torch.from_numpy(split.array.astype(np.float32) / 255.0)[:, None]
    expected = Scattering2D(J=2, shape=(28, 28), L=8)(x).reshape(6, -1).numpy()
    np.testing.assert_allclose(features, expected, rtol=1e-5, atol=1e-6)
    rgb = _array_split(rng, n=2, size=16, channels=3)
    assert extract.embed_images(backbone, rgb, range(2)).shape == (2, 3 * 81 * 4 * 4)


@pytest.mark.parametrize("shape,J,L,channels", [((28, 28), 2, 8, 1), ((12, 12), 2, 8, 2),
                                                 ((32, 32), 3, 4, 3), ((24, 20), 2, 6, 1)])
def test_batched_scattering_is_kymatios(rng, shape, J, L, channels):
    from kymatio.torch import Scattering2D

    from dpprobe.extract.scattering import BatchedScattering2D

    x = torch.from_numpy(rng.normal(size=(3, channels, *shape)).astype(np.float32))
    x[1] *= 1e6  # large and small inputs, a constant image
    x[2] = 0.5
    theirs = Scattering2D(J=J, shape=shape, L=L)
    expected = theirs(x)
    scale = expected.abs().amax(dim=(-3, -2, -1), keepdim=True)  # per image and channel
    ours = BatchedScattering2D(J=J, shape=shape, L=L)
    fft = ours(x)
    assert fft.shape == expected.shape  # bit for bit here at J = 2; FFT batching may round
    assert ((fft - expected).abs() <= 1e-6 * scale).all()
    ours.dft = "matrix"  # the export's DFTs as matrix products: float32 rounding apart
    assert ((ours(x) - expected).abs() <= 4e-6 * scale).all()
    state, reference = ours.state_dict(), theirs.state_dict()
    assert list(state) == list(reference)
    assert all(torch.equal(state[k], reference[k]) for k in state)
    first = BatchedScattering2D(J=J, shape=shape, L=L, max_order=1)  # kymatio's own loop
    assert torch.equal(first(x), Scattering2D(J=J, shape=shape, L=L, max_order=1)(x))
    with pytest.raises(RuntimeError, match="spatial size"):
        ours(x[..., 1:].contiguous())


def test_batch_scatterings_swaps_kymatios_module_inside_a_model():
    from dpprobe.extract.scattering import BatchedScattering2D, batch_scatterings
    from dpprobe.model.torch_models import TorchScatterCNN

    torch.manual_seed(0)
    model = TorchScatterCNN(3, 2, 16, linear=True).eval()
    x = torch.rand(4, 2, 16, 16)
    with torch.no_grad():
        before = model(x)
        assert batch_scatterings(model) is model
        assert type(model.scattering) is BatchedScattering2D and model.scattering.dft == "matrix"
        assert (model(x) - before).abs().max() <= 1e-5 * before.abs().max()


class _Exploding(torch.nn.Module):
    """Wraps a backbone's module and fails on the n-th call, like a killed job."""

    def __init__(self, inner, fail_at):
        super().__init__()
        self.inner, self.calls, self.fail_at = inner, 0, fail_at

    def forward(self, x):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("killed")
        return self.inner(x)


def test_interrupted_extraction_is_not_complete_and_resumes_identically(tmp_path, rng):
    split = _array_split(rng, n=50, size=16)
    backbone = extract.create_backbone("scatternet", device="cpu")
    store = str(tmp_path / "s.zarr")
    with pytest.raises(RuntimeError, match="killed"):
        exploding = dataclasses.replace(backbone, module=_Exploding(backbone.module, 4))
        extract.extract_split(split, exploding, store, batch_size=8, rows_per_chunk=16,
                              progress=False)
    assert extract.split_attrs(store, "train")["complete"] is False
    with pytest.raises(extract.IncompleteSplitError):
        extract.load_split(store, "train")
    report = extract.extract_split(split, backbone, store, batch_size=8, rows_per_chunk=16,
                                   progress=False)
    assert report.resumed and report.complete and report.chunks_written == 3
    reference = str(tmp_path / "ref.zarr")
    extract.extract_split(split, backbone, reference, batch_size=8, rows_per_chunk=16,
                          progress=False)
    a, la, _ = extract.load_split(store, "train")
    b, lb, _ = extract.load_split(reference, "train")
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(la, lb)


def test_precomputed_embeddings_build_a_store(tmp_path, rng):
    features = rng.normal(size=(40, 6)).astype(np.float32)
    labels = rng.integers(0, 3, size=40)
    np.savez(tmp_path / "emb.npz", features=features, labels=labels)
    split = extract.open_source(f"npz:{tmp_path / 'emb.npz'}", precomputed=True,
                                num_classes=3)["train"]
    store = str(tmp_path / "s.zarr")
    extract.extract_split(split, None, store, dtype="float32", progress=False)
    loaded, loaded_labels, attrs = extract.load_split(store, "train")
    np.testing.assert_array_equal(loaded, features)
    np.testing.assert_array_equal(loaded_labels, labels)
    assert attrs["backbone"]["name"] == "none"
