"""kohya's per-prompt sampling options (train/prompt_options.py): parsed, refused in one sentence, and honoured by
squareq sample, by a prompt file and by training samples."""
import numpy as np
import pytest
from click.testing import CliRunner

from squareq.cli import main
from squareq.train.config import ConfigError, load_config
from squareq.train.prompt_options import PromptError, SamplePrompt, parse_prompt, read_prompt_file
from squareq.train.sample import SampleError, sample_images

pytestmark = pytest.mark.usefixtures("torch_kernels")


def test_a_prompts_options_are_read_as_kohya_writes_them():
    p = parse_prompt("a red fox, in the snow --w 768 --h 1024 --s 28 --g 4.5 --d 7 --n blurry, dark --l 3")
    assert p == SamplePrompt("a red fox, in the snow", 768, 1024, 28, 4.5, 7, "blurry, dark", 3.0)
    assert p.texts == ["a red fox, in the snow", "blurry, dark"] and p.uses_negative
    plain = parse_prompt("  a cat  ").settled(512, 20, 3.5, 42)
    assert (plain.text, plain.width, plain.height, plain.steps, plain.guidance, plain.seed, plain.cfg_scale) == \
        ("a cat", 512, 512, 20, 3.5, 42, 1.0)
    assert parse_prompt("a cat --g 0 --d 0").settled(512, 20, 3.5, 42).guidance == 0.0  # zeros are values


