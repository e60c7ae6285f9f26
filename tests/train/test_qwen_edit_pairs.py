"""Edit pairs on Qwen-Image-Edit (tiny-qwen-image with a QwenImageEditPipeline folder at toy size, and Edit-Plus's):
the control tokens follow the target's as the pipelines append them, with their grids in ``img_shapes``; each caption
is read by Qwen2.5-VL with its control images, as the pipeline's own ``__call__`` reads them, under a text cache key
of theirs; a run caches, resumes bit for bit and samples with --control. Negative controls: swapped controls change
the loss, a grid left out of ``img_shapes`` fails a ``zero_cond_t`` model, a changed control re-encodes its caption,
a target without its control is skipped by name, folders that cannot read the pairs are refused by name."""
import json
import logging

import pytest
import torch
from PIL import Image

from squareq.models.qwen_image import qwen_image_forward
from squareq.models.recipe import unpack_2x2_output
from squareq.train.config import load_config
from squareq.train.data import DataError
from squareq.train.loop import train
from squareq.train.prompt_options import parse_prompt
from squareq.train.sample import SampleError, check_edit_prompts

from ..models.tiny_folders import write_pipeline, write_qwen_image_edit_folder
from .test_edit_pairs import (
    _pairs,
    samples_an_edit,
    swapped_controls_change_the_loss,
    trains_on_the_pairs,
)
from .tiny_run import resumes_bit_for_bit, w8_tiny_slab

pytestmark = pytest.mark.usefixtures("torch_kernels")


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """The slab, an Edit and an Edit-Plus folder, and four pairs (64² targets, 80x48 controls)."""
    root = tmp_path_factory.mktemp("qwen-edit")
    w8_tiny_slab(root / "tiny.slab", "tiny-qwen-image")
    write_qwen_image_edit_folder(root / "edit")
    write_qwen_image_edit_folder(root / "plus", plus=True)
    _pairs(root)
    return root


def _config(ws, out, **kw):
    values = {"slab": str(ws / "tiny.slab"), "data": str(ws / "data"), "output": str(out), "resolution": 64,
              "max_sequence_length": 16, "steps": 4, "lr": 3e-3, "rank": 4, "save_every": 2, "batch_size": 2,
              "cache_dir": str(ws / "cache"), "control_dir": str(ws / "ctrl"), "model": str(ws / "edit")}
    values.update(kw)
    return load_config(None, values)


# ---------------------------------------------------------------------------------------------- the conditioning

def test_the_control_tokens_follow_the_targets_with_their_grids_in_img_shapes():
    """hidden_states = [target | control_0 | control_1] packed as QwenImageEditPlusPipeline packs them, img_shapes the
    target's grid then each control's, as its __call__ lists them; the prediction is the first N tokens."""
    from diffusers import QwenImageEditPlusPipeline

    g = torch.Generator().manual_seed(0)
    x_t = torch.randn(2, 4, 8, 6, generator=g)
    controls = [torch.randn(2, 4, 4, 10, generator=g), torch.randn(2, 4, 6, 6, generator=g)]
    text = {"prompt_embeds": torch.randn(2, 5, 8), "prompt_mask": torch.ones(2, 5),
            "control_0": controls[0], "control_1": controls[1]}
    kwargs = qwen_image_forward(None, x_t, torch.tensor([0.3, 0.6]), text, 1.0)
    packed = [QwenImageEditPlusPipeline._pack_latents(z[:, :, None], 2, 4, *z.shape[-2:]) for z in [x_t, *controls]]
    assert torch.equal(kwargs["hidden_states"], torch.cat(packed, dim=1))
    assert kwargs["img_shapes"] == [[(1, 4, 3), (1, 2, 5), (1, 3, 3)]] * 2
    assert "control_0" not in kwargs and "control_1" not in kwargs
    output = torch.randn(2, 12 + 10 + 9, 16, generator=g)
    assert torch.equal(unpack_2x2_output((output,), x_t),
                       QwenImageEditPlusPipeline._unpack_latents(output[:, :12], 64, 48, 8)[:, :, 0])


