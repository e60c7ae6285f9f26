"""A new user's first run, with the tiny FLUX.1 pipeline standing in for FLUX.1-dev: the README's quickstart commands
as written, from the Hub ID (the local Hugging Face cache, HF_HUB_OFFLINE=1) and from ComfyUI's four single files
(offline, with only what the README's `hf download --include` line fetches in the cache), and what they leave: the
same slab either way, a LoRA that diffusers and the kohya/ComfyUI layout accept."""
import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors import safe_open

from squareq.cli import main
from squareq.train.lora_reader import load_lora
from squareq.train.tiny_dataset import write_tiny_dataset

from .train.test_lora_files import KOHYA_KEY
from .user_files import COMMIT, STAND_IN_REPO, stand_in_pipeline, write_comfyui_files, write_hub_cache

pytestmark = pytest.mark.usefixtures("torch_kernels")

README = Path(__file__).resolve().parents[1] / "README.md"
# The stand-in is tiny: each command runs with these flags added after the README's own (the later flag wins).
FAST = {
    "compile": ["--calib-resolution", "64", "--calib-samples", "4", "--formats", "W4,W8", "--rounding", "nearest",
                "--effect-probes", "1"],
    "train": ["--steps", "4", "--resolution", "64", "--max-sequence-length", "32", "--save-every", "0"],
    "sample": ["--resolution", "64", "--steps", "2", "--max-sequence-length", "32"],
}


def quickstart() -> tuple[list[str], str]:
    """The README quickstart's shell lines (comments and blank lines dropped) and its Python block."""
    text = README.read_text()
    section = text[text.index("## Quickstart"):]
    section = section[:section.index("\n## ", 1)]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    lines = [line.split("  #")[0].strip() for lang, body in blocks if lang == "bash" for line in body.splitlines()]
    python = [body for lang, body in blocks if lang == "python"]
    assert len(python) == 1, "the quickstart has one Python block (loading the LoRA in diffusers)"
    return [line for line in lines if line], python[0]


def configs_only_cache(cache: Path, dest: Path, lines: list[str]) -> Path:
    """A copy of the Hub cache ``cache`` holding only the files the quickstart's `hf download REPO --include ...` line
    fetches: what the ComfyUI route reads from the Hub, offline."""
    downloads = [shlex.split(line) for line in lines if line.startswith("hf download ")]
    assert len(downloads) == 1 and downloads[0][2] == STAND_IN_REPO and "--include" in downloads[0], downloads
    patterns = downloads[0][downloads[0].index("--include") + 1:]
    shutil.copytree(cache, dest, symlinks=True)
    snapshot = next(dest.glob("models--*/snapshots/*"))
    dropped = [f for f in snapshot.rglob("*") if not f.is_dir()
               and not any(fnmatch.fnmatch(f.relative_to(snapshot).as_posix(), p) for p in patterns)]
    assert any(f.suffix == ".safetensors" for f in dropped), "the patterns must leave the weights out"
    for f in dropped:
        f.unlink()
    return dest


def run(args: list[str], cwd: Path, monkeypatch) -> str:
    monkeypatch.chdir(cwd)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, f"squareq {shlex.join(args)} in {cwd}:\n{result.output}"
    return result.output


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """The quickstart run twice, as its two compile commands allow: from the Hub ID in hub/, from ComfyUI's files in
    comfyui/; each then trains and samples on its own slab."""
    root = tmp_path_factory.mktemp("first-run")
    pipe = stand_in_pipeline()
    cache = root / "hf-cache"
    write_hub_cache(cache, pipe)
    models = root / "ComfyUI" / "models"  # ComfyUI's folders: diffusion_models, text_encoders, vae
    files = write_comfyui_files(pipe, root / "files")
    for key, sub in (("transformer", "diffusion_models"), ("clip_l", "text_encoders"), ("t5", "text_encoders"),
                     ("vae", "vae")):
        (models / sub).mkdir(parents=True, exist_ok=True)
        files[key].rename(models / sub / files[key].name)
    lines, python = quickstart()
    shell = [line for line in lines if not line.startswith(("python", "pip", "hf "))]
    variables = {name: str(models) for name in re.findall(r"^(\w+)=\S+$", "\n".join(shell), re.M)}
    commands = [shlex.split(line.replace("$M", variables["M"]).replace("${M}", variables["M"]))
                for line in shell if line.startswith("squareq ")]
    compiles = [c for c in commands if c[1] == "compile"]
    rest = [c for c in commands if c[1] != "compile"]
    assert len(compiles) == 2 and "/" in compiles[0][2] and "--clip-l" in compiles[1], compiles
    assert [c[1] for c in rest] == ["train", "sample"], rest
    runs = {"hub": root / "hub", "comfyui": root / "comfyui"}
    caches = {"hub": cache, "comfyui": configs_only_cache(cache, root / "hf-cache-configs", lines)}
    outputs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        for (name, cwd), compile_args in zip(runs.items(), compiles):
            mp.setenv("HF_HUB_CACHE", str(caches[name]))
            cwd.mkdir()
            write_tiny_dataset(cwd / "my_images")
            for args in (compile_args, *rest):
                outputs[name, args[1]] = run(args[1:] + FAST[args[1]], cwd, mp)
    return {"root": root, "runs": runs, "cache": cache, "commands": commands, "python": python, "outputs": outputs,
            "pipe": pipe}


