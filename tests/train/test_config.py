"""Training configuration: defaults < TOML < flags; every bad value is one sentence naming its key."""
import dataclasses

import pytest

from squareq.train.config import ConfigError, TrainConfig, load_config


def test_defaults_toml_and_flags_apply_in_that_order(tmp_path):
    path = tmp_path / "train.toml"
    path.write_text('[train]\nrank = 8\nlr = 2e-4\ntargets = ["to_q", "to_v"]\nschedule = "cosine"\n')
    cfg = load_config(path, {"rank": 4, "lr": None, "trigger": "sks"})
    assert cfg.rank == 4  # the flag wins
    assert cfg.lr == 2e-4  # the file wins over the default; an unset flag changes nothing
    assert cfg.targets == ["to_q", "to_v"] and cfg.schedule == "cosine" and cfg.trigger == "sks"
    assert cfg.batch_size == TrainConfig().batch_size
    assert cfg.lora_alpha == 4.0


def test_print_config_reads_back_unchanged(tmp_path):
    cfg = load_config(None, {"rank": 32, "alpha": 16, "targets": "to_q,to_k", "vram_budget": "12GB",
                             "sample_prompts": ["a cat", 'a "quoted" dog']})
    path = tmp_path / "printed.toml"
    path.write_text(cfg.to_toml())
    assert load_config(path) == cfg
    assert cfg.vram_budget_bytes == 12 * 10**9


