"""`squareq train`'s loop on tiny-flux: it learns, resumes bitwise after a kill, and stops on NaN."""
import json
import math
import re

import pytest
import torch
from PIL import Image

from squareq import runtime
from squareq.extras import pip_command
from squareq.models import load_builtin
from squareq.quant import QuantSpec
from squareq.compiler.plain import PlainOptions, write_rtn_slab
from squareq.train.config import ConfigError, TrainConfig, load_config
from squareq.train.lora_factors import LoraFileError
from squareq.train.lora_reader import load_lora
from squareq.train.errors import TrainError
from squareq.train.loop import train

from .tiny_run import w8_tiny_slab

# the torch reference dequantizer (conftest.py), for the module fixtures too
pytestmark = pytest.mark.usefixtures("torch_kernels")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    w8_tiny_slab(root / "tiny.slab")
    data = root / "data"
    data.mkdir()
    for i, (color, caption) in enumerate([((220, 30, 30), "a red square"), ((30, 30, 220), "a blue square"),
                                          ((30, 200, 30), "a green square"), ((230, 230, 20), "a yellow square")]):
        Image.new("RGB", (64, 64), color).save(data / f"img{i}.png")
        (data / f"img{i}.txt").write_text(caption)
    (data / "broken.png").write_bytes(b"not an image")
    (data / "broken.txt").write_text("never used")
    return root


def _config(ws, out, **kw):
    values = {"slab": str(ws / "tiny.slab"), "data": str(ws / "data"), "output": str(out), "resolution": 64,
              "max_sequence_length": 16, "steps": 20, "lr": 3e-3, "rank": 4, "save_every": 5, "batch_size": 2,
              "cache_dir": str(ws / "cache")}
    values.update(kw)
    return load_config(None, values)


def _eval_loss(ws, lora_file, seed=0) -> float:
    """The flow loss on every cached latent at fixed noise and timesteps, with the LoRA (or without it)."""
    from squareq.train.cache import EmbeddingCache
    from squareq.train.objective import flow_loss, flow_match, image_ids, pack_latents, text_ids

    model = runtime.load(ws / "tiny.slab", "cpu", options=runtime.LoadOptions(stream=False))
    if lora_file is not None:
        lora, info = load_lora(lora_file)
        runtime.add_lora(model, rank=info["rank"], alpha=info["alpha"], targets=sorted({n.rsplit(".", 2)[0] for n in lora}))
        with torch.no_grad():
            for name, p in runtime.lora_parameters(model).items():
                p.copy_(lora[name])
    cache = EmbeddingCache(ws / "cache")
    latents = torch.stack([cache.load("latents", p.stem)["latents"] for p in sorted((ws / "cache" / "latents").iterdir())])
    text = [cache.load("text", p.stem) for p in sorted((ws / "cache" / "text").iterdir())][: len(latents)]
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(latents.shape, generator=g)
    t = torch.linspace(0.2, 0.8, len(latents))
    x_t, target = flow_match(latents, noise, t)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        pred = model(hidden_states=pack_latents(x_t), encoder_hidden_states=torch.stack([e["prompt_embeds"] for e in text]),
                     pooled_projections=torch.stack([e["pooled_prompt_embeds"] for e in text]), timestep=t,
                     guidance=torch.ones_like(t), img_ids=image_ids(8, 8), txt_ids=text_ids(16), return_dict=False)[0]
    return float(flow_loss(pred, pack_latents(target)))


def test_training_lowers_the_loss_and_writes_a_lora(workspace, tmp_path, caplog):
    result = train(_config(workspace, tmp_path / "run", steps=40), echo=lambda s: None)
    assert result.steps == 40 and result.skipped_steps == 0
    assert result.lora_file.name == "pytorch_lora_weights.safetensors"
    assert any("broken.png" in r.getMessage() for r in caplog.records)  # the bad image was reported and skipped
    before, after = _eval_loss(workspace, None), _eval_loss(workspace, result.lora_file)
    assert after < 0.97 * before, (before, after)


def test_a_killed_run_resumes_to_the_same_lora(workspace, tmp_path, capsys):
    lines = []
    straight = train(_config(workspace, tmp_path / "straight"), echo=lines.append)
    progress = [line for line in lines if line.startswith("step ")]
    assert len(progress) == 10 and progress[-1].startswith("step 20/20: loss ")  # no terminal: ten progress lines
    assert all(k in progress[-1] for k in ("(avg ", "lr ", "grad norm ", " it/s"))
    # the attention choice is said, with why (on a CPU: torch's order)
    assert any(line.startswith("attention auto: torch order: ") and "CUDA" in line for line in lines), lines

    def kill(step):
        if step == 12:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(_config(workspace, tmp_path / "killed"), echo=lambda s: None, after_step=kill)
    capsys.readouterr()
    resumed = train(_config(workspace, tmp_path / "killed", resume="latest"), echo=lines.append, progress=True)
    bar = capsys.readouterr().err
    assert "10/20" in bar and "20/20" in bar and "grad norm" in bar  # the bar resumes at step 10
    assert "step/s" in bar or "s/step" in bar
    a, _ = load_lora(straight.lora_file)
    b, _ = load_lora(resumed.lora_file)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert resumed.steps == straight.steps == 20


def test_a_step_poisoned_by_cudnn_is_redone_exactly(workspace, tmp_path, monkeypatch):
    """On a GPU whose cuDNN attention backward returns NaN without raising, the trainer turns cuDNN off and redoes the
    step with the same batch, noise and timesteps: the run ends as if nothing happened (simulated on the CPU)."""
    import squareq.train.objective as objective
    import squareq.train.step as step

    straight = train(_config(workspace, tmp_path / "straight", steps=6, save_every=0), echo=lambda s: None)
    real = objective.flow_loss  # the trainer's loss goes through objective.denoising_loss
    calls = {"n": 0}

    def poisoned_once(pred, target, weighting=None, mask=None):
        calls["n"] += 1
        loss = real(pred, target, weighting, mask)
        return loss * float("nan") if calls["n"] == 3 else loss

    retries = []
    monkeypatch.setattr(objective, "flow_loss", poisoned_once)
    monkeypatch.setattr(step.runtime, "retry_without_cudnn", lambda device: not retries and not retries.append(device))
    redone = train(_config(workspace, tmp_path / "redone", steps=6, save_every=0), echo=lambda s: None)
    assert len(retries) == 1 and calls["n"] == 7 and redone.skipped_steps == 0
    a, _ = load_lora(straight.lora_file)
    b, _ = load_lora(redone.lora_file)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert redone.losses == straight.losses


def test_nan_losses_are_skipped_then_stop_the_run(workspace, tmp_path, monkeypatch):
    import squareq.train.objective as objective

    real = objective.flow_loss  # the trainer's loss goes through objective.denoising_loss
    calls = {"n": 0}

    def poisoned(pred, target, weighting=None, mask=None):
        calls["n"] += 1
        loss = real(pred, target, weighting, mask)
        return loss * float("nan") if calls["n"] > 6 else loss

    monkeypatch.setattr(objective, "flow_loss", poisoned)
    out = tmp_path / "nan"
    with pytest.raises(TrainError, match="NaN/Inf") as err:
        train(_config(workspace, out, nan_patience=3), echo=lambda s: None)
    assert "--resume latest" in str(err.value) and "step-00000005" in str(err.value)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000005"]
    assert (out / "metrics.jsonl").stat().st_size > 0  # the control: steps were written, so the file stays
    # with no checkpoint before the NaN steps, the sentence points to none (the fourth audit: it named one)
    calls["n"] = 6
    early = tmp_path / "nan-early"
    with pytest.raises(TrainError, match="no checkpoint was written before them") as err:
        train(_config(workspace, early, nan_patience=3), echo=lambda s: None)
    assert "--resume latest" not in str(err.value)
    assert not (early / "metrics.jsonl").exists()  # no step finished: no empty metrics file left (the audit)


