"""masked_loss (train/masks.py): the loss ignores what the mask zeroes (negative control: no mask), masks from an
alpha channel or a mask folder are cached with their latents through the image's geometry and flip, and the
configuration keys' rules."""
import pytest
import torch
from PIL import Image

from squareq import runtime
from squareq.models import ADAPTERS
from squareq.train.config import ConfigError, load_config
from squareq.train.masks import ALPHA, latent_mask, load_mask
from squareq.train.objective import denoising_loss

pytestmark = pytest.mark.usefixtures("torch_kernels")


@pytest.fixture
def slab(tiny_slab):
    return tiny_slab


def _lora_gradients(model, latents, noise, t, text) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    recipe = ADAPTERS["flux"].recipe
    denoising_loss(model, recipe, "flow", latents, noise, t, text, 3.5).backward()
    return torch.cat([p.grad.flatten() for p in runtime.lora_parameters(model).values()])


def test_the_loras_gradient_ignores_what_the_mask_zeroes(slab):
    """Half the latent grid masked out: moving the training target there (the model's input unchanged) leaves the
    LoRA's gradient as it was. Negative control: without the mask the same move changes it."""
    model = runtime.load(slab, "cpu", options=runtime.LoadOptions(stream=False))
    runtime.add_lora(model, rank=4, seed=0)
    with torch.no_grad():
        for name, p in runtime.lora_parameters(model).items():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))  # so lora_A's gradient flows too
    cfg = model.config
    g = torch.Generator().manual_seed(2)
    latents = torch.randn(1, cfg.in_channels // 4, 8, 8, generator=g)
    noise = torch.randn(latents.shape, generator=g)
    t = torch.tensor([0.4])
    text = {"prompt_embeds": torch.randn(1, 16, cfg.joint_attention_dim, generator=g),
            "pooled_prompt_embeds": torch.randn(1, cfg.pooled_projection_dim, generator=g)}
    # x_t = (1 - t) x0 + t n is kept, the target n - x0 moves by -delta / t, on the right half only
    delta = torch.zeros_like(latents)
    delta[..., 4:] = 3.0
    moved_latents, moved_noise = latents + delta, noise - (1 - t) / t * delta
    mask = torch.ones(1, 1, 8, 8)
    mask[..., 4:] = 0.0

    masked = _lora_gradients(model, latents, noise, t, {**text, "loss_mask": mask})
    masked_moved = _lora_gradients(model, moved_latents, moved_noise, t, {**text, "loss_mask": mask})
    assert masked.abs().sum() > 0
    assert torch.allclose(masked, masked_moved, rtol=1e-3, atol=1e-6 * float(masked.abs().max()))

    plain = _lora_gradients(model, latents, noise, t, text)
    plain_moved = _lora_gradients(model, moved_latents, moved_noise, t, text)
    assert not torch.allclose(plain, plain_moved, rtol=1e-2)
    # what the mask keeps counts as before: the masked loss is the unmasked one without the right half's terms
    assert not torch.allclose(masked, plain, rtol=1e-2)


def _rgba(path, size=(64, 64)):
    """Opaque on the left half, transparent on the right."""
    img = Image.new("RGBA", size, (200, 40, 40, 255))
    for x in range(size[0] // 2, size[0]):
        for y in range(size[1]):
            img.putpixel((x, y), (40, 40, 200, 0))
    img.save(path)


def test_a_mask_follows_its_images_geometry_to_the_latent_grid(tmp_path):
    _rgba(tmp_path / "wide.png", (128, 64))  # a 2:1 image cropped to a square bucket: its middle half stays
    mask = load_mask(tmp_path / "wide.png", ALPHA, (64, 64))
    assert mask.shape == (1, 64, 64)
    assert torch.equal(mask[0, :, :32], torch.ones(64, 32)) and torch.equal(mask[0, :, 32:], torch.zeros(64, 32))
    down = latent_mask(mask, torch.zeros(16, 8, 8))
    assert down.shape == (1, 8, 8) and float(down[0, :, :4].min()) == 1.0 and float(down[0, :, 4:].max()) == 0.0
    assert latent_mask(mask, torch.zeros(16, 1, 8, 8)).shape == (1, 1, 8, 8)  # video latents: broadcast over frames
    Image.new("L", (32, 16), 255).save(tmp_path / "half-size.png")  # a mask file at another size than its image
    assert torch.equal(load_mask(tmp_path / "wide.png", tmp_path / "half-size.png", (64, 64)), torch.ones(1, 64, 64))
    Image.new("RGB", (64, 64)).save(tmp_path / "opaque.png")
    assert torch.equal(load_mask(tmp_path / "opaque.png", ALPHA, (64, 64)), torch.ones(1, 64, 64))


def _dataset(root):
    root.mkdir()
    for i, caption in enumerate(["a red thing", "a blue thing", "a green thing"]):
        _rgba(root / f"img{i}.png")
        (root / f"img{i}.txt").write_text(caption)
    return root


def _config(tmp_path, slab, **kw):
    values = {"slab": str(slab), "data": str(tmp_path / "data"), "output": str(tmp_path / "out"), "resolution": 64,
              "max_sequence_length": 16, "steps": 2, "lr": 1e-3, "rank": 4, "save_every": 0, "batch_size": 2,
              "cache_dir": str(tmp_path / "cache")}
    values.update(kw)
    return load_config(None, values)


def test_alpha_masks_are_cached_with_the_latents_and_flipped_with_them(tmp_path, slab):
    from squareq.train.loop import train
    from squareq.train.prepare import prepare_data

    _dataset(tmp_path / "data")
    cfg = _config(tmp_path, slab, masked_loss=True, alpha_mask=True, flip_aug=True)
    model = runtime.runtime_of(runtime.load(slab, "cpu", options=runtime.LoadOptions(stream=False))).manifest.model
    data = prepare_data(cfg, model, torch.device("cpu"), echo=lambda s: None)
    image_keys, _, flipped_keys = data.keys
    for key in image_keys:
        mask = data.cache.load("latents", key)["loss_mask"]
        assert mask.shape == (1, 8, 8) and float(mask[0, :, :4].min()) == 1.0 and float(mask[0, :, 4:].max()) == 0
    for key in flipped_keys:
        assert float(data.cache.load("latents", key)["loss_mask"][0, :, 4:].min()) == 1.0  # flipped: right half kept
    plain = prepare_data(_config(tmp_path, slab, cache_dir=str(tmp_path / "cache")), model, torch.device("cpu"),
                         echo=lambda s: None)
    assert not set(plain.keys[0]) & set(image_keys)  # unmasked entries are other entries
    assert "loss_mask" not in plain.cache.load("latents", plain.keys[0][0])
    result = train(cfg, echo=lambda s: None)
    assert result.steps == 2


def test_a_mask_folder_masks_the_images_it_has_masks_for(tmp_path, slab, caplog):
    from squareq.train.prepare import prepare_data

    _dataset(tmp_path / "data")
    masks = tmp_path / "masks"
    masks.mkdir()
    half = Image.new("L", (64, 64), 0)
    half.paste(255, (0, 0, 64, 32))  # the top half trains
    half.save(masks / "img0.jpg")  # another extension than its image
    Image.new("L", (64, 64), 128).save(masks / "img1.png")
    cfg = _config(tmp_path, slab, masked_loss=True, mask_dir=str(masks))
    model = runtime.runtime_of(runtime.load(slab, "cpu", options=runtime.LoadOptions(stream=False))).manifest.model
    with caplog.at_level("WARNING", logger="squareq.train"):
        data = prepare_data(cfg, model, torch.device("cpu"), echo=lambda s: None)
    assert "no mask for 1 of 3 training images" in caplog.text and "img2.png" in caplog.text
    entries = [data.cache.load("latents", k) for k in data.keys[0]]
    top = entries[0]["loss_mask"][0]
    assert float(top[:4].min()) > 0.99 and float(top[4:].max()) < 0.01
    assert torch.allclose(entries[1]["loss_mask"], torch.full((1, 8, 8), 128 / 255))
    assert "loss_mask" not in entries[2]
    from squareq.train.feed import CacheFeed

    feed = CacheFeed(data.cache, *data.keys[:2], data.captions, data.dropped, torch.device("cpu"))
    _, text = feed.batch([0, 2], [False, False])
    assert text["loss_mask"].shape == (2, 1, 8, 8) and torch.equal(text["loss_mask"][1], torch.ones(1, 8, 8))
    feed.close()


@pytest.mark.parametrize("values, message", [
    ({"masked_loss": True}, "masked_loss = true needs masks: set alpha_mask = true"),
    ({"alpha_mask": True}, "alpha_mask = true only takes effect with masked_loss = true"),
    ({"masked_loss": True, "alpha_mask": True, "mask_dir": "."}, "mask_dir = '.' and alpha_mask both give masks"),
    ({"masked_loss": True, "mask_dir": "/nonexistent/masks"}, "mask_dir = '/nonexistent/masks' is not a folder"),
])
def test_mask_keys_that_cannot_work_are_one_sentence(tmp_path, slab, values, message):
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, slab, **values).validate()


def test_kohyas_conditioning_data_dir_is_the_mask_folder(tmp_path, slab):
    toml = tmp_path / "kohya.toml"
    toml.write_text(f'masked_loss = true\nconditioning_data_dir = "{tmp_path}"\nnetwork_dim = 4\n')
    cfg = load_config(toml, {"slab": str(slab), "data": str(tmp_path), "output": str(tmp_path / "out")})
    assert cfg.masked_loss and cfg.mask_dir == str(tmp_path) and cfg.rank == 4


def _masked(tmp_path, values):
    """The three images of :func:`_dataset` with masks of grey ``values`` (None: no mask file)."""
    _dataset(tmp_path / "data")
    masks = tmp_path / "masks"
    masks.mkdir()
    for i, value in enumerate(values):
        if value is not None:
            Image.new("L", (64, 64), value).save(masks / f"img{i}.png")
    return masks


def test_black_masks_are_named_and_all_black_ones_refused(tmp_path, slab, caplog):
    """The third audit: all-black masks trained nothing (loss 0, grad norm 0, exit 0). Refused before the cache
    fills, naming a mask; one black mask among others is named in a warning and the run goes on (positive control)."""
    from squareq.train.data import DataError
    from squareq.train.loop import train

    masks = _masked(tmp_path, [0, 0, 0])
    with pytest.raises(DataError, match=r"every one of the 3 loss masks is black \(e\.g\. .*img0\.png\)"):
        train(_config(tmp_path, slab, masked_loss=True, mask_dir=str(masks)), echo=lambda s: None)
    assert not (tmp_path / "cache" / "latents").exists() or not any((tmp_path / "cache" / "latents").iterdir())
    Image.new("L", (64, 64), 255).save(masks / "img2.png")
    assert train(_config(tmp_path, slab, masked_loss=True, mask_dir=str(masks)), echo=lambda s: None).steps == 2
    assert any("2 of 3 loss masks are black" in r.getMessage() and "img0.png" in r.getMessage()
               for r in caplog.records)


def test_an_alpha_mask_without_alpha_is_named(tmp_path, slab, caplog):
    from squareq.train.masks import mask_sources

    data = _dataset(tmp_path / "data")
    Image.new("RGB", (64, 64), (9, 9, 9)).save(data / "img1.png")  # the RGB one
    items = [type("I", (), {"path": data / f"img{i}.png"})() for i in range(3)]
    assert mask_sources(items, data, True, None) == [ALPHA] * 3
    said = [r.getMessage() for r in caplog.records if "no alpha channel" in r.getMessage()]
    assert len(said) == 1 and "1 of 3 images" in said[0] and "img1.png" in said[0]
    caplog.clear()
    _rgba(data / "img1.png")  # the negative control: every image has alpha, nothing is said
    mask_sources(items, data, True, None)
    assert not [r for r in caplog.records if "no alpha channel" in r.getMessage()]


def test_a_mask_that_cannot_be_read_or_is_too_large_is_one_sentence(tmp_path, monkeypatch):
    """An unreadable mask said "training failed at the output", naming no file; a decompression bomb was PIL's
    exception. Both are one sentence naming the mask now; a readable one of a sane size passes."""
    from squareq.train import masks as mask_module
    from squareq.train.data import DataError

    folder = _masked(tmp_path, [255, 255, 255])
    items = [type("I", (), {"path": tmp_path / "data" / f"img{i}.png"})() for i in range(3)]
    assert mask_module.mask_sources(items, tmp_path / "data", False, str(folder))[0] == folder / "img0.png"
    monkeypatch.setattr(mask_module, "MAX_MASK_PIXELS", 64 * 64 - 1)
    with pytest.raises(DataError, match=r"the mask .*img0\.png is 64x64 pixels, more than SquareQ reads"):
        mask_module.mask_sources(items, tmp_path / "data", False, str(folder))
    monkeypatch.undo()
    from PIL import Image  # PIL refuses past twice its own limit in open(), before our check: still our sentence
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(DataError, match=r"the mask .*img0\.png is 4,096 pixels, more than SquareQ reads"):
        mask_module.mask_sources(items, tmp_path / "data", False, str(folder))
    monkeypatch.undo()
    (folder / "img1.png").write_bytes(b"\x89PNG\r\n\x1a\n not a png")
    with pytest.raises(DataError, match=r"the mask .*img1\.png cannot be read \(") as refused:
        mask_module.mask_sources(items, tmp_path / "data", False, str(folder))
    assert str(refused.value).count(". ") == 0


def test_a_16_bit_greyscale_mask_is_scaled_not_clipped(tmp_path):
    """The fourth audit: PIL's convert("L") clips 16-bit values at 255, so a 50% mask read as 100% (exit 0)."""
    import numpy as np
    from PIL import Image

    from squareq.train.masks import load_mask

    image, mask = tmp_path / "a.png", tmp_path / "m.png"
    Image.new("RGB", (8, 8), 100).save(image)
    Image.fromarray(np.full((8, 8), 32768, dtype=np.uint16)).save(mask)
    with Image.open(mask) as m:
        assert np.asarray(m.convert("L")).max() == 255  # the clipping this test guards against
    got = load_mask(image, mask, (8, 8))
    assert torch.allclose(got, torch.full_like(got, 128 / 255))
    Image.new("L", (8, 8), 128).save(mask)  # positive control: an 8-bit mask of the same value reads the same
    assert torch.allclose(load_mask(image, mask, (8, 8)), got)
