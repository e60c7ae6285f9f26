"""Edit pairs (train/controls.py; FLUX.1 Kontext on tiny-flux, which is its transformer class): each target's control
images are found in the layouts musubi-tuner and ai-toolkit read, cached with the target's latents, appended after the
target's tokens as FluxKontextPipeline appends them, and drawn from with --control / --ci. Negative controls: swapped
controls change the loss, a target without its control is skipped by name, keys SquareQ does not take are refused by
name."""
import json
import logging

import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from squareq import runtime
from squareq.cli import main
from squareq.models import ADAPTERS
from squareq.models.cache_entry import entry_problem, model_problem
from squareq.models.flux import flux_forward
from squareq.models.recipe import unpack_2x2_output
from squareq.train.buckets import BucketBatches, control_bucket
from squareq.train.config import ConfigError, load_config
from squareq.train.controls import attach_controls, check_pairs, control_tokens
from squareq.train.data import Control, DataError, Dataset, Item, scan_dataset
from squareq.train.loop import train
from squareq.train.objective import denoising_loss
from squareq.train.prompt_options import PromptError, parse_prompt
from squareq.train.sample import SampleError, check_prompts

from .tiny_run import resumes_bit_for_bit, w8_tiny_slab

pytestmark = pytest.mark.usefixtures("torch_kernels")

COLORS = [(220, 30, 30), (30, 30, 220), (30, 200, 30), (230, 230, 20)]
EDITS = ["make it blue", "make it red", "make it yellow", "make it green"]


def _pairs(root, control_size=(80, 48)):
    """Four 64x64 targets captioned with edit instructions, and in ``root/ctrl`` a control of each (another size, other
    extension)."""
    data, ctrl = root / "data", root / "ctrl"
    data.mkdir(parents=True)
    ctrl.mkdir()
    for i, (color, edit) in enumerate(zip(COLORS, EDITS)):
        Image.new("RGB", (64, 64), color).save(data / f"img{i}.png")
        (data / f"img{i}.txt").write_text(edit)
        Image.new("RGB", control_size, color[::-1]).save(ctrl / f"img{i}.jpg")
    return data, ctrl


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    w8_tiny_slab(root / "tiny.slab")
    _pairs(root)
    return root


def _config(ws, out, **kw):
    values = {"slab": str(ws / "tiny.slab"), "data": str(ws / "data"), "output": str(out), "resolution": 64,
              "max_sequence_length": 16, "steps": 6, "lr": 3e-3, "rank": 4, "save_every": 3, "batch_size": 2,
              "cache_dir": str(ws / "cache"), "control_dir": str(ws / "ctrl")}
    values.update(kw)
    return load_config(None, values)


# ---------------------------------------------------------------------------------------------- the conditioning

def test_the_control_tokens_follow_the_targets_as_flux_kontext_pipeline_appends_them():
    """hidden_states = [target | control] packed as the pipeline packs them, ids (0, i, j) then (1, i, j) as its
    prepare_latents makes them; the prediction is the first N tokens (the pipeline's noise_pred[:, :N])."""
    from diffusers import FluxKontextPipeline

    cfg = ADAPTERS["flux"].recipe  # noqa: F841 (the family's recipe is what the trainer calls)
    model_cfg = type("Cfg", (), {"guidance_embeds": True})()
    g = torch.Generator().manual_seed(0)
    x_t, control = torch.randn(2, 4, 8, 6, generator=g), torch.randn(2, 4, 4, 10, generator=g)
    text = {"prompt_embeds": torch.randn(2, 5, 8), "pooled_prompt_embeds": torch.randn(2, 3), "control_0": control}
    kwargs = flux_forward(model_cfg, x_t, torch.tensor([0.3, 0.6]), text, 1.0)
    packed = [FluxKontextPipeline._pack_latents(z, 2, 4, *z.shape[-2:]) for z in (x_t, control)]
    assert torch.equal(kwargs["hidden_states"], torch.cat(packed, dim=1))
    target_ids = FluxKontextPipeline._prepare_latent_image_ids(2, 4, 3, "cpu", torch.float32)
    control_ids = FluxKontextPipeline._prepare_latent_image_ids(2, 2, 5, "cpu", torch.float32)
    control_ids[..., 0] = 1
    assert torch.equal(kwargs["img_ids"], torch.cat([target_ids, control_ids]))
    assert "control_0" not in kwargs and torch.equal(kwargs["guidance"], torch.ones(2))  # musubi's 1.0 for Kontext
    output = torch.randn(2, 12 + 10, 16, generator=g)
    assert torch.equal(unpack_2x2_output((output,), x_t),
                       FluxKontextPipeline._unpack_latents(output[:, :12], 64, 48, 8))