def test_a_step_that_blows_the_weights_up_stops_the_run_and_saves_nothing_of_it(workspace, tmp_path, monkeypatch):

    real_step = torch.optim.AdamW.step
    calls = {"n": 0}

    def overflowing(self, *args, **kwargs):  # finite loss and gradients, non-finite weights after the update
        out = real_step(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 7:
            with torch.no_grad():
                self.param_groups[0]["params"][0].fill_(float("inf"))
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", overflowing)
    out = tmp_path / "inf"
    with pytest.raises(TrainError, match="step 7 made the LoRA weights NaN/Inf") as err:
        train(_config(workspace, out), echo=lambda s: None)
    assert "step-00000005" in str(err.value) and "Lower --lr" in str(err.value)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000005"]
    assert not (out / "pytorch_lora_weights.safetensors").exists()


def test_a_checkpoint_lora_keeps_the_trained_alpha(workspace, tmp_path):
    """Exporting or loading a checkpoint's LoRA gives the run's alpha (rank 4, alpha 2: scale 0.5), not alpha = rank."""
    out = tmp_path / "alpha"
    train(_config(workspace, out, steps=5, save_every=5, alpha=2.0), echo=lambda s: None)
    checkpoint = next((out / "checkpoints").iterdir())
    # the run's last checkpoint and its final LoRA hold the same factors; both must scale them the same way
    factors, info = load_lora(checkpoint / "lora.safetensors")
    final, final_info = load_lora(out / "pytorch_lora_weights.safetensors")
    assert info["rank"] == final_info["rank"] == 4 and info["alpha"] == final_info["alpha"] == 2.0


def test_lr_inf_is_refused_in_one_sentence_and_writes_no_lora(workspace, tmp_path):
    from click.testing import CliRunner

    from squareq.cli import main

    out = tmp_path / "lr"
    result = CliRunner().invoke(main, ["train", str(workspace / "tiny.slab"), "--data", str(workspace / "data"), "-o",
                                       str(out), "--resolution", "64", "--steps", "1", "--lr", "inf"])
    assert result.exit_code != 0 and "lr" in result.output and "finite positive number" in result.output
    assert "Traceback" not in result.output and not (out / "pytorch_lora_weights.safetensors").exists()


def test_cuda_graphs_without_a_gpu_are_refused_before_caching(workspace, tmp_path):
    from click.testing import CliRunner

    from squareq.cli import main

    out = tmp_path / "graphs"
    base = ["train", str(workspace / "tiny.slab"), "--data", str(workspace / "data"), "-o", str(out), "--resolution",
            "64", "--steps", "1"]
    result = CliRunner().invoke(main, base + ["--cuda-graphs", "on"])
    assert result.exit_code != 0 and "--cuda-graphs on needs a CUDA GPU" in result.output, result.output
    assert "Traceback" not in result.output and not (out / "cache").exists()
    # auto (the default) is on with a GPU only: every CPU training test runs with it and would fail if it were on
    assert TrainConfig(slab="x", data="d", output="o", steps=1).cuda_graphs == "auto"
    assert TrainConfig(slab="x", data="d", output="o", steps=1, cuda_graphs=True).cuda_graphs == "on"  # old files
    old_file = tmp_path / "old.toml"
    old_file.write_text("cuda_graphs = false\n")
    assert load_config(old_file, {"slab": "x", "data": "d", "output": "o"}).cuda_graphs == "off"
    with pytest.raises(ConfigError, match="cuda_graphs"):
        TrainConfig(slab="x", data="d", output="o", steps=1, cuda_graphs="yes")
    printed = CliRunner().invoke(main, base + ["--cuda-graphs", "--print-config"])  # a bare flag, as before: on
    assert printed.exit_code == 0 and 'cuda_graphs = "on"' in printed.output, printed.output


def test_cuda_graphs_auto_is_on_with_a_gpu_unless_dropout_or_a_vram_budget_would_make_it_wrong():
    from squareq.train.run_plan import _use_cuda_graphs

    gpu, cpu, said = torch.device("cuda", 0), torch.device("cpu"), []

    def settle(device, **values):
        return _use_cuda_graphs(TrainConfig(slab="x", data="d", output="o", steps=1, **values), device, said.append)

    assert settle(gpu) and settle(gpu, cuda_graphs="on") and not settle(gpu, cuda_graphs="off")
    assert not settle(cpu) and not settle(cpu, cuda_graphs="off")
    with pytest.raises(TrainError, match="--cuda-graphs on needs a CUDA GPU"):
        settle(cpu, cuda_graphs="on")
    assert not settle(gpu, lora_dropout=0.1) and said == []
    assert not settle(gpu, vram_budget="12GB") and "vram_budget" in said[-1]  # the plan does not count graphs
    assert settle(gpu, vram_budget="12GB", cuda_graphs="on")


def test_the_train_command_runs_and_refuses_bad_input(workspace, tmp_path):
    from click.testing import CliRunner

    from squareq.cli import main

    runner = CliRunner()
    out = tmp_path / "cli"
    args = ["train", str(workspace / "tiny.slab"), "--data", str(workspace / "data"), "-o", str(out),
            "--resolution", "64", "--max-sequence-length", "16", "--steps", "3", "--rank", "2",
            "--cache-dir", str(workspace / "cache")]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    assert (out / "pytorch_lora_weights.safetensors").is_file() and "done: 3 steps" in result.output

    printed = runner.invoke(main, args + ["--print-config"])
    assert printed.exit_code == 0 and "rank = 2" in printed.output and "steps = 3" in printed.output
    (tmp_path / "cfg.toml").write_text(printed.output)
    again = runner.invoke(main, ["train", "--config", str(tmp_path / "cfg.toml"), "--print-config"])
    assert again.output == printed.output

    missing = runner.invoke(main, ["train", str(workspace / "tiny.slab"), "-o", str(out)])
    assert missing.exit_code == 2 and "--data is required" in missing.output
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = runner.invoke(main, args[:3] + [str(empty), "-o", str(tmp_path / "other")] + args[6:])
    assert bad.exit_code == 1 and str(empty) in bad.output and bad.output.startswith("error:")


def test_samples_during_training_do_not_change_the_lora(workspace, tmp_path, monkeypatch):
    from squareq.train import prepare, run_samples

    plain = train(_config(workspace, tmp_path / "plain", steps=4), echo=lambda s: None)
    opened, decoders, original, original_decoder = [], [], prepare.open_encoders, run_samples.open_decoder
    monkeypatch.setattr(prepare, "open_encoders", lambda *a, **k: opened.append(a) or original(*a, **k))
    monkeypatch.setattr(run_samples, "open_decoder", lambda *a, **k: decoders.append(a) or original_decoder(*a, **k))
    sampled = train(_config(workspace, tmp_path / "sampled", steps=4, sample_every=2, cache_dir=str(tmp_path / "c"),
                            sample_prompts=["a red square", "a blue square"], sample_steps=2), echo=lambda s: None)
    # the text encoders ran once, to fill the cache (the sample prompts' embeddings too); the VAE was loaded once for
    # the three sample steps
    assert len(opened) == 1 and len(decoders) == 1
    # the base model's samples before the first step, then every 2 steps; each step's prompts side by side in a grid
    assert sorted(p.name for p in (tmp_path / "sampled" / "samples").iterdir()) == [
        f"step-0000000{k}-{i}.png" for k in (0, 2, 4) for i in ("0", "1", "grid")]
    from PIL import Image

    with Image.open(tmp_path / "sampled" / "samples" / "step-00000002-grid.png") as grid, \
            Image.open(tmp_path / "sampled" / "samples" / "step-00000002-0.png") as one:
        assert grid.size == (2 * one.width, one.height)
        assert grid.crop((0, 0, one.width, one.height)).tobytes() == one.tobytes()
    a, _ = load_lora(plain.lora_file)
    b, _ = load_lora(sampled.lora_file)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the base model's sample from the cached embeddings is the image `squareq sample` draws encoding the prompt then,
    # up to the text encoders' precision: the cache encodes in the encoders' dtype, `squareq sample` under the
    # drawing's bf16 autocast (on the CPU: fp32 against bf16 T5 outputs); another prompt is far further off
    from click.testing import CliRunner

    from squareq.cli import main

    drawn = CliRunner().invoke(main, ["sample", str(workspace / "tiny.slab"), "--prompt", "a red square", "--resolution",
                                      "64", "--steps", "2", "--max-sequence-length", "16", "--guidance", "3.5",
                                      "--seed", "42", "-o", str(tmp_path / "drawn")])
    assert drawn.exit_code == 0, drawn.output
    import numpy as np

    def pixels(path):
        with Image.open(path) as image:
            return np.asarray(image).astype(int)

    reference = pixels(tmp_path / "drawn" / "sample-000.png")
    same = np.abs(pixels(tmp_path / "sampled" / "samples" / "step-00000000-0.png") - reference)
    other = np.abs(pixels(tmp_path / "sampled" / "samples" / "step-00000000-1.png") - reference)
    assert same.max() <= 8 and same.mean() < 1.0 and other.mean() > 3 * same.mean()


def test_sample_and_export_commands(workspace, tmp_path, caplog):
    import numpy as np
    from click.testing import CliRunner

    from squareq.cli import main
    from squareq.train.lora_files import save_diffusers_lora

    model = runtime.load(workspace / "tiny.slab", "cpu", options=runtime.LoadOptions(stream=False))
    params = runtime.add_lora(model, rank=4, seed=3)
    with torch.no_grad():
        for p in params:
            p.normal_(0, 0.5)
    save_diffusers_lora(runtime.lora_state_dict(model), tmp_path / "lora", 4, 4.0, ["to_q", "to_k", "to_v", "to_out.0"])
    runner = CliRunner()
    base = ["sample", str(workspace / "tiny.slab"), "--prompt", "a red square", "--resolution", "64", "--steps", "2",
            "--max-sequence-length", "16"]
    plain = runner.invoke(main, base + ["-o", str(tmp_path / "plain")])
    with_lora = runner.invoke(main, base + ["-o", str(tmp_path / "lora_img"), "--lora", str(tmp_path / "lora")])
    assert plain.exit_code == 0 and with_lora.exit_code == 0, plain.output + with_lora.output
    a = np.asarray(Image.open(tmp_path / "plain" / "sample-000.png")).astype(int)
    b = np.asarray(Image.open(tmp_path / "lora_img" / "sample-000.png")).astype(int)
    assert a.shape == (64, 64, 3) and np.abs(a - b).mean() > 1.0  # the LoRA changes the image
    # a ring grown and blocks kept on the device after the second step draw the same image
    caplog.set_level("INFO", logger="squareq.runtime")
    tuned = runner.invoke(main, base + ["-o", str(tmp_path / "tuned"), "--steps", "3", "--prefetch", "4",
                                        "--resident-blocks", "2"])
    streamed3 = runner.invoke(main, base + ["-o", str(tmp_path / "streamed3"), "--steps", "3", "--prefetch", "2"])
    assert tuned.exit_code == 0 and streamed3.exit_code == 0, tuned.output + streamed3.output
    assert "4 slots, 2 blocks kept on the GPU" in caplog.text
    assert np.array_equal(np.asarray(Image.open(tmp_path / "tuned" / "sample-000.png")),
                          np.asarray(Image.open(tmp_path / "streamed3" / "sample-000.png")))
    refused = runner.invoke(main, base + ["--prefetch", "0"])
    assert refused.exit_code == 2 and "'0': give auto or a whole number of at least 1" in refused.output
    unread = runner.invoke(main, base + ["--vram-budget", "lots"])
    assert unread.exit_code == 1 and "--vram-budget: cannot read the size 'lots'" in unread.output
    cpu = runner.invoke(main, base + ["--vram-budget", "3GB", "-o", str(tmp_path / "cpu")])
    assert cpu.exit_code == 1 and "--vram-budget bounds the GPU slots" in cpu.output and "samples on cpu" in cpu.output

    kohya = tmp_path / "lora_kohya.safetensors"
    exported = runner.invoke(main, ["export-lora", str(tmp_path / "lora"), "-o", str(kohya)])
    assert exported.exit_code == 0, exported.output
    back, info = load_lora(kohya)
    orig, _ = load_lora(tmp_path / "lora")
    assert info["layout"] == "kohya"
    for layer in {k.rsplit(".", 2)[0] for k in orig}:  # the same update per layer, even where kohya fuses q, k, v
        delta = lambda f: f[layer + ".lora_B.weight"].float() @ f[layer + ".lora_A.weight"].float()
        assert torch.allclose(delta(orig) / orig[layer + ".lora_A.weight"].shape[0],
                              delta(back) / back[layer + ".lora_A.weight"].shape[0], atol=1e-6), layer


def test_out_of_memory_saves_and_says_which_knob_to_turn(workspace, tmp_path, monkeypatch):
    import squareq.train.objective as objective

    real = objective.flow_loss  # the trainer's loss goes through objective.denoising_loss
    calls = {"n": 0}

    def exhausted(pred, target, weighting=None, mask=None):
        calls["n"] += 1
        if calls["n"] == 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(pred, target, weighting, mask)

    monkeypatch.setattr(objective, "flow_loss", exhausted)
    out = tmp_path / "oom"
    with pytest.raises(TrainError, match="ran out of memory in step 4") as err:
        train(_config(workspace, out, save_every=0), echo=lambda s: None)
    assert "--resolution" in str(err.value) and "--resume latest" in str(err.value)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000003"]


def _first_gradient(out_file):
    def record(step, grads):
        if step == 1:
            from safetensors.torch import save_file

            save_file({"g": torch.cat([g.reshape(-1) for g in grads]).contiguous()}, str(out_file))
    return record


def _rank_main(rank: int, world: int, port: int, values: dict, grad_file: str, shm: str) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), SQUAREQ_KERNELS="torch",
                      SQUAREQ_SHM_DIR=shm)
    torch.set_num_threads(1)
    train(load_config(None, values), echo=lambda s: None,
          on_gradients=_first_gradient(grad_file) if rank == 0 else None)


