"""FLUX.2's reference images (train/controls.py, models/flux2.py): each target with TWO references, found in
musubi-tuner's numbering and ai-toolkit's folder list, encoded by the pipeline's own VAE (patchify + batch norm) and
cached as ``control_0``, ``control_1``, appended after the target's tokens with ids (10 + 10k, row, column, 0) as
Flux2Pipeline builds them, and drawn from with --control / --ci. Negative controls: the references' order and content
change the loss (and their order only through the ids' time coordinate), a missing reference skips its target by
name, too many and too small ones are refused by name."""
import json
import logging

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from squareq import runtime
from squareq.cli import main
from squareq.models import ADAPTERS, flux2
from squareq.models.flux2 import flux2_forward
from squareq.models.flux_latents import pack_latents
from squareq.models.recipe import unpack_2x2_output
from squareq.train.buckets import control_bucket
from squareq.train.cache import EmbeddingCache
from squareq.train.config import load_config
from squareq.train.controls import attach_controls, check_pairs, control_tokens
from squareq.train.data import Control, DataError, Dataset, Item, load_image, scan_dataset
from squareq.train.loop import train
from squareq.train.objective import denoising_loss
from squareq.train.prompt_options import parse_prompt
from squareq.train.sample import SampleError, check_prompts

from ..models.tiny_folders import build_pipeline
from .test_edit_pairs import _found, _view
from .tiny_run import resumes_bit_for_bit, w8_tiny_slab

pytestmark = pytest.mark.usefixtures("torch_kernels")

COLORS = [(220, 30, 30), (30, 30, 220), (30, 200, 30), (230, 230, 20)]
EDITS = ["put the hat on the cat", "put the cat in the box", "paint the box red", "set the box on the hat"]