def test_a_zero_cond_t_transformer_modulates_the_controls_by_their_grids():
    """Edit-2511's ``zero_cond_t``: diffusers modulates the tokens past the first grid of ``img_shapes`` with t = 0,
    so the forward runs with the controls' grids listed, and fails without them (the negative control)."""
    from diffusers import QwenImageTransformer2DModel

    from squareq.models.qwen_image import TINY_QWEN_IMAGE_CONFIG

    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(**TINY_QWEN_IMAGE_CONFIG, zero_cond_t=True).eval()
    x_t, control = torch.randn(1, 4, 4, 4), torch.randn(1, 4, 4, 6)
    text = {"prompt_embeds": torch.randn(1, 3, 32), "prompt_mask": torch.ones(1, 3), "control_0": control}
    kwargs = qwen_image_forward(model.config, x_t, torch.tensor([0.5]), text, 1.0)
    with torch.no_grad():
        out = model(**kwargs, return_dict=False)[0]
        assert out.shape == (1, 4 + 6, 16)
        other = model(**{**kwargs, "hidden_states": torch.cat([kwargs["hidden_states"][:, :4],
                                                               kwargs["hidden_states"][:, 4:] * 2], 1)},
                      return_dict=False)[0]
        assert not torch.equal(out[:, :4], other[:, :4])  # the target attends to the control
        with pytest.raises(RuntimeError):
            model(**{**kwargs, "img_shapes": [[(1, 2, 2)]]}, return_dict=False)


@pytest.mark.parametrize("plus", [False, True])
def test_a_caption_is_read_with_its_controls_as_the_pipelines_call_reads_it(ws, plus):
    """The cache's text entry of a caption with its control images equals what QwenImageEditPipeline's (Plus's)
    __call__ gives its transformer for them: the image sized to 1024² (each to 384²), in the Edit (Plus) template."""
    from squareq.sources.pipeline_encoders import open_family_pipeline

    images = [Image.new("RGB", (80, 48), (200, 30, 30)), Image.new("RGB", (40, 60), (30, 30, 200))][: 1 + plus]
    with open_family_pipeline(str(ws / ("plus" if plus else "edit")), "qwen-image", torch.device("cpu"),
                              torch.float32) as encoders:
        entry = encoders.encode_prompts(["make it blue"], 16, images=[images])[0]
        pipe, seen = encoders.pipeline, {}
        real = pipe.encode_prompt

        def spy(*args, **kwargs):
            seen.setdefault("embeds", real(*args, **kwargs)[0])
            raise InterruptedError  # the transformer is the slab: stop once the prompt is read

        pipe.encode_prompt = spy
        with pytest.raises(InterruptedError):
            pipe(image=images if plus else images[0], prompt="make it blue", num_inference_steps=1)
        plain = encoders.encode_prompts(["make it blue"], 16)[0]
    assert torch.equal(entry["prompt_embeds"], seen["embeds"][0].float())
    assert entry["prompt_embeds"].shape[0] > plain["prompt_embeds"].shape[0]  # the vision tokens stay


# ---------------------------------------------------------------------------------------------- a run

def test_a_qwen_edit_run_caches_its_controls_resumes_bit_for_bit_and_samples_an_edit(ws, tmp_path):
    """As FLUX.1 Kontext's run (tests/train/test_edit_pairs.py), from the Edit folder; the samples during training and
    squareq sample's through QwenImageEditPipeline."""
    config = lambda out, **kw: _config(ws, out, **kw)  # noqa: E731
    straight = trains_on_the_pairs(config, ws, tmp_path / "straight", steps=4)
    resumes_bit_for_bit(lambda **kw: config(tmp_path / "killed", **kw), straight.lora_file, killed_at=3)
    samples_an_edit(ws, tmp_path / "straight", tmp_path / "drawn", "--model", str(ws / "edit"))