@pytest.mark.parametrize("line, message", [
    ("a cat --x 3", "has an option --x, which is not one of --w, --h, --s, --g, --d, --n, --l"),
    ("a cat --w 100", "--w '100' must be a multiple of 16 from 16 to 8192"),
    ("a cat --s zero", "--s 'zero' is not a number"),
    ("a cat --g 1000", "--g '1000' must be a number from 0 to 100"),
    ("a cat --n blurry", "has a negative prompt (--n) but no --l above 1"),
    (" --w 512", "has options but no prompt before them"),
    ("a cat --d 99999999999999999999999", "--d '99999999999999999999999' must be a whole number from 0 to"),
    ("a cat --w 64 --w 128", "sets --w twice"),
    ("a cat --s 5000", "--s '5000' must be a whole number from 1 to 1000"),
])
def test_options_that_cannot_work_are_one_sentence(line, message):
    with pytest.raises(PromptError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_prompt(line)


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Forget which skipped options this process has said already (another test may have said them)."""
    from squareq.train import prompt_options

    monkeypatch.setattr(prompt_options, "_WARNED", set())


def test_kohya_options_squareq_does_not_offer_are_skipped_with_a_warning_once(caplog, fresh_warnings):
    """A skipped option is said once per prompt: the config's check, the cache and each sample round parse the same
    prompt. Negative control: another prompt with it is said too."""
    with caplog.at_level("WARNING", logger="squareq.sample"):
        assert parse_prompt("a cat --ss euler_a --w 64") == SamplePrompt("a cat", width=64)
        parse_prompt("a cat --ss euler_a --w 64")
    assert "sets a sampler" in caplog.text and caplog.text.count("(--ss)") == 1
    with caplog.at_level("WARNING", logger="squareq.sample"):
        parse_prompt("a dog --ss euler_a")
    assert caplog.text.count("(--ss)") == 2


def test_a_training_run_says_a_skipped_kohya_option_once(caplog, fresh_warnings):
    """The config's check parses the sample prompts, the trainer settles them where it caches their texts and at
    each sample round, with other settings too: the warning for a skipped option comes once in all. Negative
    control: a prompt not seen before is said."""
    from types import SimpleNamespace

    from squareq.train.run_samples import _settled_prompts, sample_prompts as _sample_prompts

    _settled_prompts.cache_clear()  # another test may have settled the same prompt
    cfg = SimpleNamespace(sample_prompts=["a dog --ss euler_a"], largest_resolution=512, sample_steps=20,
                          sample_guidance=3.5, sample_seed=11)
    with caplog.at_level("WARNING", logger="squareq.sample"):
        parse_prompt(cfg.sample_prompts[0], true_cfg_only=False)  # as TrainConfig.validate does
        rounds = [_sample_prompts(cfg, "flux") for _ in range(3)]
        cfg.sample_seed = 12
        _sample_prompts(cfg, "flux")
    assert rounds[0] == rounds[2] and rounds[0][0].text == "a dog" and caplog.text.count("(--ss)") == 1
    cfg.sample_prompts = ["a fox --ss euler_a"]
    with caplog.at_level("WARNING", logger="squareq.sample"):
        _sample_prompts(cfg, "flux")
    assert caplog.text.count("(--ss)") == 2


def test_a_prompt_file_skips_empty_and_comment_lines(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("# samples\na cat --w 64\n\n  a dog  \n")
    assert read_prompt_file(path) == ["a cat --w 64", "a dog"]
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(PromptError, match="holds no prompt"):
        read_prompt_file(tmp_path / "empty.txt")


def _draw(slab, prompts, **kw):
    return [np.asarray(im) for im in sample_images(slab, prompts, resolution=64, steps=2, max_sequence_length=32,
                                                   **kw)]


def test_squareq_sample_honours_each_prompts_options(tiny_slab):
    base, sized, seeded, stepped, guided, negative = _draw(tiny_slab, [
        "a cat", "a cat --w 128 --h 64", "a cat --d 7", "a cat --s 3", "a cat --g 7", "a cat --n a dog --l 3"])
    assert base.shape == (64, 64, 3) and sized.shape == (64, 128, 3)  # height 64, width 128
    for other in (seeded, stepped, guided, negative):
        assert not np.array_equal(other, base)
    # an option equal to the command's setting changes nothing
    same, = _draw(tiny_slab, ["a cat --d 42 --s 2 --g 3.5 --w 64"])
    assert np.array_equal(same, base)
    seven, = _draw(tiny_slab, ["a cat"], seed=7)
    assert np.array_equal(seven, seeded)
    with pytest.raises(SampleError, match="--prompt: the prompt 'a cat' has an option --q"):
        _draw(tiny_slab, ["a cat --q 1"])


def test_squareq_sample_reads_a_prompt_file(tiny_slab, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# two sizes\na cat --w 128 --h 64\na dog --h 128\n")
    out = tmp_path / "samples"
    result = CliRunner().invoke(main, ["sample", str(tiny_slab), "--prompt-file", str(prompts), "-o", str(out),
                                       "--resolution", "64", "--steps", "2", "--max-sequence-length", "32"])
    assert result.exit_code == 0, result.output
    from PIL import Image

    assert [Image.open(out / f"sample-00{i}.png").size for i in range(2)] == [(128, 64), (64, 128)]
    nothing = CliRunner().invoke(main, ["sample", str(tiny_slab), "-o", str(out)])
    assert nothing.exit_code != 0 and "needs something to draw" in nothing.output


def test_training_samples_take_a_kohya_prompt_file_and_its_options(tiny_slab, tmp_path):
    from PIL import Image

    from squareq.train.loop import train
    from squareq.train.tiny_dataset import write_tiny_dataset

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat --w 128 --h 64 --s 2\n")
    toml = tmp_path / "kohya.toml"
    toml.write_text(f'sample_prompts = "{prompts}"\nsample_every_n_steps = 1\nmax_train_steps = 1\n')
    cfg = load_config(toml, {"slab": str(tiny_slab), "data": str(write_tiny_dataset(tmp_path / "data")),
                             "output": str(tmp_path / "out"), "resolution": 64, "max_sequence_length": 16,
                             "save_every": 0, "sample_steps": 1})
    assert cfg.sample_prompts == ["a cat --w 128 --h 64 --s 2"]
    train(cfg, echo=lambda s: None)
    images = sorted((tmp_path / "out" / "samples").glob("step-*-0.png"))
    assert images and Image.open(images[-1]).size == (128, 64)
    with pytest.raises(ConfigError, match="sample_prompts = .* cannot be drawn: the prompt 'a cat' has an option --z"):
        load_config(None, {"slab": str(tiny_slab), "data": str(tmp_path), "output": str(tmp_path / "o"),
                           "sample_prompts": ["a cat --z 1"]})


def test_the_trainer_s_sample_steps_have_the_bound_a_prompt_s_steps_have(tiny_slab, tmp_path):
    """sample_steps stops at 1000, as a prompt's --s and squareq sample --steps do; 1000 itself is taken (the
    negative control)."""
    base = {"slab": str(tiny_slab), "data": str(tmp_path), "output": str(tmp_path / "o")}
    with pytest.raises(ConfigError, match="sample_steps = 1001 must be at most 1000"):
        load_config(None, {**base, "sample_steps": 1001})
    assert load_config(None, {**base, "sample_steps": 1000}).sample_steps == 1000


def test_a_negative_prompt_needs_true_cfg_only_where_the_model_is_guidance_distilled():
    """--n without --l: refused for FLUX.1 (guidance-distilled: only true CFG uses a negative prompt) and for a
    pipeline with true_cfg_scale (Qwen-Image); taken where the pipeline's guidance is classifier-free (SD 1.5, SD3,
    Wan), the pipeline then given the negative prompt."""
    from squareq.train.sample import negative_needs_true_cfg

    assert [negative_needs_true_cfg(f) for f in ("flux", "qwen-image", "sd-unet", "sd3", "wan")] == \
        [True, True, False, False, False]
    assert parse_prompt("a cat --n blurry", true_cfg_only=False).negative == "blurry"
    with pytest.raises(PromptError, match="has a negative prompt"):
        parse_prompt("a cat --n blurry")