def _pipe():
    """FLUX.2's toy pipeline (tests/models/tiny_folders.py), whose transformer the slab holds."""
    return build_pipeline("tiny-flux2")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A Flux2Pipeline folder, a W8 slab of its transformer, four 64x64 targets with two references each in
    ai-toolkit's list of folders (``refs0/img0.png`` 64x64, ``refs1/img0.jpg`` 96x64, kept at their size), and a
    fifth target whose second reference is missing."""
    root = tmp_path_factory.mktemp("references")
    pipe = _pipe()
    pipe.save_pretrained(root / "pipeline", safe_serialization=True)
    w8_tiny_slab(root / "flux2.slab", "tiny-flux2", pipe.transformer)
    for folder in ("data", "refs0", "refs1"):
        (root / folder).mkdir()
    for i, (color, edit) in enumerate(zip(COLORS + [(9, 9, 9)], EDITS + ["an edit"])):
        Image.new("RGB", (64, 64), color).save(root / "data" / f"img{i}.png")
        (root / "data" / f"img{i}.txt").write_text(edit)
        Image.new("RGB", (64, 64), color[::-1]).save(root / "refs0" / f"img{i}.png")
        if i < 4:
            Image.new("RGB", (96, 64), (color[1], 90, color[0])).save(root / "refs1" / f"img{i}.jpg")
    return root


def _config(ws, out, **kw):
    values = {"slab": str(ws / "flux2.slab"), "model": str(ws / "pipeline"), "data": str(ws / "data"),
              "output": str(out), "resolution": 64, "max_sequence_length": 16, "steps": 4, "lr": 3e-3, "rank": 4,
              "save_every": 2, "batch_size": 2, "cache_dir": str(ws / "cache"),
              "control_dir": [str(ws / "refs0"), str(ws / "refs1")]}
    values.update(kw)
    return load_config(None, values)


# ---------------------------------------------------------------------------------------------- the conditioning

def test_the_reference_tokens_and_ids_are_flux2_pipelines_own():
    """hidden_states = [target | reference_0 | reference_1], each patchified and packed as the pipeline does; ids the
    pipeline's _prepare_latent_ids then _prepare_image_ids, (0, i, j, 0), (10, i, j, 0), (20, i, j, 0); text ids its
    _prepare_text_ids; the prediction its noise_pred[:, :N], unpacked by ids and unpatchified."""
    from diffusers import Flux2Pipeline as P

    g = torch.Generator().manual_seed(0)
    x_t = torch.randn(2, 4, 8, 6, generator=g)
    refs = [torch.randn(2, 4, 4, 10, generator=g), torch.randn(2, 4, 6, 6, generator=g)]
    text = {"prompt_embeds": torch.randn(2, 5, 48, generator=g), "control_0": refs[0], "control_1": refs[1]}
    kwargs = flux2_forward(type("Cfg", (), {"guidance_embeds": True})(), x_t, torch.tensor([0.3, 0.6]), text, 1.0)

    assert torch.equal(kwargs["hidden_states"], torch.cat([P._pack_latents(P._patchify_latents(z)) for z in
                                                           (x_t, *refs)], dim=1))
    latent_ids = P._prepare_latent_ids(P._patchify_latents(x_t))
    image_ids = P._prepare_image_ids([P._patchify_latents(r[:1]) for r in refs])
    assert torch.equal(kwargs["img_ids"], torch.cat([latent_ids, image_ids.expand(2, -1, -1)], dim=1)[0].float())
    times = kwargs["img_ids"][:, 0]
    assert times[:12].eq(0).all() and times[12:22].eq(10).all() and times[22:].eq(20).all()
    assert kwargs["img_ids"][:, 3].eq(0).all()
    assert torch.equal(kwargs["txt_ids"], P._prepare_text_ids(text["prompt_embeds"])[0].float())
    assert "control_0" not in kwargs and torch.equal(kwargs["guidance"], torch.ones(2))
    output = torch.randn(2, 12 + 10 + 9, 16, generator=g)
    assert torch.equal(unpack_2x2_output((output,), x_t),
                       P._unpatchify_latents(P._unpack_latents_with_ids(output[:, :12], latent_ids)))


def test_a_reference_is_brought_to_its_size_as_flux2_pipeline_brings_it(tmp_path):
    """Past 1024² a reference is scaled down to that area (sides truncated) and center-cropped to 16s; within it, only
    cropped, never enlarged: the pixels equal the pipeline's own preprocessing."""
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    processor = Flux2ImageProcessor(vae_scale_factor=16)
    g = torch.Generator().manual_seed(1)
    for size in [(1100, 1000), (150, 70)]:
        path = tmp_path / f"{size[0]}.png"
        Image.fromarray(torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy()).save(path)
        area, resize = ADAPTERS["flux2"].recipe.control_area, False
        bucket = control_bucket(Control(path, *size, area, resize), (64, 64))
        ours = load_image(path, bucket, crop_only=True, area=area)
        img = Image.open(path).convert("RGB")
        if img.width * img.height > 1024 * 1024:
            img = processor._resize_to_target_area(img, 1024 * 1024)
        w, h = img.width // 16 * 16, img.height // 16 * 16
        assert bucket == (w, h)
        theirs = processor.preprocess(img, height=h, width=w, resize_mode="crop")[0]
        assert torch.allclose(ours, theirs, atol=1e-6), size


def _loss(model, latents, noise, t, text) -> float:
    with torch.no_grad():
        return float(denoising_loss(model, ADAPTERS["flux2"].recipe, "flow", latents, noise, t, text, 1.0))