def test_a_changed_control_re_encodes_its_caption_and_swapped_controls_change_the_loss(tmp_path, ws):
    """The text key holds the control images: changing one control re-encodes its latents and its caption's entry and
    no other. A target's dropped caption is read with its controls only where caption_dropout can draw it (else one
    shared entry). Swapping two targets' controls changes the first step's loss, while the same pairs give the same
    loss (the positive control)."""
    from squareq.slab import open_slab
    from squareq.train.feed import text_key
    from squareq.train.prepare import prepare_data

    root = tmp_path
    _pairs(root)

    def config(out, **kw):  # the pairs in root, whose controls change
        return _config(ws, out, **{"data": str(root / "data"), "control_dir": str(root / "ctrl"),
                                   "cache_dir": str(root / "cache"), **kw})

    record = open_slab(ws / "tiny.slab").manifest.model
    first = prepare_data(config(root / "x"), record, torch.device("cpu"), echo=lambda s: None)
    assert first.computed == 4 + 4 + 1  # four latents with their controls, each caption with them, the dropped one
    dropping = prepare_data(config(root / "d", caption_dropout=0.1, cache_dir=str(root / "cache-d")), record,
                            torch.device("cpu"), echo=lambda s: None)
    assert dropping.computed == 4 + 4 * 2 + 1  # and each target's dropped caption read with its controls
    Image.new("RGB", (80, 48), (1, 2, 3)).save(root / "ctrl" / "img2.jpg")
    again = prepare_data(config(root / "x"), record, torch.device("cpu"), echo=lambda s: None)
    assert again.computed == 1 + 1
    keys = [[text_key(data.keys[1], i, c) for i, c in enumerate(["make it blue", "make it red", "make it yellow",
                                                                  "make it green"])] for data in (first, again)]
    assert keys[0][0] == keys[1][0] and keys[0][2] != keys[1][2]
    # unchanged, the cache's noted identities (the control text's with them) name every entry: no encoder loads
    lines = []
    third = prepare_data(config(root / "x"), record, torch.device("cpu"), echo=lines.append)
    assert third.computed == 0 and third.keys == again.keys and any("were not loaded" in line for line in lines)

    swapped_controls_change_the_loss(config, root)


def test_edit_plus_trains_on_two_controls_each_and_validates_on_held_out_pairs(ws, tmp_path):
    """Two control folders (ai-toolkit's list): each target's two controls, appended in order, read together as
    "Picture 1" and "Picture 2" by QwenImageEditPlusPipeline's template; a pair held out by validation_split is
    validated on with its caption read with its controls."""
    lines = []
    result = train(_config(ws, tmp_path / "o", model=str(ws / "plus"), control_dir=[str(ws / "ctrl")] * 2, steps=1,
                           save_every=0, cache_dir=str(tmp_path / "cache"), validation_split=0.25), echo=lines.append)
    assert result.steps == 1
    assert any(line.startswith("edit pairs: 3 images with 2 control images") for line in lines), lines
    assert json.loads((tmp_path / "o" / "validation.jsonl").read_text().splitlines()[-1])["step"] == 1


# ---------------------------------------------------------------------------------------------- refusals

def test_a_target_without_its_control_is_skipped_by_name(ws, tmp_path, caplog):
    root = tmp_path
    data, ctrl = _pairs(root)
    (ctrl / "img1.jpg").unlink()
    with caplog.at_level(logging.WARNING, logger="squareq.train"):
        result = train(_config(ws, root / "o", data=str(data), control_dir=str(ctrl), steps=1, save_every=0,
                               cache_dir=str(root / "cache")), echo=lambda s: None)
    assert result.steps == 1
    assert "img1.png has no control image in" in caplog.text and "1 of 4 images" in caplog.text


def test_folders_that_cannot_read_the_pairs_are_refused_by_name(ws, tmp_path):
    """Pairs from Qwen-Image's text-to-image folder, images without controls from an Edit folder, two controls from
    an Edit folder; --ci drawn from the text-to-image folder."""
    t2i = write_pipeline("tiny-qwen-image", tmp_path / "t2i")
    with pytest.raises(DataError, match="holds a QwenImagePipeline, whose text encoder reads no control image"):
        train(_config(ws, tmp_path / "a", model=str(t2i)), echo=lambda s: None)
    with pytest.raises(DataError, match="holds a QwenImageEditPipeline, which edits control images"):
        train(_config(ws, tmp_path / "b", control_dir=None), echo=lambda s: None)
    with pytest.raises(DataError, match="has 2 control images, and .* QwenImageEditPipeline takes 1; keep 1 per "
                                        "image, or train from a QwenImageEditPlusPipeline folder"):
        train(_config(ws, tmp_path / "c", control_dir=[str(ws / "ctrl")] * 2), echo=lambda s: None)
    prompt = parse_prompt(f"make it blue --ci {ws / 'ctrl' / 'img0.jpg'}").settled(64, 2, 1.0, 0)
    with pytest.raises(SampleError, match="holds a QwenImagePipeline, which draws no edits of a control image"):
        check_edit_prompts("qwen-image", str(t2i), [prompt])
    check_edit_prompts("qwen-image", str(ws / "edit"), [prompt])  # the positive control