def test_the_readme_quickstart_runs_as_written(first_run):
    for cwd in first_run["runs"].values():
        assert (cwd / "flux1-dev.slab" / "slab.safetensors").is_file()
        assert (cwd / "my_lora" / "pytorch_lora_weights.safetensors").is_file()
        assert (cwd / "my_lora" / "my_lora_kohya.safetensors").is_file()
        assert (cwd / "samples" / "sample-000.png").is_file()


def test_a_hub_id_compiles_trains_and_samples_from_the_cache_offline(first_run, monkeypatch):
    hub = first_run["runs"]["hub"]
    manifest = json.loads((hub / "flux1-dev.slab" / "manifest.json").read_text())
    assert manifest["model"]["source"] == f"{STAND_IN_REPO}@{COMMIT}"  # pinned: later commands read the same files
    assert "encoders" not in manifest["model"]  # the source's own pipeline: nothing more to record
    assert manifest["calibration"]["encoders"] == f"{STAND_IN_REPO}@{COMMIT}"
    # the encoders named again by Hub ID and revision, as a user would to override the slab's record
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(first_run["cache"]))
    out = run(["sample", "flux1-dev.slab", "--model", STAND_IN_REPO, "--revision", COMMIT, "--prompt", "a red square",
               "-o", "again", *FAST["sample"]], hub, monkeypatch)
    assert (hub / "again" / "sample-000.png").is_file(), out


def test_a_hub_id_missing_from_the_cache_offline_is_one_sentence(first_run, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(first_run["cache"]))
    monkeypatch.chdir(tmp_path)
    for args in (["compile", "squareq-test/not-cached", "--budget", "12GB", "-o", "x.slab"],
                 ["sample", str(first_run["runs"]["hub"] / "flux1-dev.slab"), "--model", "squareq-test/not-cached",
                  "--prompt", "a red square"]):
        result = CliRunner().invoke(main, args)
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert result.exit_code == 1 and len(lines) == 1, result.output
        assert lines[0].startswith("error: ") and "squareq-test/not-cached is not a local path, nor in the Hugging " \
            f"Face cache ({first_run['cache']}), and downloads are off (HF_HUB_OFFLINE=1)" in lines[0], lines[0]
    assert not (tmp_path / "x.slab").exists()


def test_comfyui_files_make_the_same_slab_and_train_and_sample(first_run):
    hub, comfy = (first_run["runs"][k] / "flux1-dev.slab" for k in ("hub", "comfyui"))
    assert (hub / "slab.safetensors").read_bytes() == (comfy / "slab.safetensors").read_bytes()
    ours, theirs = (json.loads((s / "manifest.json").read_text()) for s in (hub, comfy))
    assert ours["layers"] == theirs["layers"] and ours["blocks"] == theirs["blocks"]
    assert theirs["model"]["source"].endswith("flux1-dev.safetensors (BFL single file)")
    models = first_run["root"] / "ComfyUI" / "models"
    assert theirs["model"]["encoders"] == {  # what train and sample used, with no flags given
        "where": f"{STAND_IN_REPO}@{COMMIT}", "clip_l": str(models / "text_encoders" / "clip_l.safetensors"),
        "t5": str(models / "text_encoders" / "t5xxl_fp16.safetensors"), "vae": str(models / "vae" / "ae.safetensors")}
    assert "done: 4 steps" in first_run["outputs"]["comfyui", "train"]
    # the cache is keyed by the encoders' weights, not by where they were read from: the same entries either way
    entries = [sorted(p.relative_to(c).as_posix() for p in c.rglob("*.safetensors"))
               for c in (first_run["runs"][k] / "my_lora" / "cache" for k in ("hub", "comfyui"))]
    assert entries[0] and entries[0] == entries[1]


def test_the_lora_loads_in_diffusers_and_in_the_kohya_layout(first_run):
    lora = first_run["runs"]["hub"] / "my_lora"
    # the README's diffusers lines as written, on a CPU: the stand-in comes from the cache by its Hub ID
    lines = [line for line in first_run["python"].splitlines() if not line.startswith("image =")]
    code = "\n".join(lines).replace('.to("cuda")', '.to("cpu")') + (
        "\nimport json; print(json.dumps(sorted(pipe.transformer.peft_config)),"
        " sum('lora_B' in n and float(p.abs().sum()) > 0 for n, p in pipe.transformer.named_parameters()))")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(first_run["cache"]),
           "DIFFUSERS_VERBOSITY": "error", "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run([sys.executable, "-c", code], cwd=lora.parent, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    adapters, trained = done.stdout.strip().splitlines()[-1].rsplit(" ", 1)
    assert json.loads(adapters) == ["default_0"] and int(trained) > 0, done.stdout
    # ComfyUI's layout: kohya's names, every module with its down and up factors and its alpha, the same layers
    with safe_open(str(lora / "my_lora_kohya.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all(KOHYA_KEY.match(k) for k in keys), [k for k in keys if not KOHYA_KEY.match(k)][:3]
    modules = {k.split(".")[0] for k in keys}
    assert keys and all({f"{m}.lora_down.weight", f"{m}.lora_up.weight", f"{m}.alpha"} <= set(keys) for m in modules)
    kohya, info = load_lora(lora / "my_lora_kohya.safetensors")
    diffusers, _ = load_lora(lora)
    assert info["layout"] == "kohya" and kohya.keys() == diffusers.keys()