@pytest.mark.parametrize("content, key", [
    ("rank = 0", "rank"),
    ('optimizer = "sgd"', "optimizer"),
    ("resolution = 1000", "resolution"),
    ("caption_dropout = 1.5", "caption_dropout"),
    ('vram_budget = "lots"', "vram_budget"),
    ('rank = "sixteen"', "rank"),
    ("lr = -1.0", "lr"),
    ("lr = inf", "lr"),
    ("lr = nan", "lr"),
    ('lr = "fast"', "lr"),
    ("shift = -5.0", "shift"),
    ("shift = 0", "shift"),
    ("shift = nan", "shift"),
    ("alpha = 0", "alpha"),
    ("alpha = inf", "alpha"),
    ("weight_decay = -1.0", "weight_decay"),
    ("guidance = nan", "guidance"),
    ("guidance = 1e300", "guidance"),
    ("sample_guidance = 100.5", "sample_guidance"),
    ("caption_dropout = nan", "caption_dropout"),
    ('save_format = ["onnx"]', "save_format"),
    ("save_format = []", "save_format"),
    ('title = "  "', "title"),
    ('caption_ext = "a/b"', "caption_ext"),
    ('no_upscale = "maybe"', "no_upscale"),
    ("resolution = [512, 512]", "resolution"),
    ("resolution = [512, 100]", "resolution"),
    ('resolution = "big"', "resolution"),
    ("ema_decay = 1.0", "ema_decay"),
    ('loss_weighting = "snr"', "loss_weighting"),
    ('timestep_sampling = "sigma"', "timestep_sampling"),
    ('attention = "flash"', "attention"),
])
def test_bad_values_name_the_file_and_key(tmp_path, content, key):
    path = tmp_path / "bad.toml"
    path.write_text(content + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(path) in str(err.value) and key in str(err.value)


def test_unknown_keys_and_flags_are_refused(tmp_path):
    path = tmp_path / "typo.toml"
    path.write_text("rnak = 8\n")
    with pytest.raises(ConfigError, match=r"unknown key rnak \(did you mean rank\?\);"):
        load_config(path)
    with pytest.raises(ConfigError, match="--learning-rate is not a training option"):
        load_config(None, {"learning_rate": 1e-3})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    (tmp_path / "broken.toml").write_text("rank = [\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(tmp_path / "broken.toml")


@pytest.mark.parametrize("content, sentence", [
    ("train = 5", "train = 5 is not a table; put the training keys under a [train] header, or at the top level"),
    ("[train]\nrank = 8\n[other]\nx = 1", "[other] outside the [train] table would be ignored; move it into [train]"),
    ("rank = 8\n[train]\nalpha = 4", "rank outside the [train] table would be ignored"),
    ("rank = 8\n[other]\nx = 1", "unknown key [other];"),
    ("[train]\nrank = 8\nlernrate = 1e-4\nrnak = 4", "unknown keys lernrate, rnak (did you mean rank?);"),
    ("seed = 99999999999999999999999", "seed = 99999999999999999999999 must be a whole number from 0 to 4294967295"),
    ("sample_seed = -1", "sample_seed = -1 must be a whole number from 0 to 4294967295"),
    ("targets = {a = 1}", "targets = {'a': 1} must be a list of text, e.g. [\"to_q\", \"to_k\"]"),
    ("targets = [1, 2]", "targets = [1, 2] must be a list of text"),
    ("sample_prompts = [[\"a\"]]", "sample_prompts = [['a']] must be a list of text"),
    ("prefetch = {n = 3}", "prefetch = {'n': 3} must be auto or a whole number"),
    ("trigger = {a = 1}", "trigger = {'a': 1} must be text in quotes"),
    ("alpha = 1e308", "alpha = 1e+308 must be at most 1024 × rank (16384 here)"),
    ("rank = 4\nalpha = 4097", "alpha = 4097.0 must be at most 1024 × rank (4096 here)"),
    ("alpha = 1" + "0" * 400, "alpha = inf must be a finite number above 0"),
    ("shift = 1000", "shift = 1000.0 must be at most 100"),
    ("weight_decay = 1e300", "weight_decay = 1e+300 must be at most 1"),
    ("targets = " + "[" * 100_000 + "]" * 100_000, "is not valid TOML (its arrays or tables nest too deeply to read)"),
    ('title = "' + "t" * 300 + '"', "is 300 bytes long in UTF-8; it names the file OUT/<title>_kohya.safetensors, so "
                                    "keep it to 200 bytes"),
    ('title = "' + "é" * 101 + '"', "is 202 bytes long in UTF-8"),
    ('trigger = "sks\\u0000"', "trigger = 'sks\\x00' holds the control character U+0000; write it as plain text"),
    ('sample_prompts = ["a dog", "\\u001b[31m"]', "holds the control character U+001B"),
])
def test_a_config_a_value_cannot_work_in_is_one_sentence_saying_what_to_give(tmp_path, content, sentence):
    """Issue 40, items 5 and 9: each was a traceback (a scalar train, a 23-digit seed, a 400-digit alpha, deep
    nesting), or ran on with something silently made up ({a = 1} read as ["a"], an [other] table ignored, a
    300-character title failing at the final write, a NUL in the trigger cached)."""
    path = tmp_path / "bad.toml"
    path.write_text(content + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert message.startswith(str(path)) and sentence in message and "\n" not in message, message


def test_values_at_each_limit_are_taken(tmp_path):
    """The control for the limits above: each boundary value (and tab and line feed in a trigger) is accepted."""
    path = tmp_path / "edge.toml"
    path.write_text('[train]\nseed = 4294967295\nsample_seed = 0\nrank = 4\nalpha = 4096\nshift = 100\n'
                    'weight_decay = 1\ntitle = "' + "t" * 200 + '"\ntrigger = "sks\\tdog\\n"\n'
                    'targets = ["to_q"]\nsample_prompts = ["a dog"]\n')
    cfg = load_config(path)
    assert (cfg.seed, cfg.lora_alpha, cfg.shift, cfg.weight_decay, len(cfg.title)) == (4294967295, 4096.0, 100.0, 1.0,
                                                                                        200)
    assert cfg.trigger == "sks\tdog\n" and cfg.targets == ["to_q"]


@pytest.mark.parametrize("flags, sentence", [
    (["--weight-decay", "1e300"], "error: --weight-decay: weight_decay = 1e+300 must be at most 1"),
    (["--seed", "99999999999999999999999"], "error: --seed: seed = 99999999999999999999999 must be a whole number "
                                             "from 0 to 4294967295"),
    (["--alpha", "1e308"], "error: --alpha: alpha = 1e+308 must be at most 1024 × rank"),
    (["--title", "t" * 300], "error: --title: title = 'tttt"),
])
def test_a_flag_out_of_range_is_one_sentence_naming_the_flag_before_anything_is_made(tmp_path, flags, sentence):
    """Issue 40, item 5: --weight-decay 1e300 trained until the weights exploded and then advised lowering --lr; a
    300-character --title trained fully and failed at the final write."""
    from click.testing import CliRunner

    from squareq.cli import main

    result = CliRunner().invoke(main, ["train", str(tmp_path / "x.slab"), "--data", str(tmp_path), "-o",
                                       str(tmp_path / "out"), *flags])
    lines = result.output.splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith(sentence), result.output
    assert not (tmp_path / "out").exists()


def test_a_bad_flag_value_names_the_flag():
    with pytest.raises(ConfigError, match="--batch-size"):
        load_config(None, {"batch_size": "two"})


def test_shift_minus_five_is_one_sentence_from_the_cli(tmp_path):
    from click.testing import CliRunner

    from squareq.cli import main

    result = CliRunner().invoke(main, ["train", str(tmp_path / "x.slab"), "--data", str(tmp_path), "-o",
                                       str(tmp_path / "out"), "--shift", "-5"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.startswith("error: --shift: shift = -5.0 must be a finite number above 0")
    assert not (tmp_path / "out").exists()


def test_a_rank_flag_keeps_the_files_scale_and_says_so(tmp_path, caplog):
    path = tmp_path / "run.toml"
    path.write_text("rank = 16\nalpha = 8\n")
    with caplog.at_level("WARNING", logger="squareq.train"):
        cfg = load_config(path, {"rank": 32})
    assert (cfg.rank, cfg.lora_alpha) == (32, 16.0)  # scale 0.5 kept
    assert any("--rank 32" in r.getMessage() and "alpha set to 16" in r.getMessage() for r in caplog.records)
    caplog.clear()
    both = load_config(path, {"rank": 32, "alpha": 4})
    assert (both.rank, both.lora_alpha) == (32, 4.0) and not caplog.records  # both given: they decide
    path.write_text("rank = 16\n")
    assert load_config(path, {"rank": 32}).lora_alpha == 32.0  # no alpha in the file: alpha = rank, scale 1


def test_lora_targets_default_to_the_familys():
    from squareq.models.flux import FLUX_LORA_TARGETS
    from squareq.runtime import DEFAULT_TARGETS

    cfg = TrainConfig()
    assert cfg.targets is None
    assert cfg.with_family_defaults("flux").targets == list(FLUX_LORA_TARGETS)
    assert cfg.with_family_defaults("wan").targets == list(DEFAULT_TARGETS)
    assert TrainConfig(targets=["to_q"]).with_family_defaults("flux").targets == ["to_q"]


def test_resolution_is_one_size_or_several(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text("resolution = 768\n")
    assert load_config(path).resolution == [768]
    assert load_config(path, {"resolution": "512,768,1024"}).resolution == [512, 768, 1024]
    cfg = TrainConfig(resolution=[512, 1024])
    assert cfg.largest_resolution == 1024 and TrainConfig(resolution=640).resolution == [640]


def test_kohya_keys_map_to_ours_or_get_a_sentence_each(tmp_path, caplog):
    """A kohya flux_train_network TOML: shared keys are read as SquareQ's, what SquareQ always does is dropped with a
    warning, and each key SquareQ cannot honour is refused with its own sentence."""
    path = tmp_path / "kohya.toml"
    path.write_text('network_dim = 32\nnetwork_alpha = 16\nlearning_rate = 5e-4\nmax_train_steps = 300\n'
                    'optimizer_type = "AdamW8bit"\nlr_scheduler = "constant_with_warmup"\nlr_warmup_steps = 10\n'
                    'resolution = "768,768"\ncaption_extension = ".caption"\nbucket_no_upscale = true\n'
                    'output_name = "my-lora"\nnetwork_module = "networks.lora_flux"\ngradient_checkpointing = true\n'
                    'discrete_flow_shift = 3.1582\nweighting_scheme = "cosmap"\ntimestep_sampling = "sigmoid"\n'
                    'clip_l = "m/clip_l.safetensors"\nt5xxl = "m/t5xxl_fp16.safetensors"\nae = "m/ae.safetensors"\n'
                    'mixed_precision = "fp16"\n')
    with caplog.at_level("WARNING", logger="squareq.train"):
        cfg = load_config(path)
    assert cfg.dtype == "fp16"  # kohya's mixed_precision
    assert (cfg.rank, cfg.lora_alpha, cfg.lr, cfg.steps, cfg.optimizer, cfg.schedule, cfg.warmup) == \
        (32, 16.0, 5e-4, 300, "adamw8bit", "constant_with_warmup", 10)
    assert (cfg.resolution, cfg.caption_ext, cfg.no_upscale, cfg.title, cfg.shift) == \
        ([768], ".caption", True, "my-lora", 3.1582)
    assert (cfg.loss_weighting, cfg.timestep_sampling) == ("cosmap", "logit_normal")
    assert cfg.encoder_files == {"clip_l": "m/clip_l.safetensors", "clip_g": None, "t5": "m/t5xxl_fp16.safetensors",
                                 "vae": "m/ae.safetensors"}  # kohya's encoder files, as --clip-l/--t5/--vae
    assert any("gradient_checkpointing" in r.getMessage() and "always checkpoints" in r.getMessage()
               for r in caplog.records)
    path.write_text('network_dim = 8\nnetwork_args = ["x=1"]\npretrained_model_name_or_path = "flux1-dev.safetensors"\n'
                    'optimizer_type = "Lion"\nmixed_precision = "no"\n')
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    for words in ("network_args: SquareQ's LoRA takes no network_args", "pretrained_model_name_or_path: the model is the slab",
                  "optimizer_type = 'Lion'", "mixed_precision = 'no': SquareQ trains the LoRA in fp32 under bf16 or fp16"):
        assert words in message, (words, message)
    path.write_text("network_dim = 8\nrank = 16\n")
    with pytest.raises(ConfigError, match="network_dim and rank both set rank"):
        load_config(path)


def test_kohya_files_keep_their_meaning_or_are_refused(tmp_path, caplog):
    """In a kohya file: unet_lr wins over learning_rate, Prodigy is kohya's name for ours, a non-square W,H and a
    prompt file that does not exist are refused, and kohya's sigmoid-based shift is reported as different from
    SquareQ's."""
    path = tmp_path / "kohya.toml"
    path.write_text('network_dim = 8\nlearning_rate = 1e-4\nunet_lr = 1.0\noptimizer_type = "Prodigy"\n'
                    'timestep_sampling = "shift"\n')
    with caplog.at_level("WARNING", logger="squareq.train"):
        cfg = load_config(path)
    assert (cfg.lr, cfg.optimizer, cfg.timestep_sampling) == (1.0, "prodigy", "shift")
    assert any("kohya shifts a sigmoid" in r.getMessage() for r in caplog.records)
    path.write_text('network_dim = 8\nresolution = "1024,768"\nsample_prompts = "prompts.txt"\n')
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "one bucket area" in str(err.value) and "kohya's is a file of prompts" in str(err.value)
    path.write_text('resolution = "512,768"\n')  # SquareQ's own file: two sizes
    assert load_config(path).resolution == [512, 768]


def test_lora_variants_are_checked_and_kohya_network_dropout_is_refused(tmp_path):
    base = {"slab": "s", "data": "d", "output": "o"}
    with pytest.raises(ConfigError, match="lora_dropout = 1.5 must be in \\[0, 1\\)"):
        load_config(None, {**base, "lora_dropout": 1.5})
    with pytest.raises(ConfigError, match="use_dora = 'yes' must be a bool, true or false"):
        load_config(None, {**base, "use_dora": "yes"})
    cfg = load_config(None, {**base, "use_dora": True, "lora_dropout": 0.1})
    assert (cfg.lora_variant.dora, cfg.lora_variant.dropout, cfg.lora_variant.plain) == (True, 0.1, False)
    assert load_config(None, base).lora_variant.plain
    path = tmp_path / "kohya.toml"
    path.write_text("network_dim = 8\nnetwork_dropout = 0.1\n")
    with pytest.raises(ConfigError, match="network_dropout: kohya drops the LoRA's rank activations.*set lora_dropout"):
        load_config(path)


def test_prefetch_is_auto_by_default_or_a_count_from_a_file_or_a_flag(tmp_path):
    assert load_config(None, {}).prefetch == "auto"
    assert load_config(None, {"prefetch": "3"}).prefetch == 3
    path = tmp_path / "ring.toml"
    path.write_text('prefetch = 4\n')
    assert load_config(path).prefetch == 4
    path.write_text('prefetch = "auto"\n')
    assert load_config(path).prefetch == "auto"
    for bad in ("0", "lots", "2.5"):
        with pytest.raises(ConfigError, match="--prefetch: prefetch = .* must be auto or a whole number of at least 1"):
            load_config(None, {"prefetch": bad})


def test_a_400_digit_vram_budget_is_one_sentence_naming_the_key():
    """Issue 40, item 5: it was an OverflowError traceback; the control: 12GB is read."""
    with pytest.raises(ConfigError, match=r"vram_budget: the size '1000.*' is more than any memory or disk holds"):
        load_config(None, {"slab": "s", "data": "d", "output": "o", "vram_budget": "1" + "0" * 400})
    assert load_config(None, {"slab": "s", "data": "d", "output": "o", "vram_budget": "12GB"}).vram_budget_bytes \
        == 12 * 10**9


def test_guidance_above_100_is_one_sentence_and_100_is_taken():
    """Issue 40: a guidance of 1e300 is finite, and overflows the pipeline's float32 guidance tensor at the first
    sample image; the control: the range's ends are taken."""
    with pytest.raises(ConfigError, match=r"sample_guidance = 1e\+300 must be at most 100"):
        load_config(None, {"sample_guidance": 1e300})
    cfg = load_config(None, {"guidance": 100.0, "sample_guidance": 0.0})
    assert (cfg.guidance, cfg.sample_guidance) == (100.0, 0.0)


def test_attention_is_auto_by_default_and_takes_the_runtime_modes(tmp_path):
    assert load_config(None, {}).attention == "auto"
    path = tmp_path / "a.toml"
    for mode in ("auto", "cudnn", "default"):
        path.write_text(f'attention = "{mode}"\n')
        assert load_config(path).attention == mode


def test_kohya_schedule_keys_are_read_and_an_unknown_schedule_is_one_sentence(tmp_path):
    path = tmp_path / "kohya.toml"
    path.write_text('max_train_steps = 10\nlr_scheduler = "cosine_with_restarts"\nlr_scheduler_num_cycles = 3\n'
                    'lr_scheduler_power = 2.0\n')
    cfg = load_config(path)
    assert (cfg.schedule, cfg.schedule_cycles, cfg.schedule_power) == ("cosine_with_restarts", 3, 2.0)
    path.write_text('max_train_steps = 10\nlr_scheduler = "adafactor"\n')
    with pytest.raises(ConfigError, match="lr_scheduler = 'adafactor': SquareQ's schedules are constant, "):
        load_config(path)
    for bad in ("schedule_cycles = 0", "schedule_power = 0.0", 'schedule = "warmup_stable_decay"'):
        path.write_text(f"steps = 10\n{bad}\n")
        with pytest.raises(ConfigError, match=bad.split()[0]):
            load_config(path)


@pytest.mark.parametrize("kind", ["lora", "loha"])
def test_an_option_of_another_adapter_is_refused_by_name(kind):
    """The third audit: a LoKr factor on a plain LoRA was ignored, training another adapter than asked. It is refused
    naming the key; on a LoKr it is taken (the positive control)."""
    with pytest.raises(ConfigError, match=f"lokr_factor = 4 sets LoKr's Kronecker factor, and lora_type is {kind}"):
        load_config(None, {"lora_type": kind, "lokr_factor": 4})
    assert load_config(None, {"lora_type": "lokr", "lokr_factor": 4}).lokr_factor == 4
    assert load_config(None, {"lora_type": kind}).lokr_factor == -1


def test_lora_targets_that_match_no_layer_are_refused_before_the_cache_fills(tiny_slab, tmp_path):
    """The second and third audits: `--targets` matching no layer ended in a traceback after the cache was filled."""
    from click.testing import CliRunner

    from squareq.cli import main
    from squareq.slab import open_slab
    from squareq.train.run_plan import _check_targets
    from squareq.train.tiny_dataset import write_tiny_dataset

    data = write_tiny_dataset(tmp_path / "data", count=2)
    for targets, words in (("nothing_like_this", "targets nothing_like_this match no layer of this slab's"),
                           ("to_q,to_qq", "targets to_q, to_qq include to_qq, which matches no layer")):
        out = tmp_path / targets.replace(",", "-")
        result = CliRunner().invoke(main, ["train", str(tiny_slab), "--data", str(data), "-o", str(out), "--steps",
                                           "1", "--targets", targets])
        errors = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert result.exit_code == 1 and len(errors) == 1 and words in errors[0], result.output
        assert "to_out.0" in errors[0] or "proj_out" in errors[0]  # examples of the slab's own names
        assert not out.exists()  # refused before the cache (or anything) was written
    with open_slab(tiny_slab, verify="off") as slab:
        names = [layer.name for layer in slab.manifest.layers]
    _check_targets(["to_q", "to_k"], names, given=True)  # positive control: names that match are accepted
    _check_targets(["to_q", "not_in_this_model"], names, given=False)  # a family default may name absent layers


def test_an_option_the_run_would_ignore_is_named_in_a_warning(tmp_path, caplog):
    """The fourth audit: schedule_cycles without cosine_with_restarts (and its kin) trained silently as if unset."""
    import logging

    base = {"slab": "tiny-flux", "data": str(tmp_path), "output": str(tmp_path / "out")}
    with caplog.at_level(logging.WARNING, logger="squareq.train"):
        cfg = load_config(None, {**base, "schedule": "constant", "schedule_cycles": 4})
        load_config(None, {**base, "timestep_sampling": "uniform", "shift": 5.0})
        dataclasses.replace(cfg, steps=3)  # a run's later copies of its config say nothing again (the fifth audit)
    assert caplog.text.count("schedule_cycles = 4 only applies with schedule = \"cosine_with_restarts\"") == 1
    assert caplog.text.count("shift = 5.0 only applies with timestep_sampling = \"shift\"") == 1  # once, not 3x
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="squareq.train"):  # negative control: where they apply, no warning
        load_config(None, {**base, "schedule": "cosine_with_restarts", "schedule_cycles": 4})
    assert "only applies" not in caplog.text