def _loss(model, latents, noise, t, text) -> float:
    with torch.no_grad():
        return float(denoising_loss(model, ADAPTERS["flux"].recipe, "flow", latents, noise, t, text, 1.0))


def test_the_loss_sees_the_controls_and_only_the_targets_tokens(tiny_slab):
    """Negative controls: swapping two samples' controls, or leaving them out, changes the loss; the same controls
    give the same loss. The loss is over the target's elements only (its shape is the target's)."""
    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(stream=False))
    cfg = model.config
    g = torch.Generator().manual_seed(3)
    latents = torch.randn(2, cfg.in_channels // 4, 8, 8, generator=g)
    noise, t = torch.randn(latents.shape, generator=g), torch.tensor([0.4, 0.7])
    controls = torch.randn(2, cfg.in_channels // 4, 8, 8, generator=g) * 2
    text = {"prompt_embeds": torch.randn(2, 16, cfg.joint_attention_dim, generator=g),
            "pooled_prompt_embeds": torch.randn(2, cfg.pooled_projection_dim, generator=g)}
    paired = _loss(model, latents, noise, t, {**text, "control_0": controls})
    assert paired == _loss(model, latents, noise, t, {**text, "control_0": controls.clone()})
    assert paired != _loss(model, latents, noise, t, {**text, "control_0": controls.flip(0)})
    assert paired != _loss(model, latents, noise, t, text)


# ---------------------------------------------------------------------------------------------- finding controls

def _img(path, size=(32, 32), color=(9, 9, 9)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)


def _folder(root, names):
    root.mkdir(parents=True)
    for name in names:
        _img(root / name)
        (root / name).with_suffix(".txt").write_text("an edit")
    return scan_dataset(root, min_side=16)


def _view(**kw):
    values = {"control_dir": None, "control_resolution": None, "no_resize_control": False, "data": ""}
    values.update(kw)
    return type("View", (), values)()


def _found(dataset):
    return {it.path.name: [c.path.name for c in it.controls] for it in dataset.items}


def test_controls_are_found_by_name_in_musubis_and_ai_toolkits_folders(tmp_path, caplog):
    """musubi: any extension, numbered controls after the un-numbered one, a numbered name that is a target's own
    stays its own; ai-toolkit: a list of folders, one control each, in list order; below a subfolder, the same place
    or the folder's top. A target without a control, or with two of one name, is skipped with a warning naming it."""
    data = _folder(tmp_path / "data", ["a.png", "b.png", "b_1.png", "sub/c.png", "lonely.png", "twice.png"])
    ctrl = tmp_path / "ctrl"
    for name in ["a.JPG", "b_10.png", "b_2.webp", "b.png", "b_1.png", "c.png", "twice.png", "twice.jpg"]:
        _img(ctrl / name)
    with caplog.at_level(logging.WARNING, logger="squareq.train"):
        paired = attach_controls(data, _view(control_dir=[str(ctrl)]))
    assert _found(paired) == {"a.png": ["a.JPG"], "b.png": ["b.png", "b_2.webp", "b_10.png"], "b_1.png": ["b_1.png"],
                              "c.png": ["c.png"]}
    said = caplog.text
    assert "lonely.png has no control image in" in said and "twice.jpg and twice.png" in said
    second = tmp_path / "second"
    for name in ["a.png", "b.png", "b_1.png", "sub/c.png"]:
        _img(second / name)
    both = attach_controls(data, _view(control_dir=[str(second), str(ctrl)]))
    assert _found(both)["a.png"] == ["a.png", "a.JPG"]
    assert both.items[0].controls[0].path.parent == second
    with pytest.raises(DataError, match="No edit pairs in"):
        attach_controls(_folder(tmp_path / "alone", ["x.png"]), _view(control_dir=[str(ctrl)]))


def test_metadata_jsonl_names_controls_with_control_path_fields(tmp_path, caplog):
    root = tmp_path / "data"
    for name in ["t0.png", "t1.png", "t2.png", "src/s0.png", "src/s1.png", "src/s2.png"]:
        _img(root / name)
    lines = [{"file_name": "t0.png", "caption": "one", "control_path": "src/s0.png"},
             {"file_name": "t1.png", "caption": "two", "control_path_1": "src/s2.png", "control_path_0": "src/s1.png"},
             {"file_name": "t2.png", "caption": "three"}]
    (root / "metadata.jsonl").write_text("\n".join(map(json.dumps, lines)))
    dataset = Dataset(root, [it for it in scan_dataset(root, min_side=16).items if it.path.parent == root])
    with caplog.at_level(logging.WARNING, logger="squareq.train"):
        paired = attach_controls(dataset, _view())
    assert _found(paired) == {"t0.png": ["s0.png"], "t1.png": ["s1.png", "s2.png"]}
    assert "t2.png has no control image: give its metadata.jsonl line a control_path" in caplog.text
    lines[2]["control_mask"] = "src/s0.png"
    (root / "metadata.jsonl").write_text("\n".join(map(json.dumps, lines)))
    with pytest.raises(DataError, match="line 3 has the key control_mask"):
        attach_controls(dataset, _view())


def test_a_control_is_sized_as_musubi_sizes_it_and_a_batch_holds_one_size_of_each():
    target = (64, 64)
    assert control_bucket(Control("c", 80, 48), target) == target  # the target's bucket
    assert control_bucket(Control("c", 200, 100, area=256 * 256), target) == (320, 192)  # nearest aspect, that area
    assert control_bucket(Control("c", 100, 70, resize=False), target) == (96, 64)  # its size, cropped to 16s
    assert control_bucket(Control("c", 400, 200, area=128 * 128, resize=False), target) == (176, 80)  # scaled down
    items = [Item(f"t{i}", "x", 64, 64, controls=(Control(f"c{i}", 48 + 32 * (i % 2), 64, resize=False),))
             for i in range(8)]
    batches = BucketBatches(Dataset("root", items), [(64, 64)], 2, seed=0)
    for batch in batches.epoch_batches(0):
        assert len({items[i].controls[0].width for i in batch}) == 1
    plain = BucketBatches(Dataset("root", [Item(f"t{i}", "x", 64, 64) for i in range(8)]), [(64, 64)], 2, seed=0)
    assert len(plain) == len(batches) == 4


# ---------------------------------------------------------------------------------------------- a run

def test_a_kontext_run_caches_its_controls_resumes_bit_for_bit_and_samples_an_edit(workspace, tmp_path, caplog):
    config = lambda out, **kw: _config(workspace, out, **kw)  # noqa: E731
    straight = trains_on_the_pairs(config, workspace, tmp_path / "straight", steps=6)
    resumes_bit_for_bit(lambda **kw: config(tmp_path / "killed", **kw), straight.lora_file, killed_at=4)
    samples_an_edit(workspace, tmp_path / "straight", tmp_path / "drawn")


def trains_on_the_pairs(config, ws, out, steps: int):
    """The run of ``config(out)`` on the four pairs of ``ws`` for ``steps`` steps, drawing an edit of a control
    (``--ci``, musubi's prompt-file option) at the last: its sample, its line on the pairs, each target's control
    latents cached beside its own in ``ws/cache``."""
    from squareq.train.cache import EmbeddingCache

    lines = []
    edit = f"make it blue --ci {ws / 'ctrl' / 'img0.jpg'} --s 2"
    straight = train(config(out, sample_every=steps, sample_prompts=[edit]), echo=lines.append)
    assert straight.steps == steps
    assert Image.open(out / "samples" / f"step-{steps:08d}-0.png").size == (64, 64)
    assert any(line.startswith("edit pairs: 4 images with 1 control image") for line in lines), lines
    # the pairs settle attention as any run does (runtime/attention_choice.py): here a CPU's reason
    assert "attention auto: torch order: cuDNN attention runs on CUDA GPUs only, not on cpu" in lines, lines
    cache = EmbeddingCache(ws / "cache")
    entries = [cache.load("latents", p.stem) for p in sorted((ws / "cache" / "latents").iterdir())]
    assert len(entries) == 4 and all(e["control_0"].shape == e["latents"].shape == (4, 8, 8) for e in entries)
    return straight


def samples_an_edit(ws, lora, out, *options) -> None:
    """``squareq sample --control`` draws ``ws/ctrl/img0.jpg`` edited at 64² with ``lora`` (``options``: more)."""
    result = CliRunner().invoke(main, ["sample", str(ws / "tiny.slab"), *options, "--prompt", "make it blue",
                                       "--control", str(ws / "ctrl" / "img0.jpg"), "--lora", str(lora),
                                       "--resolution", "64", "--steps", "2", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert Image.open(out / "sample-000.png").size == (64, 64)


def test_a_changed_control_re_encodes_its_entry_and_swapped_controls_change_the_loss(tmp_path):
    """A changed control file re-encodes its own entry only. Swapping two targets' controls changes the first step's
    loss, while the same pairs give the same loss (the positive control)."""
    from squareq.train.prepare import prepare_data

    ws = tmp_path
    w8_tiny_slab(ws / "tiny.slab")
    _pairs(ws)
    record = runtime.runtime_of(runtime.load(ws / "tiny.slab", "cpu", options=runtime.LoadOptions(
        stream=False))).manifest.model
    first = prepare_data(_config(ws, ws / "x"), record, torch.device("cpu"), echo=lambda s: None)
    assert first.computed == 4 + len(EDITS) + 1  # four latents with their controls, the captions and the empty one
    Image.new("RGB", (80, 48), (1, 2, 3)).save(ws / "ctrl" / "img2.jpg")
    again = prepare_data(_config(ws, ws / "x"), record, torch.device("cpu"), echo=lambda s: None)
    assert again.computed == 1

    swapped_controls_change_the_loss(lambda out, **kw: _config(ws, out, **kw), ws)


def swapped_controls_change_the_loss(config, ws) -> None:
    """The first step's loss of ``config(out)`` (one batch of the four pairs in ``ws``) is the same for the same
    pairs, and another where two targets' controls are swapped (``ws/swapped``)."""
    def first_loss(name, **kw):
        train(config(ws / name, steps=1, save_every=0, batch_size=4, **kw), echo=lambda s: None)
        return json.loads((ws / name / "metrics.jsonl").read_text().splitlines()[0])["loss"]

    swapped = ws / "swapped"
    swapped.mkdir()
    for i in range(4):
        (swapped / f"img{i}.jpg").write_bytes((ws / "ctrl" / f"img{3 - i}.jpg").read_bytes())
    paired = first_loss("paired")
    assert first_loss("paired-again") == paired
    assert first_loss("swapped", control_dir=str(swapped)) != paired


# ---------------------------------------------------------------------------------------------- refusals

def test_keys_that_cannot_work_are_refused_by_name(tmp_path, workspace):
    toml = tmp_path / "c.toml"
    toml.write_text(f'[[datasets]]\nimage_directory = "{workspace / "data"}"\ncontrol_from_same_folder = true\n')
    with pytest.raises(ConfigError, match="control_from_same_folder: SquareQ takes a target's controls"):
        load_config(toml)
    toml.write_text(f'data = "{workspace / "data"}"\ncontrol_path_1 = "{workspace / "ctrl"}"\n')
    with pytest.raises(ConfigError, match="control_path_1: SquareQ takes several control folders as one list"):
        load_config(toml)
    with pytest.raises(ConfigError, match="flip_aug = true with control_dir"):
        _config(workspace, tmp_path / "o", flip_aug=True)
    with pytest.raises(ConfigError, match="control_dir = .* which is not a folder"):
        _config(workspace, tmp_path / "o", control_dir=str(tmp_path / "nowhere"))
    pairs = Dataset(workspace, [Item(workspace / "a.png", "x", 64, 64, controls=(Control(workspace / "c.png", 8, 8),
                                                                                 Control(workspace / "d.png", 8, 8)))])
    with pytest.raises(DataError, match="a.png has 2 control images .* FLUX.1 Kontext takes 1"):
        check_pairs(pairs, _view(flip_aug=False, reg_data=None, validation_data=None), "flux")
    with pytest.raises(DataError, match="this slab holds a sd3 model, which trains on none; edit pairs train FLUX.1 "
                                        "Kontext"):
        check_pairs(pairs, _view(), "sd3")


def test_the_control_keys_are_read_where_the_other_data_keys_are(tmp_path, workspace):
    """At the top of a one-dataset config (musubi's and ai-toolkit's names too), in each [[datasets]] table, and as
    flags; the memory plan counts one control per folder at the target's side, or control_resolution's."""
    toml = tmp_path / "c.toml"
    toml.write_text(f'data = "{workspace / "data"}"\ncontrol_directory = "{workspace / "ctrl"}"\n'
                    "flux_kontext_no_resize_control = true\n")
    cfg = load_config(toml)
    assert cfg.control_dir == [str(workspace / "ctrl")] and cfg.no_resize_control
    toml.write_text(f'[[datasets]]\nimage_directory = "{workspace / "data"}"\ncontrol_path = ["{workspace / "ctrl"}", '
                    f'"{workspace / "ctrl"}"]\ncontrol_resolution = [128, 128]\n')
    view = load_config(toml).dataset_views()[0]
    assert view.control_dir == [str(workspace / "ctrl")] * 2 and view.control_resolution == [128, 128]
    assert control_tokens(load_config(toml)) == 2 * 8 * 8
    assert control_tokens(_config(workspace, tmp_path / "o")) == 4 * 4
    result = CliRunner().invoke(main, ["train", str(workspace / "tiny.slab"), "--data", str(workspace / "data"), "-o",
                                       str(tmp_path / "o"), "--control-dir", str(workspace / "ctrl"),
                                       "--control-resolution", "512,384", "--print-config"])
    assert result.exit_code == 0, result.output
    assert f'control_dir = ["{workspace / "ctrl"}"]' in result.output
    assert "control_resolution = [512, 384]" in result.output
    plan = runtime.plan(workspace / "tiny.slab", resolution=64, text_tokens=16)
    assert runtime.plan(workspace / "tiny.slab", resolution=64, text_tokens=16, control_tokens=16).tokens == \
        plan.tokens + 16


def test_a_cache_entrys_controls_must_fit_its_latents():
    latents = torch.zeros(4, 8, 8)
    assert entry_problem("latents", {"latents": latents, "control_0": torch.zeros(4, 4, 6)}) is None
    assert "numbered [1]" in entry_problem("latents", {"latents": latents, "control_1": latents})
    assert "where a control has the latents' axes and channels" in \
        entry_problem("latents", {"latents": latents, "control_0": torch.zeros(3, 8, 8)})
    config = type("Cfg", (), {"in_channels": 16})()
    assert "3x8 in size" in model_problem("latents", {"latents": latents, "control_0": torch.zeros(4, 3, 8)},
                                          ADAPTERS["flux"].recipe, config)


def test_a_prompts_control_image_is_its_ci_option(tmp_path):
    _img(tmp_path / "c.png")
    prompt = parse_prompt(f"make it red --ci {tmp_path / 'c.png'} --s 4")
    assert prompt.controls == (str(tmp_path / "c.png"),) and prompt.steps == 4
    assert prompt.settled(64, 2, 1.0, 0, controls=("other.png",)).controls == (str(tmp_path / "c.png"),)
    assert parse_prompt("make it red").settled(64, 2, 1.0, 0, controls=("x.png",)).controls == ("x.png",)
    with pytest.raises(PromptError, match="--ci .* must name an existing image file"):
        parse_prompt(f"make it red --ci {tmp_path / 'missing.png'}")
    two = parse_prompt(f"x --ci {tmp_path / 'c.png'} --ci {tmp_path / 'c.png'}").settled(64, 2, 1.0, 0)
    with pytest.raises(SampleError, match="gives 2 control images, and FLUX.1 Kontext takes 1"):
        check_prompts("flux", [two])
    with pytest.raises(SampleError, match="sd3 model, which draws no edits"):
        check_prompts("sd3", [prompt.settled(64, 2, 1.0, 0)])


def test_a_flux_kontext_pipeline_folder_gives_the_encoders_and_the_decoder(tmp_path):
    """black-forest-labs/FLUX.1-Kontext-dev's folder holds a FluxKontextPipeline: its VAE and text encoders are
    FLUX.1's, read as a FluxPipeline's (tiny components in its layout)."""
    from diffusers import FluxKontextPipeline

    from squareq.models import build_tiny_flux_pipeline
    from squareq.sources.encoders import open_decoder, open_encoders

    FluxKontextPipeline(**build_tiny_flux_pipeline().components).save_pretrained(tmp_path / "kontext")
    assert json.loads((tmp_path / "kontext" / "model_index.json").read_text())["_class_name"] == "FluxKontextPipeline"
    with open_encoders(str(tmp_path / "kontext"), torch.device("cpu"), "flux") as encoders:
        assert encoders.encode_prompts(["make it red"], 16)[0]["prompt_embeds"].shape == (16, 48)
    assert open_decoder(str(tmp_path / "kontext"), "flux", torch.float32).vae is not None


@pytest.mark.parametrize("family, source, said", [
    ("flux", "/models/FLUX.1-dev", True),  # a base model's name: trained as Kontext, which it was not trained for
    ("flux", "black-forest-labs/FLUX.1-Kontext-dev", False),
    ("qwen-image", "Qwen/Qwen-Image", True),
    ("qwen-image", "Qwen/Qwen-Image-Edit-2509", False),
    ("flux2", "/models/flux2", False),  # FLUX.2's base model takes its references itself: nothing to say
])
def test_a_slab_not_named_for_its_edit_model_is_said_once(family, source, said):
    """Edit pairs on a slab compiled from a model whose name lacks its edit model's word (``edit_word``) get a line;
    a model named for it, or a family whose base model takes controls itself, gets none."""
    from types import SimpleNamespace

    from squareq.train.run_plan import _check_pairs

    cfg = SimpleNamespace(slab="model.slab", dataset_views=lambda: [_view(control_dir=["controls"])])
    lines = []
    _check_pairs(cfg, SimpleNamespace(family=family, source=source), lines.append)
    assert bool(lines) == said and all("does not say" in line for line in lines)