def test_the_references_order_and_content_change_the_loss(tmp_path, monkeypatch):
    """The same references give the same loss; swapped, or one of them replaced, another. Swapped references of one
    size differ only in their ids' time coordinate (attention sees no order but the ids'): with every reference at
    T = 10 (the negative control's wrong ids) the swap leaves the loss as it was."""
    model = runtime.load(w8_tiny_slab(tmp_path / "tiny.slab", "tiny-flux2"), "cpu",
                         options=runtime.LoadOptions(stream=False))
    cfg = model.config
    g = torch.Generator().manual_seed(3)
    latents = torch.randn(2, cfg.in_channels // 4, 8, 8, generator=g)
    noise, t = torch.randn(latents.shape, generator=g), torch.tensor([0.4, 0.7])
    a, b = (torch.randn(2, cfg.in_channels // 4, 8, 8, generator=g) * 2 for _ in range(2))
    text = {"prompt_embeds": torch.randn(2, 8, cfg.joint_attention_dim, generator=g)}
    paired = _loss(model, latents, noise, t, {**text, "control_0": a, "control_1": b})
    assert paired == _loss(model, latents, noise, t, {**text, "control_0": a.clone(), "control_1": b.clone()})
    swapped = _loss(model, latents, noise, t, {**text, "control_0": b, "control_1": a})
    assert abs(swapped - paired) > 1e-4 * paired
    assert abs(_loss(model, latents, noise, t, {**text, "control_0": a, "control_1": a}) - paired) > 1e-4 * paired
    monkeypatch.setattr(flux2, "reference_index", lambda k: 10)
    flat = _loss(model, latents, noise, t, {**text, "control_0": a, "control_1": b})
    assert abs(_loss(model, latents, noise, t, {**text, "control_0": b, "control_1": a}) - flat) < 1e-6 * flat


# ---------------------------------------------------------------------------------------------- a run

def test_a_flux2_run_with_two_references_caches_them_resumes_bit_for_bit_and_samples(workspace, tmp_path, caplog):
    ws = workspace
    refs = [str(ws / "refs0" / "img0.png"), str(ws / "refs1" / "img0.jpg")]
    lines = []
    with caplog.at_level(logging.WARNING, logger="squareq.train"):
        straight = train(_config(ws, tmp_path / "straight"), echo=lines.append)
    assert straight.steps == 4
    assert f"img4.png has no control image in {ws / 'refs1'}" in caplog.text  # its second is missing: skipped
    assert any(line == "edit pairs: 4 images with 2 control images; control sizes (entries an epoch): "
                       "64x64 + 96x64: 4" for line in lines), lines

    cache = EmbeddingCache(ws / "cache")
    entries = [cache.load("latents", p.stem) for p in sorted((ws / "cache" / "latents").iterdir())]
    assert len(entries) == 4
    assert all(e["latents"].shape == e["control_0"].shape == (4, 8, 8) and e["control_1"].shape == (4, 8, 12)
               for e in entries)
    # the cached references are what Flux2Pipeline.prepare_image_latents makes of them (its VAE's mode, patchified,
    # batch-norm normalized, packed), in order
    pipe = _pipe()
    processed = [pipe.image_processor.preprocess(Image.open(r).convert("RGB"), resize_mode="crop") for r in refs]
    with torch.no_grad():
        tokens, _ = pipe.prepare_image_latents([p.contiguous() for p in processed], 1, None, "cpu", torch.float32)
    packed = [torch.cat([pack_latents(e["control_0"][None]), pack_latents(e["control_1"][None])], dim=1)
              for e in entries]
    # (its pixels made contiguous, as ours are: channels-last pixels take another CPU convolution, 4e-3 apart; on a
    # GPU the cache encodes in bf16)
    tol = 5e-2 if torch.cuda.is_available() else 1e-6
    assert sum(torch.allclose(p.float().cpu(), tokens, atol=tol) for p in packed) == 1  # img0's; the others far off

    resumes_bit_for_bit(lambda **kw: _config(ws, tmp_path / "killed", **kw), straight.lora_file, killed_at=3)

    # squareq sample: --control twice gives both references in order; a prompt's --ci in the other order draws
    # another image from the same seed
    result = CliRunner().invoke(main, ["sample", str(ws / "flux2.slab"), "--model", str(ws / "pipeline"),
                                       "--prompt", "put the hat on the cat", "--prompt",
                                       f"put the hat on the cat --ci {refs[1]} --ci {refs[0]}",
                                       "--control", refs[0], "--control", refs[1], "--lora", str(tmp_path / "straight"),
                                       "--resolution", "64", "--steps", "2", "--max-sequence-length", "16",
                                       "-o", str(tmp_path / "drawn")])
    assert result.exit_code == 0, result.output
    drawn = [np.asarray(Image.open(tmp_path / "drawn" / f"sample-00{i}.png")).astype(float) for i in (0, 1)]
    assert drawn[0].shape == (64, 64, 3) and np.abs(drawn[0] - drawn[1]).mean() > 0.5


# ---------------------------------------------------------------------------------------------- finding references

def test_references_are_found_in_order_and_a_missing_one_skips_its_target_by_name(tmp_path, caplog):
    """musubi's numbering in one folder, ai-toolkit's list of folders, metadata.jsonl's control_path_0/_1: both
    references in order, each kept at its size up to 1024² (FLUX.2's default; FLUX.1 Kontext's: the target's
    bucket). A target missing one is skipped with a warning naming the file or field."""
    data = tmp_path / "data"
    data.mkdir()
    for name in ["a", "b"]:
        Image.new("RGB", (64, 64)).save(data / f"{name}.png")
        (data / f"{name}.txt").write_text("an edit")
    dataset = scan_dataset(data, min_side=16)
    one, first, second = tmp_path / "one", tmp_path / "first", tmp_path / "second"
    for folder, names in [(one, ["a_1.png", "a_0.png", "b_0.png"]), (first, ["a.png", "b.png"]), (second, ["a.png"])]:
        folder.mkdir()
        for name in names:
            Image.new("RGB", (80, 48)).save(folder / name)
    with caplog.at_level(logging.WARNING, logger="squareq.train"):
        numbered = attach_controls(dataset, _view(control_dir=[str(one)]), "flux2")
        listed = attach_controls(dataset, _view(control_dir=[str(first), str(second)]), "flux2")
    assert _found(numbered) == {"a.png": ["a_0.png", "a_1.png"], "b.png": ["b_0.png"]}  # one reference is enough
    assert _found(listed) == {"a.png": ["a.png", "a.png"]} and listed.items[0].controls[1].path.parent == second
    assert f"b.png has no control image in {second}" in caplog.text
    assert {(c.area, c.resize) for c in numbered.items[0].controls} == {(1024 * 1024, False)}
    assert attach_controls(dataset, _view(control_dir=[str(one)]), "flux").items[0].controls[0].resize
    lines = [{"file_name": "a.png", "control_path_0": "r/a0.png", "control_path_1": "r/a1.png"},
             {"file_name": "b.png", "control_path_0": "r/b0.png", "control_path_1": "r/gone.png"}]
    (data / "r").mkdir()
    for name in ["a1.png", "a0.png", "b0.png"]:
        Image.new("RGB", (80, 48)).save(data / "r" / name)
    (data / "metadata.jsonl").write_text("\n".join(map(json.dumps, lines)))
    with caplog.at_level(logging.WARNING, logger="squareq.train"):
        jsonl = attach_controls(Dataset(data, dataset.items), _view(), "flux2")
    assert _found(jsonl) == {"a.png": ["a0.png", "a1.png"]}
    assert "b.png's metadata.jsonl line names control_path_1 = 'r/gone.png', which is not a file" in caplog.text


def test_the_memory_plan_counts_each_reference_at_up_to_1024_squared(workspace, tmp_path):
    cfg = _config(workspace, tmp_path / "o")
    assert control_tokens(cfg, "flux2") == 2 * 64 * 64  # two a target, each up to 1024² (64² tokens)
    assert control_tokens(cfg, "flux") == 1 * 4 * 4  # FLUX.1 Kontext takes one, at the target's bucket
    assert control_tokens(_config(workspace, tmp_path / "o", control_resolution=[256, 256]), "flux2") == 2 * 16 * 16


def test_more_references_than_flux2_takes_and_ones_its_pipeline_refuses_are_refused_by_name(workspace, tmp_path):
    refs = [Control(workspace / "refs0" / f"r{k}.png", 64, 64) for k in range(11)]
    pairs = Dataset(workspace, [Item(workspace / "data" / "img0.png", "x", 64, 64, controls=tuple(refs))])
    with pytest.raises(DataError, match="img0.png has 11 control images .*FLUX.2 takes 10; keep at most 10 per image"):
        check_pairs(pairs, _view(flip_aug=False, reg_data=None, validation_data=None), "flux2")
    check_pairs(Dataset(workspace, [Item(workspace / "data" / "img0.png", "x", 64, 64, controls=tuple(refs[:10]))]),
                _view(flip_aug=False, reg_data=None, validation_data=None), "flux2")  # ten are taken
    ref = str(workspace / "refs0" / "img0.png")
    many = parse_prompt("x" + f" --ci {ref}" * 11).settled(64, 2, 1.0, 0)
    with pytest.raises(SampleError, match="gives 11 control images, and FLUX.2 takes 10; give at most 10"):
        check_prompts("flux2", [many])
    small = tmp_path / "small.png"
    Image.new("RGB", (48, 64)).save(small)
    with pytest.raises(SampleError, match=f"--ci/--control {small}: it is 48x64, and Flux2Pipeline takes sides of 64"):
        check_prompts("flux2", [parse_prompt(f"x --ci {small} --ci {ref}").settled(64, 2, 1.0, 0)])
    check_prompts("flux2", [parse_prompt(f"x --ci {ref} --ci {ref}").settled(64, 2, 1.0, 0)])