def test_two_gloo_ranks_train_like_one_process_with_the_whole_batch(workspace, tmp_path):
    """2 ranks x batch 1 take the step of 1 process x batch 2: the averaged gradient matches up to bf16 compute
    rounding (the models run batch 1 vs batch 2), and both runs write the same checkpoints and LoRA file. The
    two ranks of this host stream from one shared host copy of the slab, removed when they finish."""
    import socket

    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    steps = {"steps": 4, "save_every": 2}
    single = train(_config(workspace, tmp_path / "single", batch_size=2, **steps), echo=lambda s: None,
                   on_gradients=_first_gradient(tmp_path / "single.safetensors"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    values = _config(workspace, tmp_path / "ranks", batch_size=1, **steps).to_dict()
    shm = tmp_path / "shm"
    shm.mkdir()
    mp.spawn(_rank_main, args=(2, port, values, str(tmp_path / "ranks.safetensors"), str(shm)), nprocs=2, join=True)
    assert any(p.name.endswith(".users.lock") for p in shm.iterdir()), "the ranks did not use a shared host copy"
    assert not any(p.name.endswith((".blobs", ".part")) for p in shm.iterdir())
    g1 = load_file(str(tmp_path / "single.safetensors"))["g"]
    g2 = load_file(str(tmp_path / "ranks.safetensors"))["g"]
    assert float((g1 - g2).norm() / g1.norm()) < 1e-2
    a, _ = load_lora(single.lora_file)
    b, _ = load_lora(tmp_path / "ranks")
    assert a.keys() == b.keys()
    assert sorted(p.name for p in (tmp_path / "ranks" / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]


def test_cache_command_recomputes_only_what_changed(workspace, tmp_path):
    import shutil

    from click.testing import CliRunner

    from squareq.cli import main

    data = tmp_path / "data"
    shutil.copytree(workspace / "data", data)
    args = ["cache", str(workspace / "tiny.slab"), "--data", str(data), "--cache-dir", str(tmp_path / "cache"),
            "--resolution", "64", "--max-sequence-length", "16"]
    runner = CliRunner()
    first = runner.invoke(main, args)
    assert first.exit_code == 0, first.output
    assert "4 images cached" in first.output and "(9 entries computed now)" in first.output  # 4 latents, 4 + 1 texts
    (data / "img1.txt").write_text("a navy square")
    second = runner.invoke(main, args)
    assert "(1 entry computed now)" in second.output, second.output
    third = runner.invoke(main, args)
    assert "(0 entries computed now)" in third.output


def test_tensorboard_logging_or_a_sentence_when_it_is_missing(workspace, tmp_path, monkeypatch):
    import builtins
    import importlib.util

    if importlib.util.find_spec("tensorboard") is not None:
        train(_config(workspace, tmp_path / "tb", steps=2, log="tensorboard"), echo=lambda s: None)
        assert any((tmp_path / "tb" / "tensorboard").glob("events.out.tfevents.*"))
    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(TrainError, match="pip install tensorboard"):
        train(_config(workspace, tmp_path / "tb2", steps=2, log="tensorboard"), echo=lambda s: None)


def test_resume_rules(workspace, tmp_path):
    out = tmp_path / "run"
    train(_config(workspace, out, steps=4, save_every=2), echo=lambda s: None)
    with pytest.raises(TrainError, match="already holds checkpoints"):
        train(_config(workspace, out, steps=4), echo=lambda s: None)
    lines = []
    resumed = train(_config(workspace, out, steps=6, save_every=2, lr=1e-3, resume="latest"), echo=lines.append)
    assert resumed.steps == 6 and any("changed since: lr, steps" in line for line in lines)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]  # no step twice
    assert records[-1]["lr"] == pytest.approx(1e-3)  # the new learning rate, not the saved one
    with pytest.raises(TrainError, match="batch size"):
        train(_config(workspace, out, steps=8, save_every=2, batch_size=1, resume="latest"), echo=lambda s: None)


def test_resume_latest_refuses_a_corrupted_checkpoint_and_names_the_previous_one(workspace, tmp_path):
    from click.testing import CliRunner

    from squareq.cli import main

    out = tmp_path / "flipped"
    train(_config(workspace, out, steps=4, save_every=2, keep_last=2), echo=lambda s: None)
    latest = out / "checkpoints" / "step-00000004"
    lora = latest / "lora.safetensors"
    data = bytearray(lora.read_bytes())
    data[-2] ^= 0x40  # an exponent bit of the last float32 (the audit's case: the LoRA then held 4.0e37)
    lora.write_bytes(bytes(data))
    (out / "pytorch_lora_weights.safetensors").unlink()
    result = CliRunner().invoke(main, ["train", str(workspace / "tiny.slab"), "--data", str(workspace / "data"),
                                       "-o", str(out), "--resolution", "64", "--max-sequence-length", "16", "--steps",
                                       "6", "--rank", "4", "--cache-dir", str(workspace / "cache"), "--resume",
                                       "latest"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"{lora} fails its sha256 check" in result.output
    assert f"--resume {out / 'checkpoints' / 'step-00000002'}" in result.output
    assert not (out / "pytorch_lora_weights.safetensors").exists()


def test_output_problems_are_one_sentence_and_lose_no_saved_step(workspace, tmp_path, monkeypatch):
    import errno

    from click.testing import CliRunner

    import squareq.train.checkpoint as checkpoint_module
    from squareq.cli import main

    args = ["train", str(workspace / "tiny.slab"), "--data", str(workspace / "data"), "--resolution", "64",
            "--max-sequence-length", "16", "--steps", "4", "--save-every", "2", "--rank", "2",
            "--cache-dir", str(workspace / "cache")]
    runner = CliRunner()
    taken = tmp_path / "a-file"
    taken.write_text("not a folder")
    result = runner.invoke(main, args + ["-o", str(taken)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.startswith(f"error: -o/--out {taken} is a file, not a folder")

    def read_only(self, *a, **kw):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    with monkeypatch.context() as m:
        m.setattr(type(tmp_path), "mkdir", read_only)
        result = runner.invoke(main, args + ["-o", str(tmp_path / "ro" / "out")])
    assert result.exit_code == 1 and "is not writable (Read-only file system)" in result.output

    out = tmp_path / "full"
    real = checkpoint_module._write_json
    calls = []

    def disk_fills_at_the_second_checkpoint(path, obj):
        calls.append(path)
        if len(calls) > 2:  # two files per checkpoint: state.json and checksums.json
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, obj)

    monkeypatch.setattr(checkpoint_module, "_write_json", disk_fills_at_the_second_checkpoint)
    result = runner.invoke(main, args + ["-o", str(out)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "is full (No space left on device)" in result.output and "--resume latest" in result.output
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002"]  # no temporary left
    monkeypatch.setattr(checkpoint_module, "_write_json", real)
    resumed = runner.invoke(main, args + ["-o", str(out), "--resume", "latest"])
    assert resumed.exit_code == 0, resumed.output
    assert "resumed from" in resumed.output and (out / "pytorch_lora_weights.safetensors").is_file()


def test_lr_1e6_stops_at_the_first_exploded_step_and_writes_no_lora(workspace, tmp_path):
    """The audit's case: --lr 1e6 trained and saved LoRA weights up to 9.8e7."""
    from click.testing import CliRunner

    from squareq.cli import main

    out = tmp_path / "huge"
    args = ["train", str(workspace / "tiny.slab"), "--data", str(workspace / "data"), "--resolution", "64",
            "--max-sequence-length", "16", "--steps", "2", "--save-every", "1", "--cache-dir", str(workspace / "cache")]
    result = CliRunner().invoke(main, args + ["-o", str(out), "--lr", "1e6"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "step 1 made the LoRA weights as large as" in result.output and "no checkpoint was written" in result.output
    assert not (out / "pytorch_lora_weights.safetensors").exists() and not (out / "checkpoints").exists()
    sane = CliRunner().invoke(main, args + ["-o", str(tmp_path / "sane"), "--lr", "1e-3"])  # negative control
    assert sane.exit_code == 0, sane.output


def test_sample_refuses_bad_options_and_keeps_what_it_drew(workspace, tmp_path, monkeypatch):
    """The audit's cases: --resolution 7 and --steps 0 were tracebacks, --resolution 0 drew 1024², an existing file
    as -o failed only after drawing, --guidance nan saved a black PNG."""
    import errno

    from click.testing import CliRunner

    import squareq.slab.atomic as atomic
    from squareq.cli import main

    runner = CliRunner()
    base = ["sample", str(workspace / "tiny.slab"), "--prompt", "a red square", "--prompt", "a blue square",
            "--resolution", "64", "--steps", "2", "--max-sequence-length", "16"]
    for flag, value in (("--resolution", "7"), ("--resolution", "0"), ("--steps", "0"), ("--guidance", "nan"),
                        ("--guidance", "100.5"), ("--max-sequence-length", "0")):
        result = runner.invoke(main, base + ["-o", str(tmp_path / "never"), flag, value])
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output
        assert result.output.startswith(f"error: {flag} {value} must be"), result.output
    # issue 40: 1e300 is finite, and overflowed the pipeline's float32 guidance tensor in a traceback
    result = runner.invoke(main, base + ["-o", str(tmp_path / "never"), "--guidance", "1e300"])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert result.output.startswith("error: --guidance 1e+300 must be a number from 0 to 100"), result.output
    assert not (tmp_path / "never").exists()
    from squareq.train.sample import SampleError, check_sample_options

    check_sample_options(64, 2, 100.0, 16)  # the control: the range's ends are taken
    check_sample_options(64, 2, 0, 16)
    check_sample_options(8192, 1000, 3.5, 16)
    for resolution, steps, flag in ((8208, 2, "--resolution 8208"), (64, 1001, "--steps 1001")):
        with pytest.raises(SampleError, match=f"{flag} must be"):  # the bounds a prompt's --w/--s have
            check_sample_options(resolution, steps, 3.5, 16)
    result = runner.invoke(main, base + ["-o", str(tmp_path / "never"), "--cuda-graphs"])
    assert result.exit_code == 1 and "--cuda-graphs needs a CUDA GPU" in result.output, result.output
    assert not any((tmp_path / "never").glob("*.png"))

    taken = tmp_path / "a-file"
    taken.write_text("x")
    result = runner.invoke(main, base + ["-o", str(taken)])
    assert result.exit_code == 1 and f"-o/--out {taken} is a file" in result.output

    real = atomic.atomic_write_bytes
    written = []

    def full_at_the_second(path, data):
        if written:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        written.append(path)
        real(path, data)

    monkeypatch.setattr(atomic, "atomic_write_bytes", full_at_the_second)
    out = tmp_path / "full"
    result = runner.invoke(main, base + ["-o", str(out)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "is full (No space left on device)" in result.output
    assert sorted(p.name for p in out.iterdir()) == ["sample-000.png"]  # the first image was kept, no temporary


def test_a_lora_whose_shapes_do_not_fit_the_slab_is_one_sentence_naming_file_key_and_shapes(workspace, tmp_path):
    """Issue 40: a lora_A of another width was a RuntimeError traceback from ``copy_``, and one of width 1 was
    broadcast over the layer without a word; the control: the file it was edited from draws."""
    from click.testing import CliRunner
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from squareq.cli import main
    from squareq.train.lora_attach import attach_lora
    from squareq.train.lora_factors import LoraFileError
    from squareq.train.lora_files import WEIGHT_NAME, save_diffusers_lora, save_kohya_lora

    model = runtime.load(workspace / "tiny.slab", "cpu", options=runtime.LoadOptions(stream=False))
    runtime.add_lora(model, rank=4, seed=3)
    lora = runtime.lora_state_dict(model)
    good = save_diffusers_lora(lora, tmp_path / "good", 4, 4.0, ["to_q", "to_k", "to_v", "to_out.0"])
    with safe_open(str(good), "pt") as f:
        header = f.metadata()
    tensors, layer = load_file(str(good)), "single_transformer_blocks.0.attn.to_k"
    key, width = f"transformer.{layer}.lora_A.weight", model.get_submodule(layer).in_features
    base = ["sample", str(workspace / "tiny.slab"), "--prompt", "a red square", "--resolution", "64", "--steps", "2",
            "--max-sequence-length", "16"]
    for wrong in (width + 3, 1):
        bad = tmp_path / f"width-{wrong}"
        bad.mkdir()
        save_file({**tensors, key: torch.zeros(4, wrong, dtype=tensors[key].dtype)}, str(bad / WEIGHT_NAME), header)
        result = CliRunner().invoke(main, base + ["--lora", str(bad), "-o", str(tmp_path / f"out-{wrong}")])
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output
        assert result.output.startswith(f"error: {bad / WEIGHT_NAME}: {key} is [4, {wrong}] but the slab's layer "
                                        f"{layer} takes [4, {width}];"), result.output
        assert not any((tmp_path / f"out-{wrong}").glob("*.png"))
    drawn = CliRunner().invoke(main, base + ["--lora", str(tmp_path / "good"), "-o", str(tmp_path / "drawn")])
    assert drawn.exit_code == 0 and (tmp_path / "drawn" / "sample-000.png").is_file(), drawn.output

    # a kohya file names its fused module's key; the model is left without any LoRA
    kohya = save_kohya_lora(lora, tmp_path / "k.safetensors", 4, 4.0, ["to_q", "to_k", "to_v", "to_out.0"])
    down = "lora_unet_double_blocks_0_img_attn_proj.lora_down.weight"
    tensors = load_file(str(kohya))
    save_file({**tensors, down: torch.zeros(4, tensors[down].shape[1] + 1)}, str(kohya))
    fresh = runtime.load(workspace / "tiny.slab", "cpu", options=runtime.LoadOptions(stream=False))
    with pytest.raises(LoraFileError, match=rf"k\.safetensors: {down} \(its part for layer "
                                            r"transformer_blocks\.0\.attn\.to_out\.0\) is \[4, \d+\] but"):
        attach_lora(fresh, *load_lora(kohya))
    assert all(getattr(m, "lora_A", None) is None for m in fresh.modules())


def test_an_overflowing_lora_draws_no_black_image(workspace, tmp_path):
    """Finite factors whose product overflows bf16 make the latents NaN; the image is refused, not saved black."""
    from click.testing import CliRunner

    from squareq.cli import main
    from squareq.train.lora_files import save_diffusers_lora

    model = runtime.load(workspace / "tiny.slab", "cpu", options=runtime.LoadOptions(stream=False))
    params = runtime.add_lora(model, rank=2, seed=3)
    with torch.no_grad():
        for p in params:
            p.fill_(1e20)
    save_diffusers_lora(runtime.lora_state_dict(model), tmp_path / "huge", 2, 2.0, ["to_q", "to_k", "to_v", "to_out.0"])
    out = tmp_path / "black"
    result = CliRunner().invoke(main, ["sample", str(workspace / "tiny.slab"), "--prompt", "a red square",
                                       "--resolution", "64", "--steps", "2", "--max-sequence-length", "16",
                                       "--lora", str(tmp_path / "huge"), "-o", str(out)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "produced NaN or Inf, so its image (it would be black) is not saved" in result.output
    assert not out.exists() or list(out.iterdir()) == []  # no image; a failed command removes the folder it made


def _comfyui_deltas(path) -> dict[str, torch.Tensor]:
    """Each module's weight delta as ComfyUI computes it (comfy/lora.py): ``alpha / rank * up @ down``, where alpha is
    the module's ``.alpha`` tensor and, without one, the rank (scale 1)."""
    from safetensors.torch import load_file

    sd = load_file(str(path))
    deltas = {}
    for key in sd:
        for down, up in ((".lora_down.weight", ".lora_up.weight"), (".lora_A.weight", ".lora_B.weight")):
            if key.endswith(down):
                stem = key[: -len(down)]
                d, u = sd[key].float(), sd[stem + up].float()
                alpha = float(sd[stem + ".alpha"]) if stem + ".alpha" in sd else d.shape[0]
                deltas[stem] = alpha / d.shape[0] * (u @ d)
    return deltas


def test_the_default_output_loads_at_the_trained_strength_in_comfyui(workspace, tmp_path):
    """Rank 8, alpha 4: ComfyUI's formula on the default output's kohya file gives scale 0.5, i.e. the same deltas as
    the diffusers file at its adapter metadata's alpha / rank. The diffusers file alone cannot carry that to ComfyUI
    (no .alpha tensors: it would load at twice the strength), and --save-format diffusers writes no kohya file."""
    from safetensors import safe_open

    out = tmp_path / "comfy"
    result = train(_config(workspace, out, steps=3, rank=8, alpha=4.0, save_every=0), echo=lambda s: None)
    assert result.kohya_file == out / "comfy_kohya.safetensors" and result.kohya_file.is_file()
    with safe_open(str(result.kohya_file), "pt") as f:
        scales = {k[: -len(".alpha")]: float(f.get_tensor(k)) / f.get_tensor(k[: -len(".alpha")] + ".lora_down.weight").shape[0]
                  for k in f.keys() if k.endswith(".alpha")}
    assert scales and set(scales.values()) == {0.5}
    # FLUX.1's default targets, as kohya's: every attention and MLP linear of both streams of tiny-flux's 2 double
    # and 2 single blocks (2 x 12 + 2 x 5 diffusers layers, 2 x 8 + 2 x 2 kohya modules), no modulation
    assert len(scales) == 20
    factors, info = load_lora(result.lora_file)
    assert info["rank"] == 8 and info["alpha"] == 4.0
    layers = {n.rsplit(".", 2)[0] for n in factors}
    assert len(layers) == 34 and not [n for n in layers if "norm" in n]
    trained = sum(float((0.5 * factors[n[: -len("lora_A.weight")] + "lora_B.weight"].float()
                         @ factors[n].float()).square().sum()) for n in factors if n.endswith("lora_A.weight"))
    comfy = sum(float(d.square().sum()) for d in _comfyui_deltas(result.kohya_file).values())
    assert trained > 0 and comfy == pytest.approx(trained, rel=1e-4)
    # negative control: the diffusers file through ComfyUI's formula is at scale 1, twice the amplitude
    diffusers_in_comfy = sum(float(d.square().sum()) for d in _comfyui_deltas(result.lora_file).values())
    assert diffusers_in_comfy == pytest.approx(4 * trained, rel=1e-4)
    only = train(_config(workspace, tmp_path / "only", steps=1, save_every=0, save_format=["diffusers"]),
                 echo=lambda s: None)
    assert only.kohya_file is None and not list((tmp_path / "only").glob("*_kohya.safetensors"))


def test_the_lora_files_carry_modelspec_and_training_metadata(workspace, tmp_path):
    """Both files name the architecture (flux-1-dev/lora), title, trigger phrase and the run's parameters; the
    dataset's folders and caption tags are counted as sd-scripts counts them."""
    from safetensors import safe_open

    out = tmp_path / "meta"
    result = train(_config(workspace, out, steps=2, save_every=0, trigger="sks", title="My LoRA", lr=2e-3),
                   echo=lambda s: None)
    assert result.kohya_file.name == "My_LoRA_kohya.safetensors"
    for path, implementation in ((result.lora_file, "diffusers"),
                                 (result.kohya_file, "https://github.com/black-forest-labs/flux")):
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        assert meta["modelspec.sai_model_spec"] == "1.0.0" and meta["modelspec.architecture"] == "flux-1-dev/lora"
        assert meta["modelspec.implementation"] == implementation and meta["modelspec.title"] == "My LoRA"
        assert meta["modelspec.trigger_phrase"] == "sks" and meta["modelspec.resolution"] == "64x64"
        assert meta["ss_base_model_version"] == "flux1" and meta["ss_sd_model_name"] == "tiny-flux"
        assert meta["ss_learning_rate"] == "0.002" and meta["ss_max_train_steps"] == "2"
        assert meta["ss_network_dim"] == "4" and meta["ss_network_alpha"] == "4" and meta["ss_num_train_images"] == "4"
        assert json.loads(meta["ss_dataset_dirs"]) == {".": {"n_repeats": 1, "img_count": 4}}
        assert json.loads(meta["ss_tag_frequency"]) == {".": {"a red square": 1, "a blue square": 1,
                                                              "a green square": 1, "a yellow square": 1}}


def test_source_date_epoch_makes_two_identical_runs_write_identical_lora_files(workspace, tmp_path, monkeypatch):
    """Issue 40, item 9: two identical runs wrote LoRA files that differed in modelspec.date and
    ss_training_*_at. With SOURCE_DATE_EPOCH (reproducible-builds.org) those hold it and the bytes agree; without it
    they hold the run's own times, as kohya's files do; a malformed one is refused before anything is made."""
    from safetensors import safe_open

    def header(path):
        with safe_open(str(path), "pt") as f:
            return f.metadata()

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    runs = [train(_config(workspace, tmp_path / run / "lora", steps=2, save_every=0), echo=lambda s: None)
            for run in ("a", "b")]
    for file in ("lora_file", "kohya_file"):
        assert getattr(runs[0], file).read_bytes() == getattr(runs[1], file).read_bytes(), file
        meta = header(getattr(runs[0], file))
        assert (meta["ss_training_started_at"], meta["ss_training_finished_at"]) == ("1700000000", "1700000000")
        assert meta["modelspec.date"] == "2023-11-14T22:13:20+00:00"

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "yesterday")
    with pytest.raises(TrainError, match=r"SOURCE_DATE_EPOCH='yesterday' is not a whole number of seconds"):
        train(_config(workspace, tmp_path / "never"), echo=lambda s: None)
    assert not (tmp_path / "never").exists()

    monkeypatch.delenv("SOURCE_DATE_EPOCH")  # the control: the run's own times
    import time

    before = time.time()
    meta = header(train(_config(workspace, tmp_path / "own", steps=1, save_every=0), echo=lambda s: None).lora_file)
    started, finished = float(meta["ss_training_started_at"]), float(meta["ss_training_finished_at"])
    assert before - 1 <= started <= finished <= time.time() + 1


def test_a_killed_runs_temporaries_are_removed_with_a_line_and_nothing_else_is(workspace, tmp_path):
    """Issue 40, item 7: the .tmp files of a checkpoint or LoRA write that was killed (SIGKILL: Python's cleanup never
    ran) survived every later run; the next run into the folder removes them, saying so, and only them."""
    out = tmp_path / "run"
    checkpoints = out / "checkpoints"
    debris = [checkpoints / ".step-00000005.tmp-0a1b2c3d", checkpoints / ".step-00000003.del-0a1b2c3d",
              out / ".pytorch_lora_weights.safetensors.0a1b2c3d.tmp", out / ".run_kohya.safetensors.0a1b2c3d.tmp"]
    kept = [out / "notes.tmp", out / ".pytorch_lora_weights.safetensors.bak", checkpoints / ".my-step.tmp-1",
            out / "data.safetensors"]
    debris[0].mkdir(parents=True)
    (debris[0] / "lora.safetensors").write_bytes(b"half a file")
    for path in debris[1:] + kept:
        path.write_bytes(b"x")
    lines = []
    train(_config(workspace, out, steps=1, save_every=0), echo=lines.append)
    removed = sorted(line[len("removed "):].split(", ")[0] for line in lines if line.startswith("removed "))
    assert removed == sorted(str(p) for p in debris), lines
    assert all(line.endswith("left by a run that was killed while writing it") for line in lines
               if line.startswith("removed "))
    assert not any(p.exists() for p in debris) and all(p.exists() for p in kept)


def test_the_kohya_file_is_refused_before_training_where_it_cannot_hold_the_lora(workspace, tmp_path):
    """Issue 64: every family with a kohya/ComfyUI layout writes it by default; asked for where the family has none
    or a targeted layer has no place in it, it is refused before training, and the default leaves it out, saying so
    for a layer (negative control: the same layers without the refused one keep it)."""
    from squareq.train.errors import TrainError
    from squareq.train.run_plan import save_formats

    asked = _config(workspace, tmp_path / "wan", save_format=["diffusers", "kohya"])
    default = _config(workspace, tmp_path / "x")
    blocks = ["blocks.0.attn1.to_q", "blocks.0.ffn.net.2"]
    for family in ("flux", "wan", "hunyuan-video", "qwen-image", "flux2", "ltx-video", "sd3", "chroma", "z-image"):
        assert save_formats(default, family) == ["diffusers", "kohya"]
    assert save_formats(asked, "wan", blocks) == ["diffusers", "kohya"]
    lines = []
    assert save_formats(default, "wan", [*blocks, "proj_out"], lines.append) == ["diffusers"]
    assert lines == ["no kohya/ComfyUI file: LoRA layer proj_out cannot be written in musubi-tuner's Wan layout, "
                     "which has only the blocks' modules; drop it from targets, or keep to the diffusers file, which "
                     "holds every layer"]
    with pytest.raises(TrainError, match=r"save_format = diffusers,kohya: LoRA layer proj_out cannot be written in "):
        save_formats(asked, "wan", [*blocks, "proj_out"])
    lines.clear()
    assert save_formats(default, "sd-unet", ["down_blocks.0.attentions.0.proj_in"], lines.append) == ["diffusers"]
    assert lines == []  # the default never had one there
    with pytest.raises(TrainError, match="is for a sd-unet model, for which SquareQ writes no kohya/ComfyUI layout"):
        save_formats(asked, "sd-unet")
    lycoris = _config(workspace, tmp_path / "k", lora_type="lokr")
    assert save_formats(lycoris, "z-image", ["layers.0.attention.to_q"]) == ["peft", "kohya"]
    with pytest.raises(TrainError, match="LoKr layer transformer_blocks.0.attn.to_q is part of the fused module"):
        save_formats(_config(workspace, tmp_path / "k", lora_type="lokr", save_format=["peft", "kohya"]),
                     "hunyuan-video", ["transformer_blocks.0.attn.to_q"])


def test_a_trigger_placeholder_without_a_trigger_word_is_refused_in_one_sentence(workspace, tmp_path):
    from squareq.train.data import DataError
    from squareq.train.prepare import prepare_data

    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (64, 64), (200, 10, 10)).save(data / "a.png")
    (data / "a.txt").write_text("a photo of [trigger]")
    with pytest.raises(DataError, match=r"1 captions use \[trigger\] .*a.png.* pass --trigger WORD"):
        prepare_data(_config(workspace, tmp_path / "out", data=str(data)), None, torch.device("cpu"), encode=False)
    prepared = prepare_data(_config(workspace, tmp_path / "out", data=str(data), trigger="sks"), None,
                            torch.device("cpu"), encode=False)
    assert prepared.captions == [["a photo of sks"]]


def test_several_resolutions_give_every_image_an_entry_at_each(workspace, tmp_path):
    from squareq.train.prepare import prepare_data

    one = prepare_data(_config(workspace, tmp_path / "a"), None, torch.device("cpu"), encode=False)
    two = prepare_data(_config(workspace, tmp_path / "b", resolution=[64, 128]), None, torch.device("cpu"),
                       encode=False)
    assert len(two.captions) == 2 * len(one.captions) == 8 and two.captions == one.captions * 2
    assert len(two.buckets) == 2 and max(two.buckets[1]) > max(two.buckets[0])
    from safetensors import safe_open

    result = train(_config(workspace, tmp_path / "c", resolution=[64, 128], steps=4, save_every=0, epochs=None),
                   echo=lambda s: None)
    assert result.steps == 4 and all(math.isfinite(x) for x in result.losses)
    with safe_open(str(result.lora_file), "pt") as f:
        meta = f.metadata()
    assert meta["ss_resolution"] == "(64, 64), (128, 128)" and meta["ss_num_train_images"] == "8"


def unbroken_and_resumed(ws, tmp_path, kill_after: int, **kw) -> tuple[dict, dict]:
    """The LoRA factors of an unbroken run and of one killed after step ``kill_after`` and resumed from its last
    checkpoint, with the same options."""
    straight = train(_config(ws, tmp_path / "straight", **kw), echo=lambda s: None)

    def kill(step):
        if step == kill_after:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(_config(ws, tmp_path / "killed", **kw), echo=lambda s: None, after_step=kill)
    resumed = train(_config(ws, tmp_path / "killed", resume="latest", **kw), echo=lambda s: None)
    assert straight.steps == resumed.steps
    return load_lora(straight.lora_file)[0], load_lora(resumed.lora_file)[0]


@pytest.mark.parametrize("optimizer, lr", [("prodigy", 1.0), ("adafactor", 3e-3)])
def test_prodigy_and_adafactor_train_and_resume_to_the_same_lora(workspace, tmp_path, optimizer, lr):
    """Each optimizer moves the LoRA, and its state (Prodigy's d estimate, Adafactor's factored moments) survives a
    checkpoint: a run killed after step 6 and resumed from step 4 ends bit for bit where an unbroken run does."""
    a, b = unbroken_and_resumed(workspace, tmp_path, 6, optimizer=optimizer, lr=lr, steps=8, save_every=4)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    moved = [n for n in a if n.endswith("lora_B.weight") and a[n].abs().max() > 0]  # B starts at zero
    assert moved, f"{optimizer} left every lora_B at zero"


def test_prodigy_without_prodigyopt_is_one_sentence(workspace, tmp_path, monkeypatch):
    import sys

    from squareq.train.errors import TrainError

    monkeypatch.setitem(sys.modules, "prodigyopt", None)  # as if not installed
    with pytest.raises(TrainError, match=r"optimizer = prodigy needs prodigyopt; install it \(pip install prodigyopt\)"):
        train(_config(workspace, tmp_path / "p", optimizer="prodigy", lr=1.0, steps=1), echo=lambda s: None)


def test_ema_is_the_final_lora_and_resumes_exactly(workspace, tmp_path):
    """ema_decay 0.5: the final LoRA is the moving average of the weights after each step (recomputed here from
    every step's checkpoint and the initial weights), not the last weights; a killed run continues the same average."""
    from safetensors import safe_open

    from squareq.train.checkpoint import checkpoint_dir

    kw = dict(steps=4, save_every=1, keep_last=10, ema_decay=0.5)
    result = train(_config(workspace, tmp_path / "ema", **kw), echo=lambda s: None)
    final, _ = load_lora(result.lora_file)
    model = runtime.load(workspace / "tiny.slab", "cpu", options=runtime.LoadOptions(stream=False))
    cfg = _config(workspace, tmp_path / "ema", **kw).with_family_defaults("flux")
    runtime.add_lora(model, rank=cfg.rank, alpha=cfg.lora_alpha, targets=cfg.targets, seed=cfg.seed)
    average = {n: p.detach().float().clone() for n, p in runtime.lora_state_dict(model).items()}
    last = None
    for step in range(1, 5):
        last, _ = load_lora(checkpoint_dir(tmp_path / "ema", step) / "lora.safetensors")
        for n in average:
            average[n].lerp_(last[n].float(), 0.5)
    assert final.keys() == average.keys()
    for n in final:
        torch.testing.assert_close(final[n].float(), average[n], rtol=1e-2, atol=1e-4)
    assert max(float((final[n].float() - last[n].float()).abs().max()) for n in final) > 1e-3  # not the last weights
    with safe_open(str(result.lora_file), "pt") as f:
        assert f.metadata()["ss_ema_decay"] == "0.5"
    a, b = unbroken_and_resumed(workspace, tmp_path / "resume", 3, steps=5, save_every=2, ema_decay=0.9)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_flux_shift_and_a_loss_weighting_train(workspace, tmp_path):
    result = train(_config(workspace, tmp_path / "w", steps=3, save_every=0, timestep_sampling="flux_shift",
                           loss_weighting="cosmap"), echo=lambda s: None)
    assert result.steps == 3 and all(math.isfinite(x) for x in result.losses)


def test_flow_options_are_refused_for_a_ddpm_model_before_encoding(tmp_path):
    from squareq.train.errors import TrainError

    model, adapter = load_builtin("tiny-sd15")
    write_rtn_slab(model, adapter.blocks(model), {}, tmp_path / "sd.slab",
               PlainOptions(default_spec=QuantSpec(bits=8), family=adapter.family, source="tiny-sd15"))
    cfg = load_config(None, {"slab": str(tmp_path / "sd.slab"), "data": str(tmp_path / "nodata"),
                             "output": str(tmp_path / "out"), "resolution": 64, "loss_weighting": "cosmap"})
    with pytest.raises(TrainError, match="for flow-matching models; this sd-unet model trains with the epsilon"):
        train(cfg, echo=lambda s: None)


@pytest.mark.parametrize("schedule, warmup, extra, expected", [
    ("constant", 0, {}, [1.0] * 6),
    ("constant", 4, {}, [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]),  # diffusers' warm-up starts at 0
    ("constant_with_warmup", 4, {}, [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]),
    ("cosine", 2, {}, [0.0, 0.5] + [0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]),  # half cosine after
    ("linear", 2, {}, [0.0, 0.5, 1.0, 0.75, 0.5, 0.25]),
    # two half cosines over the 4 steps after the warm-up: 1, 0.5, then again 1, 0.5
    ("cosine_with_restarts", 2, {"schedule_cycles": 2}, [0.0, 0.5, 1.0, 0.5, 1.0, 0.5]),
    # (1 - progress)² down to diffusers' end value 1e-7
    ("polynomial", 2, {"schedule_power": 2.0}, [0.0, 0.5] + [(1 - 1e-7) * (1 - k / 4) ** 2 + 1e-7 for k in range(4)]),
])
def test_learning_rate_schedules_are_diffusers(tmp_path, schedule, warmup, extra, expected):
    from squareq.train.optimizers import lr_scheduler

    cfg = load_config(None, {"slab": "s", "data": "d", "output": str(tmp_path), "schedule": schedule,
                             "warmup": warmup, "lr": 1.0, **extra})
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = lr_scheduler(cfg, opt, 6)
    got = []
    for _ in range(6):
        got.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert got == pytest.approx(expected)


def test_the_loss_curve_covers_every_step_of_a_resumed_run(workspace, tmp_path):
    """OUT/loss.png is drawn at each checkpoint from metrics.jsonl, so after a killed and resumed run it holds all
    the steps; with no step yet there is nothing to draw."""
    from PIL import Image

    from squareq.train.sinks import plot_losses

    assert plot_losses(tmp_path) is None
    unbroken_and_resumed(workspace, tmp_path, 6, steps=8, save_every=4)
    png = tmp_path / "killed" / "loss.png"
    with Image.open(png) as image:
        assert image.size == (720, 420)
    steps = [json.loads(line)["step"] for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))
    (tmp_path / "killed" / "loss.png").unlink()
    assert plot_losses(tmp_path / "killed") == png and png.stat().st_size > 0


def test_a_run_resumed_without_targets_keeps_its_checkpoints_layers(workspace, tmp_path):
    """A run started with the attention projections (the default before FLUX.1's changed) resumes with them when
    --targets is not given, instead of failing on a LoRA of other layers."""
    attention = ["to_q", "to_k", "to_v", "to_out.0"]
    train(_config(workspace, tmp_path / "r", steps=2, save_every=2, targets=attention), echo=lambda s: None)
    resumed = train(_config(workspace, tmp_path / "r", steps=4, save_every=2, resume="latest"), echo=lambda s: None)
    layers = {n.rsplit(".", 2)[0].rsplit(".", 1)[-1] for n in load_lora(resumed.lora_file)[0]}
    assert resumed.steps == 4 and layers <= {"to_q", "to_k", "to_v", "0"}


def test_shuffled_captions_are_cached_in_several_orders_and_each_epoch_trains_the_next(workspace, tmp_path):
    from squareq.train.cache import EmbeddingCache
    from squareq.train.feed import CacheFeed

    data = tmp_path / "data"
    data.mkdir()
    for name, color in (("a", (200, 10, 10)), ("b", (10, 200, 10))):
        Image.new("RGB", (64, 64), color).save(data / f"{name}.png")
        (data / f"{name}.txt").write_text(f"{name} tag, red, square, small, plain")
    seen: list[str] = []
    original = CacheFeed.batch

    def spy(self, indices, drops, epoch=0):
        seen.extend(self.caption(i, epoch) for i in indices)
        return original(self, indices, drops, epoch)

    def run(name, **kw):
        seen.clear()
        cfg = _config(workspace, tmp_path / name, data=str(data), cache_dir=str(tmp_path / f"cache-{name}"),
                      trigger="sks", steps=8, batch_size=1, save_every=0, **kw)
        CacheFeed.batch = spy
        try:
            train(cfg, echo=lambda s: None)
        finally:
            CacheFeed.batch = original
        return list(seen), len(list(EmbeddingCache(tmp_path / f"cache-{name}").path("text", "x").parent.iterdir()))

    plain, plain_entries = run("plain")
    assert set(plain) == {"sks, a tag, red, square, small, plain", "sks, b tag, red, square, small, plain"}
    assert plain_entries == 3  # two captions and the dropped one
    shuffled, entries = run("shuffled", shuffle_caption=True, keep_tokens=1, caption_orders=3)
    assert entries == 2 * 3 + 1
    assert len(set(shuffled)) == 6  # 8 steps over 2 images: each image met in 4 epochs, 3 orders each
    assert all(c.startswith(("sks, a tag, ", "sks, b tag, ")) for c in shuffled)
    assert {tuple(sorted(c.split(", "))) for c in shuffled} == {tuple(sorted(c.split(", "))) for c in plain}


def test_validation_loss_is_measured_on_held_out_images_at_step_0_checkpoints_and_the_end(workspace, tmp_path):
    """validation_split holds images out of every batch; their loss is measured at fixed times and noise at step 0,
    with each checkpoint and at the end, and a killed and resumed run writes the same measurements."""
    from squareq.train.data import hold_out, scan_dataset
    from squareq.train.prepare import prepare_data

    train_set, held = hold_out(scan_dataset(workspace / "data"), 0.25, seed=42)
    assert len(held) == 1 and held.items[0].path not in {it.path for it in train_set.items}
    kw = dict(validation_split=0.25, steps=10, save_every=4, cache_dir=str(tmp_path / "cache"))
    prepared = prepare_data(_config(workspace, tmp_path / "p", **kw), None, torch.device("cpu"), encode=False)
    # the batches draw from the dataset alone, which no longer holds the held-out image
    assert [it.path for it in prepared.dataset.items] == [it.path for it in train_set.items]
    assert len(prepared.validation) == 1 and held.items[0].caption in prepared.validation[0]
    result = train(_config(workspace, tmp_path / "straight", **kw), echo=lambda s: None)
    rows = [json.loads(line) for line in (tmp_path / "straight" / "validation.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 4, 8, 10] and all(r["images"] == 1 for r in rows)
    assert set(rows[0]["by_time"]) == {"0.1", "0.3", "0.5", "0.7", "0.9"}
    assert rows[-1]["val_loss"] != rows[0]["val_loss"]  # the LoRA moved it
    assert result.steps == 10

    def kill(step):
        if step == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(_config(workspace, tmp_path / "killed", **kw), echo=lambda s: None, after_step=kill)
    train(_config(workspace, tmp_path / "killed", resume="latest", **kw), echo=lambda s: None)
    again = [json.loads(line) for line in (tmp_path / "killed" / "validation.jsonl").read_text().splitlines()]
    assert again == rows


def test_validation_loss_depends_on_the_lora_alone(workspace, tmp_path):
    """Measured twice on the same weights it is the same number (fixed times and noise, whatever the training RNG
    did in between); a changed LoRA changes it (negative control)."""
    from squareq.models import ADAPTERS
    from squareq.train.cache import EmbeddingCache
    from squareq.train.feed import CacheFeed
    from squareq.train.prepare import prepare_data
    from squareq.train.validation import validation_loss

    cfg = _config(workspace, tmp_path / "out", validation_data=str(workspace / "data"),
                  cache_dir=str(tmp_path / "cache"))
    slab = runtime.load(workspace / "tiny.slab", "cpu", options=runtime.LoadOptions(stream=False))
    data = prepare_data(cfg, runtime.runtime_of(slab).manifest.model, torch.device("cpu"), echo=lambda s: None)
    assert len(data.validation) == 4 and len(data.keys[0]) == 8
    feed = CacheFeed(EmbeddingCache(tmp_path / "cache"), *data.keys[:2],
                     data.captions + [[c] for c in data.validation], data.dropped, torch.device("cpu"))
    runtime.add_lora(slab, rank=4, targets=["to_q", "to_k", "to_v"])
    held = list(range(4, 8))

    def measure():
        return validation_loss(slab, ADAPTERS["flux"].recipe, "flow", feed, held, 42, 1.0, torch.device("cpu"))

    first = measure()
    torch.randn(100)  # the global RNG moves on, as training moves it
    assert measure() == first
    with torch.no_grad():
        for name, p in runtime.lora_parameters(slab).items():
            if name.endswith("lora_B.weight"):
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(0))
    changed = measure()
    assert changed["val_loss"] != first["val_loss"]
    assert all(a != b for a, b in zip(changed["by_time"].values(), first["by_time"].values()))
    feed.close()


def test_a_validation_split_that_leaves_nothing_to_train_is_refused(workspace, tmp_path):
    from squareq.train.data import DataError, hold_out, scan_dataset

    with pytest.raises(DataError, match="holds out 4 of the 4 images.*lower validation_split"):
        hold_out(scan_dataset(workspace / "data"), 0.9, seed=0)
    a = hold_out(scan_dataset(workspace / "data"), 0.5, seed=0)[1]
    assert [it.path for it in a.items] == [it.path for it in hold_out(scan_dataset(workspace / "data"), 0.5, 0)[1].items]


def test_dora_with_dropout_trains_and_resumes_bit_for_bit_and_writes_the_diffusers_file(workspace, tmp_path):
    from safetensors import safe_open

    from squareq.train.errors import TrainError
    from squareq.train.run_plan import save_formats

    kw = dict(use_dora=True, lora_dropout=0.1, steps=8, save_every=4, cache_dir=str(tmp_path / "cache"))
    a, b = unbroken_and_resumed(workspace, tmp_path, 6, **kw)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    magnitudes = [n for n in a if n.endswith(".lora_magnitude_vector")]
    assert magnitudes and len(magnitudes) * 2 == sum(".lora_A." in n or ".lora_B." in n for n in a)
    files = sorted(p.name for p in (tmp_path / "straight").glob("*.safetensors"))
    assert files == ["pytorch_lora_weights.safetensors"]  # no kohya file: it has no DoRA layout
    with safe_open(str(tmp_path / "straight" / "pytorch_lora_weights.safetensors"), "pt") as f:
        header = f.metadata()
    assert json.loads(header["lora_adapter_metadata"])["transformer.use_dora"] is True
    assert header["ss_network_dropout"] == "0.1" and json.loads(header["ss_network_args"]) == {"use_dora": True}
    with pytest.raises(TrainError, match="kohya,?.*: the kohya/ComfyUI layout has no DoRA"):
        save_formats(_config(workspace, tmp_path / "k", use_dora=True, save_format=["diffusers", "kohya"]), "flux")


def test_an_rslora_run_writes_a_kohya_file_at_its_own_scale(workspace, tmp_path):
    """kohya and ComfyUI scale by alpha/rank, so the kohya file of an rsLoRA run carries alpha·sqrt(rank)."""
    from squareq.train.lora_reader import load_lora as read

    result = train(_config(workspace, tmp_path / "rs", use_rslora=True, rank=4, alpha=2.0, steps=3, save_every=0,
                           cache_dir=str(tmp_path / "cache")), echo=lambda s: None)
    diffusers, info = read(result.lora_file)
    kohya, kinfo = read(next((tmp_path / "rs").glob("*_kohya.safetensors")))
    assert info["alpha"] == pytest.approx(2.0 * 2.0) and kinfo["alpha"] == pytest.approx(4.0)
    for name, t in diffusers.items():
        torch.testing.assert_close(kohya[name], t, rtol=0, atol=0)


def test_variant_runs_check_peft_first_and_a_resume_keeps_the_checkpoints_variant(workspace, tmp_path, monkeypatch):
    import sys

    from squareq.runtime import PeftMissing
    from squareq.train.errors import TrainError

    kw = dict(use_rslora=True, steps=4, save_every=2, cache_dir=str(tmp_path / "cache"))
    train(_config(workspace, tmp_path / "rs", **kw), echo=lambda s: None)
    with pytest.raises(TrainError, match="was trained with use_rslora = true; resume with the same setting "
                                         "\\(--use-rslora on\\)"):
        train(_config(workspace, tmp_path / "rs", resume="latest", steps=6, save_every=2,
                      cache_dir=str(tmp_path / "cache")), echo=lambda s: None)
    monkeypatch.setitem(sys.modules, "peft", None)  # as if peft were not installed
    messages = []
    with pytest.raises(PeftMissing, match=re.escape(pip_command("peft"))):  # from a clone: pip install -e
        train(_config(workspace, tmp_path / "nopeft", use_dora=True, cache_dir=str(tmp_path / "cache")),
              echo=messages.append)
    assert not any("cache" in m for m in messages)  # refused before the cache is filled


def test_validation_out_of_memory_skips_the_measurement_and_keeps_training(workspace, tmp_path, monkeypatch):
    from squareq.train import loop

    calls = []

    def oom(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return {"val_loss": 1.0, "images": 1, "by_time": {}}

    monkeypatch.setattr(loop, "validation_loss", oom)
    lines = []
    result = train(_config(workspace, tmp_path / "v", validation_split=0.25, steps=6, save_every=2, validate_every=2,
                           cache_dir=str(tmp_path / "cache")), echo=lines.append)
    assert result.steps == 6 and len(calls) == 4  # steps 0, 2 (skipped), 4, 6
    assert any("validation pass ran out of GPU memory and was skipped" in line for line in lines)
    rows = [json.loads(line) for line in (tmp_path / "v" / "validation.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 4, 6]


def test_lora_dropout_with_several_processes_and_two_validation_sources_are_refused(workspace, tmp_path):
    from squareq.train.config import ConfigError
    from squareq.train.errors import TrainError
    from squareq.train.run_plan import _check_variant

    cfg = _config(workspace, tmp_path / "d", lora_dropout=0.1)
    _check_variant(cfg, tmp_path / "d", world=1)  # one process: fine
    with pytest.raises(TrainError, match="lora_dropout = 0.1 with 2 processes: a resumed run would draw other"):
        _check_variant(cfg, tmp_path / "d", world=2)
    with pytest.raises(ConfigError, match="validation_split .* and validation_data both choose validation images"):
        _config(workspace, tmp_path / "v", validation_split=0.2, validation_data=str(workspace / "data"))
    with pytest.raises(ConfigError, match="validation_split = 1.0 must be in \\[0, 1\\)"):
        _config(workspace, tmp_path / "v", validation_split=1.0)


def test_prefetch_and_host_auto_say_what_they_chose_and_train_the_same(workspace, tmp_path):
    """The defaults: the ring (prefetch = "auto") is measured on the second step of the run and sized then, and the
    blobs' host (host = "auto") is chosen from the memory available; the LoRA is the one a fixed ring on a pinned host
    trains, bit for bit. The fixed settings are the negative control that says nothing."""
    said_auto, said_fixed = [], []
    auto = train(_config(workspace, tmp_path / "auto", steps=3), echo=said_auto.append)
    fixed = train(_config(workspace, tmp_path / "fixed", steps=3, prefetch=2, host="pinned"), echo=said_fixed.append)
    (line,) = [s for s in said_auto if s.startswith("prefetch auto: ")]
    assert " slots, 0 blocks kept on the GPU; per step the streamed copies take " in line
    (line,) = [s for s in said_auto if s.startswith("host auto: ")]
    assert line.startswith("host auto: pinned: ")
    assert not any(s.startswith(("prefetch auto", "host auto")) for s in said_fixed)
    a, _ = load_lora(auto.lora_file)
    b, _ = load_lora(fixed.lora_file)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resident_blocks_keep_blocks_on_the_device_and_train_the_same(workspace, tmp_path):
    """resident_blocks = 2 keeps two blocks out of the ring after the second step (the run says so; that a kept block
    is no longer copied is tests/runtime/test_residency.py's) and trains the LoRA a fully streamed run does, bit for
    bit. A count below 0 or a word other than auto is refused."""
    said = []
    kept = train(_config(workspace, tmp_path / "kept", steps=4, prefetch=2, host="pinned", resident_blocks=2),
                 echo=said.append)
    streamed = train(_config(workspace, tmp_path / "streamed", steps=4, prefetch=2, host="pinned"), echo=lambda s: None)
    (line,) = [s for s in said if s.startswith("resident_blocks 2: ")]
    assert line.startswith("resident_blocks 2: 2 slots, 2 blocks kept on the GPU;"), line
    a, _ = load_lora(kept.lora_file)
    b, _ = load_lora(streamed.lora_file)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for bad, why in ((-1, "resident_blocks = -1 must be auto or a whole number of at least 0"),
                     ("all", "resident_blocks = 'all' must be auto or a whole number of at least 0")):
        with pytest.raises(ConfigError, match=why):
            _config(workspace, tmp_path / "bad", resident_blocks=bad)


def test_the_sample_decoder_of_a_pipeline_folder_holds_the_vae_and_no_text_encoders(tmp_path):
    from squareq.models import write_tiny_flux_pipeline
    from squareq.sources.encoders import EncoderError, open_decoder

    folder = write_tiny_flux_pipeline(tmp_path / "pipe")
    pipe = open_decoder(str(folder / "transformer"), "flux", torch.float32)
    assert pipe.vae is not None and pipe.transformer is None
    assert all(getattr(pipe, name) is None for name in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"))
    with pytest.raises(EncoderError, match="not a diffusers pipeline folder"):
        open_decoder(str(tmp_path), "flux", torch.float32)


def test_compile_on_trains_the_same_lora_and_says_what_compiling_took(workspace, tmp_path, monkeypatch):
    """--compile on (aot_eager on a CPU: the same graphs without inductor's C++ builds) trains the LoRA that eager
    training does, bit for bit, and the log says how long the first steps compiled. An unknown mode is refused."""
    from squareq.runtime import block_compile

    monkeypatch.setattr(block_compile, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    said: list[str] = []
    loras = {}
    for mode in ("off", "on"):
        out = tmp_path / mode
        train(_config(workspace, out, steps=3, save_every=0, compile=mode), echo=said.append)
        loras[mode] = load_lora(out / "pytorch_lora_weights.safetensors")[0]
    assert loras["on"].keys() == loras["off"].keys()
    assert all(torch.equal(loras["on"][k], loras["off"][k]) for k in loras["off"])
    assert any("torch.compile compiled the blocks' graphs" in line for line in said), said
    with pytest.raises(ConfigError, match="compile"):
        TrainConfig(slab="x", data="d", output="o", steps=1, compile="max-autotune")
    torch._dynamo.reset()


def test_flip_aug_caches_flipped_latents_and_trains_on_them_half_the_time(workspace, tmp_path):
    """flip_aug: each training image's left-right flipped latents are cached beside the original's, and a seeded half
    of the (item, epoch) draws use them, the same in every run; validation entries never flip. Negative control:
    without flip_aug no flipped entry is cached and none is used."""
    from diffusers.configuration_utils import FrozenDict

    from squareq.train.buckets import entry_buckets
    from squareq.train.data import load_image
    from squareq.sources.encoders import open_encoders
    from squareq.train.feed import CacheFeed
    from squareq.sources.encoder_source import slab_encoders
    from squareq.train.prepare import prepare_data

    from squareq.train.tiny_dataset import write_tiny_dataset

    # shapes off the centre (the workspace's solid colours look the same flipped)
    cfg = _config(workspace, tmp_path / "out", cache_dir=str(tmp_path / "cache"), flip_aug=True,
                  data=str(write_tiny_dataset(tmp_path / "data")))
    slab = runtime.load(workspace / "tiny.slab", "cpu", options=runtime.LoadOptions(stream=False))
    model = runtime.runtime_of(slab).manifest.model
    data = prepare_data(cfg, model, torch.device("cpu"), echo=lambda s: None)
    image_keys, text_keys, flipped_keys = data.keys
    assert len(flipped_keys) == len(data.dataset.training_items) and not set(flipped_keys) & set(image_keys)
    # each flipped entry is the flipped image through the VAE (a symmetric image's equals the original's)
    buckets = entry_buckets(data.dataset, data.buckets, cfg.no_upscale)
    differs = 0
    source = slab_encoders(model, cfg.model, cfg.revision, cfg.encoder_files)
    with open_encoders(source, torch.device("cpu"), model.family, FrozenDict(model.config)) as encoders:
        for i, item in enumerate(data.dataset.training_items):
            original = data.cache.load("latents", image_keys[i])["latents"]
            flipped = data.cache.load("latents", flipped_keys[i])["latents"]
            pixels = load_image(item.path, buckets[i])
            assert torch.allclose(encoders.encode_image(pixels.flip(-1)).float(), flipped.float(), atol=1e-5)
            differs += not torch.equal(flipped, original)
    assert differs > 0

    def choices(seed):
        feed = CacheFeed(data.cache, image_keys, text_keys, data.captions, data.dropped, torch.device("cpu"),
                         flipped_keys, seed)
        return [feed.flipped(i, epoch) for epoch in range(50) for i in range(len(flipped_keys))]

    drawn = choices(cfg.seed)
    assert drawn == choices(cfg.seed) and drawn != choices(cfg.seed + 1)  # seeded
    assert 0.4 < sum(drawn) / len(drawn) < 0.6  # half of the draws
    feed = CacheFeed(data.cache, image_keys, text_keys, data.captions, data.dropped, torch.device("cpu"),
                     flipped_keys, cfg.seed)
    i, epoch = next((i, e) for e in range(50) for i in range(len(flipped_keys)) if feed.flipped(i, e))
    latents, _ = feed.batch([i], [False], epoch)
    assert torch.equal(latents[0], data.cache.load("latents", flipped_keys[i])["latents"].float())
    assert not feed.flipped(len(flipped_keys), 0)  # past the training entries (validation): never
    # a whole run with it trains and its cache holds both
    result = train(cfg, echo=lambda s: None)
    assert result.steps == cfg.steps

    off = prepare_data(_config(workspace, tmp_path / "off", cache_dir=str(tmp_path / "cache-off"), data=cfg.data),
                       model, torch.device("cpu"), echo=lambda s: None)
    assert off.keys[2] == []
    plain = CacheFeed(off.cache, *off.keys[:2], off.captions, off.dropped, torch.device("cpu"), off.keys[2], 0)
    assert not any(plain.flipped(i, e) for e in range(20) for i in range(len(off.keys[0])))


class _FakeWandb:
    """What squareq calls of the wandb module, recorded."""

    def __init__(self) -> None:
        self.inits, self.logged, self.finished = [], [], []

    def init(self, **kwargs):
        self.inits.append(kwargs)
        fake = self

        class Run:
            def log(self, values, step):
                fake.logged.append((step, values))

            def finish(self, exit_code=None):
                fake.finished.append(exit_code)

        return Run()


def test_wandb_logging_follows_the_run_and_its_resume(workspace, tmp_path, monkeypatch):
    import sys

    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = tmp_path / "wb"
    train(_config(workspace, out, steps=2, save_every=2, log="wandb", wandb_project="dogs", title="sks"),
          echo=lambda s: None)
    first = fake.inits[0]
    assert (first["project"], first["name"], first["resume"], first["config"]["rank"]) == ("dogs", "sks", "allow", 4)
    assert first["id"] == (out / "wandb-run-id").read_text() and fake.finished == [0]
    losses = {step: v["train/loss"] for step, v in fake.logged if "train/loss" in v}
    assert sorted(losses) == [1, 2]
    train(_config(workspace, out, steps=4, save_every=2, log="wandb", resume="latest"), echo=lambda s: None)
    assert fake.inits[1]["id"] == first["id"]  # the same W&B run goes on
    assert sorted(step for step, v in fake.logged if "train/loss" in v) == [1, 2, 3, 4]
    killed = tmp_path / "killed"  # a run killed before its first checkpoint left its W&B id: a fresh start is new
    killed.mkdir()
    (killed / "wandb-run-id").write_text(first["id"])
    train(_config(workspace, killed, steps=1, save_every=0, log="wandb"), echo=lambda s: None)
    assert fake.inits[2]["id"] != first["id"]
    # a run that fails is finished as failed in W&B
    monkeypatch.setattr("squareq.train.step.Stepper.micro_batches", lambda self: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        train(_config(workspace, tmp_path / "failing", steps=1, save_every=0, log="wandb"), echo=lambda s: None)
    assert fake.finished[-1] == 1


def test_wandb_offline_writes_its_run_or_a_sentence_when_it_is_missing(workspace, tmp_path, monkeypatch):
    import sys

    from squareq.extras import MissingExtra

    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "offline"
    train(_config(workspace, out, steps=2, save_every=0, log="wandb"), echo=lambda s: None)
    run_id = (out / "wandb-run-id").read_text()
    files = list((out / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert files and files[0].stat().st_size > 0
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(MissingExtra, match=r"--log wandb needs wandb, which is not installed; .*\[wandb\]"):
        train(_config(workspace, tmp_path / "none", steps=2, log="wandb"), echo=lambda s: None)
    assert not (tmp_path / "none" / "cache").exists() and not (tmp_path / "none").exists()


def test_fp16_trains_with_a_scaled_loss_and_resumes_bit_for_bit(workspace, tmp_path, monkeypatch, caplog):
    """dtype = fp16 on the tiny model, the whole path: the run says it chose fp16, trains with finite losses, keeps
    the loss scale in its checkpoints (a killed run resumes bit for bit), and a scale too large for fp16 (2^40: the
    gradients overflow) is halved until they fit, the same steps taken again so no batch is lost, ending near the
    LoRA of the run that started at GradScaler's 2^16. The bf16 run is the negative control: no scale is kept."""
    from squareq.train import loss_scale
    from squareq.train.checkpoint import STATE_FILE, checkpoint_dir

    def kept(out, step):
        return json.loads((checkpoint_dir(out, step) / STATE_FILE).read_text())["extra"]

    said = []
    kw = dict(dtype="fp16", steps=4, save_every=2)
    result = train(_config(workspace, tmp_path / "fp16", **kw), echo=said.append)
    assert any(s.startswith("dtype fp16: fp16: asked for; the LoRA trains in fp32 with a scaled loss") for s in said)
    assert result.steps == 4 and all(math.isfinite(x) for x in result.losses)
    extra = kept(tmp_path / "fp16", 2)
    assert extra["loss_scale"] == loss_scale.INITIAL and extra["loss_scale_good_steps"] == 2
    bf16 = train(_config(workspace, tmp_path / "bf16", steps=2, save_every=2), echo=lambda s: None)
    assert "loss_scale" not in kept(tmp_path / "bf16", 2) and bf16.steps == 2

    a, b = unbroken_and_resumed(workspace, tmp_path, 3, **kw)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)

    monkeypatch.setattr(loss_scale, "INITIAL", 2.0 ** 40)
    monkeypatch.setattr(loss_scale, "RETRIES", 64)
    caplog.set_level("INFO", logger="squareq.train")
    big = train(_config(workspace, tmp_path / "big", **kw), echo=lambda s: None)
    halvings = [r.message for r in caplog.records if "fp16 gradients overflowed at loss scale" in r.message]
    assert halvings and "overflowed at loss scale 1.09951e+12; the step runs again at 5.49756e+11" in halvings[0]
    assert big.steps == 4 and big.losses == result.losses  # the same batches, none skipped
    started, _ = load_lora(result.lora_file)
    ended, _ = load_lora(big.lora_file)
    for n in started:
        torch.testing.assert_close(ended[n].float(), started[n].float(), rtol=1e-2, atol=1e-5)
    # one retry a step: a batch still overflowing is skipped with the scale halved once from its start, the skips
    # not counted as NaN steps (nan_patience 2 would have stopped the run), and the run reaches its steps
    monkeypatch.setattr(loss_scale, "RETRIES", 1)
    monkeypatch.setattr(loss_scale, "INITIAL", 2.0 ** 26)
    caplog.clear()
    skipping = train(_config(workspace, tmp_path / "skipping", nan_patience=2, **kw), echo=lambda s: None)
    gave_up = [r.message for r in caplog.records if "this batch is skipped" in r.message]
    assert skipping.steps == 4 and skipping.skipped_steps == len(gave_up) > 2
    assert "still overflowed at loss scale 3.35544e+07; this batch is skipped and the next starts at 3.35544e+07" \
        in gave_up[0]


def test_fp8_compute_with_fp16_is_refused(workspace, tmp_path):
    with pytest.raises(ConfigError, match="compute = 'fp8' with dtype = fp16: FP8 compute runs in bf16 runs only"):
        _config(workspace, tmp_path / "x", dtype="fp16", compute="fp8")
    with pytest.raises(ConfigError, match="dtype = 'fp32' is not one of bf16, fp16, auto"):
        _config(workspace, tmp_path / "x", dtype="fp32")


def test_squareq_sample_draws_in_fp16_close_to_bf16(workspace, tmp_path):
    """squareq sample --dtype fp16 (a GPU without bf16) draws the image the bf16 run draws, within 16-bit rounding;
    the same prompt with another seed is the negative control that differs by far more."""
    import numpy as np
    from click.testing import CliRunner

    from squareq.cli import main

    runner = CliRunner()
    base = ["sample", str(workspace / "tiny.slab"), "--prompt", "a red square", "--resolution", "64", "--steps", "2",
            "--max-sequence-length", "16"]
    images = {}
    for name, extra in (("bf16", []), ("fp16", ["--dtype", "fp16"]), ("other", ["--seed", "7"])):
        result = runner.invoke(main, base + extra + ["-o", str(tmp_path / name)])
        assert result.exit_code == 0, result.output
        images[name] = np.asarray(Image.open(tmp_path / name / "sample-000.png")).astype(int)
    close = np.abs(images["fp16"] - images["bf16"]).mean()
    far = np.abs(images["other"] - images["bf16"]).mean()
    assert close < 2.0 and far > 5 * max(close, 1.0), (close, far)


@pytest.mark.parametrize("kind", ["lokr", "loha"])
def test_lokr_and_loha_train_resume_bit_for_bit_and_load_back_in_peft(workspace, tmp_path, kind, monkeypatch):
    """lora_type lokr / loha: the adapter trains (LoKr's w1 and LoHa's w2_b start at zero and move), a run killed
    after step 4 and resumed from step 3 writes the same factors bit for bit, and the PEFT folder it writes loads
    with PeftModel.from_pretrained into the plain denoiser (the slab's weights as nn.Linear) to the outputs the
    runtime gives with those factors (both in fp32, so bf16's rounding, larger than the adapter's effect on the tiny
    model, stays out). Negative control: the plain denoiser without the adapter is far from them."""
    from peft import PeftModel
    from safetensors import safe_open
    from safetensors.torch import load_file

    from squareq.models import tiny_flux_inputs
    from squareq.runtime import LoraVariant
    from squareq.runtime import compute as compute_mode
    from squareq.train.lora_attach import attach_peft_adapter
    from squareq.train.sample import sample_images

    kw = dict(lora_type=kind, steps=6, save_every=3, lr=1e-2, title="run")
    straight = train(_config(workspace, tmp_path / "straight", **kw), echo=lambda s: None)

    def kill(step):
        if step == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(_config(workspace, tmp_path / "killed", **kw), echo=lambda s: None, after_step=kill)
    resumed = train(_config(workspace, tmp_path / "killed", resume="latest", **kw), echo=lambda s: None)
    assert straight.lora_file == tmp_path / "straight" / "run_peft"
    a = load_file(straight.lora_file / "adapter_model.safetensors")
    b = load_file(resumed.lora_file / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    zero_at_start = "lokr_w1" if kind == "lokr" else "hada_w2_b"
    assert all(a[k].abs().max() > 0 for k in a if k.endswith(zero_at_start))
    # issue 64: beside the folder, LyCORIS's file for ComfyUI (LoKr under LyCORIS's names for the diffusers model,
    # LoHa stacked on FLUX.1's fused modules)
    assert straight.kohya_file == tmp_path / "straight" / "run_kohya.safetensors"
    with safe_open(str(straight.kohya_file), "pt") as f:
        header, keys = f.metadata(), set(f.keys())
    assert header["ss_network_module"] == "lycoris.kohya" and json.loads(header["ss_network_args"])["algo"] == kind
    assert ("lycoris_transformer_blocks_0_attn_to_q.lokr_w1" if kind == "lokr"
            else "lora_unet_double_blocks_0_img_attn_qkv.hada_w1_a") in keys

    with pytest.raises(LoraFileError, match="is a PEFT adapter folder .* not a LoRA file: squareq sample --lora takes"):
        load_lora(straight.lora_file)  # export-lora says so too
    config = json.loads((straight.lora_file / "adapter_config.json").read_text())
    assert config["peft_type"] == kind.upper() and config["r"] == 4
    monkeypatch.setitem(compute_mode.DTYPES, "fp32", torch.float32)
    ours_model = runtime.load(workspace / "tiny.slab", "cpu", options=runtime.LoadOptions(stream=False, dtype="fp32"))
    plain = load_builtin("tiny-flux")[0].float()
    with torch.no_grad():  # the plain model holds the slab's effective weights
        for name, layer in ours_model.named_modules():
            if isinstance(layer, runtime.QuantLinear):
                plain.get_submodule(name).weight.copy_(layer.dequantized_weight().float())
    batch = tiny_flux_inputs(batch=1, dtype=torch.float32, seed=3)
    with torch.no_grad():
        base = plain(**batch, return_dict=False)[0]
    peft_model = PeftModel.from_pretrained(plain, str(straight.lora_file)).eval()
    runtime.add_lora(ours_model, rank=4, targets=config["target_modules"], variant=LoraVariant(kind=kind))
    with torch.no_grad():
        for name, p in runtime.lora_parameters(ours_model).items():
            p.copy_(a["base_model.model." + name].float())
        ours = ours_model(**batch, return_dict=False)[0]
        theirs = peft_model(**batch, return_dict=False)[0]
    effect = (ours - base).abs().mean()
    assert (ours - theirs).abs().mean() < 0.1 * effect, ((ours - theirs).abs().mean(), effect)
    # SquareQ takes the folder back too: attached to a fresh runtime model, and by squareq sample --lora
    fresh = runtime.load(workspace / "tiny.slab", "cpu", options=runtime.LoadOptions(stream=False, dtype="fp32"))
    attach_peft_adapter(fresh, straight.lora_file)
    with torch.no_grad():
        assert torch.equal(fresh(**batch, return_dict=False)[0], ours)
    draw = dict(resolution=64, steps=2, max_sequence_length=16, device="cpu")
    (with_adapter,) = sample_images(workspace / "tiny.slab", ["a cat"], lora=straight.lora_file, **draw)
    (without,) = sample_images(workspace / "tiny.slab", ["a cat"], **draw)
    assert with_adapter.size == (64, 64) and with_adapter.tobytes() != without.tobytes()


def test_lokr_and_loha_options_are_checked(workspace, tmp_path):
    for values, why in (
            (dict(lora_type="lycoris"), "lora_type = 'lycoris' is not one of lora, lokr, loha"),
            (dict(lora_type="lokr", use_dora=True),
             "lora_type = 'lokr' is a LyCORIS adapter, and use_dora is LoRA's only"),
            (dict(lora_type="loha", save_format=["diffusers"]), "save_format = \\['diffusers'\\] names diffusers"),
            (dict(save_format=["peft"]), "names peft, the folder LoKr and LoHa are written as"),
            (dict(lora_type="lokr", lokr_factor=0), "lokr_factor = 0 must be -1 \\(balanced\\)")):
        with pytest.raises(ConfigError, match=why):
            _config(workspace, tmp_path / "x", **values)
