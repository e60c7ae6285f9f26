"""Every shell and Python snippet in README.md and docs/*.md runs as written (issue 60), with the tiny FLUX.1
pipeline standing in for FLUX.1-dev as in tests/test_first_run.py.

A fenced block is a snippet when its tag is bash/sh/shell/console or python/py, or, untagged, when its first line is
a command (not a usage synopsis with ``[--OPTION]``). Each shell command line runs in a fresh folder prepared as the
quickstart's: ``my_images`` (the tiny dataset), FLUX.1-dev's Hub ID in a Hugging Face cache read offline,
ComfyUI's four files under ``~/ComfyUI/models``, and a copy of the session's one slab or LoRA wherever the command
reads one. ``squareq`` runs in this process with the speed flags of FAST added after the doc's own (the later flag
wins); an identical command runs once. Python snippets run with ``exec`` in a fresh namespace in such a folder, a
GPU device string mapped to the CPU. Commands this test cannot or should not run are in EXEMPT, each with its
reason; the table may name only commands the docs still hold.
"""
import functools
import importlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from squareq.cli import main
from squareq.train.tiny_dataset import write_tiny_dataset

from .test_first_run import FAST as FIRST_RUN_FAST
from .user_files import STAND_IN_REPO, stand_in_pipeline, write_comfyui_files, write_hub_cache

pytestmark = pytest.mark.usefixtures("torch_kernels")

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # top level: docs/benchmarks/ is a notebook
SHELL_TAGS = {"bash", "sh", "shell", "console"}
PYTHON_TAGS = {"python", "py"}
FENCE = re.compile(r"^( *)```([\w+-]*)[^\n]*\n(.*?)^\1```", re.S | re.M)
COMMAND = re.compile(r"(squareq|python3?|make|pip|hf|git|export|cd|torchrun)( |$)|[A-Z_][A-Z0-9_]*=")
SYNOPSIS = re.compile(r"\s\[-")  # `squareq accept SLAB [--thresholds FILE]`: a usage line, not a command
# accept: the demo's gate settings on the tiny model (40 steps at lr 5e-3 learn enough for the convergence gate)
FAST = {**FIRST_RUN_FAST,
        "accept": ["--lr", "5e-3", "--images", "2", "--sample-steps", "8", "--resolution", "64",
                   "--max-sequence-length", "32"],
        "cache": ["--resolution", "64", "--max-sequence-length", "32"]}
# A command line starting with one of these is not run here; each with the reason.
EXEMPT = {
    "python -m venv": "makes the virtual environment the tests already run in",
    "pip install": "downloads packages: the tests run in the environment it made",
    "python3 -m pip install": "the GPU machine's set-up and its GPU tests (-m gpu), which need a CUDA device",
    "hf auth login": "needs a Hugging Face account and the network",
    "hf download": "downloads from the Hub: here the stand-in is in a Hugging Face cache, read offline",
    "make demo": "tests/test_cli.py runs `squareq demo`, and `make` would build a second virtual environment",
    "make test": "the test suite itself",
    "squareq ui": "serves the page until stopped; tests/ui/test_browser.py serves it and drives it in a browser",
    "python benchmarks/": "a GPU measurement of the real model; each script's --tiny path runs in test_benchmarks.py",
    "PYTHONPATH=. python benchmarks/": "the real text model's full run (minutes); its --tiny path runs in "
                                       "test_benchmarks.py",
}
# Python's speed settings, as FAST's for the CLI: CompileOptions made by a snippet take these unless it gives them,
# calibration images are encoded at 64 px and a diffusers FLUX pipeline draws 64 px images unless given a size.
FAST_COMPILE = {"formats": ("W4", "W8"), "rounding": "nearest", "learned_rounding": False, "effect_probes": 1,
                "calib_samples": 4}
FAST_PIPELINE_SIDE = 64
# Python snippets not run, by (doc, first line): each with the reason.
EXEMPT_PYTHON: dict[tuple[str, str], str] = {}
STAND_IN_FILES = ("flux1-dev.safetensors", "clip_l.safetensors", "t5xxl_fp16.safetensors",
                  "t5xxl_fp8_e4m3fn.safetensors", "ae.safetensors")
COMFYUI = {"flux1-dev.safetensors": "diffusion_models", "ae.safetensors": "vae"}  # the rest: text_encoders
# another spelling of FLUX.1-dev (a folder named after it): the snapshot's folder; the Hub ID is in the cache as it is
FLUX_PATH = re.compile(r"(?<![\w.~/:-])[\w.~/-]*FLUX\.1-dev\b")
CUDA = re.compile(r"([\"'])cuda(:\d+)?\1")  # a device string: the same code on the CPU


@dataclass(frozen=True)
class Block:
    doc: str
    index: int
    lang: str
    body: str

    @property
    def first(self) -> str:
        return next((line.strip() for line in self.body.splitlines() if line.strip()), "")

    @property
    def command(self) -> str:
        return (command_lines(self) or [""])[0]

    @property
    def kind(self) -> str | None:
        if self.lang in SHELL_TAGS:
            return "shell"
        if self.lang in PYTHON_TAGS:
            return "python"
        if self.lang == "toml" and re.search(r"^\[thresholds\]|^(slab|data|steps) *=", self.body, re.M):
            return "toml"
        if not self.lang and COMMAND.match(self.command) and not SYNOPSIS.search(self.body):
            return "shell"
        return None


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a markdown file, each dedented as far as its fence is indented."""
    found = []
    for i, m in enumerate(FENCE.finditer(path.read_text())):
        body = "\n".join(line[len(m[1]):] for line in m[3].splitlines())
        found.append(Block(path.relative_to(ROOT).as_posix(), i, m[2].lower(), body))
    return found


def snippets() -> list[Block]:
    return [b for path in DOC_FILES for b in blocks(path) if b.kind]


def command_lines(block: Block) -> list[str]:
    """A shell block's command lines: continuations joined, console prompts kept and output dropped, comments and
    blank lines dropped."""
    text = block.body.replace("\\\n", " ")
    lines = text.splitlines()
    if block.lang == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    lines = [re.sub(r"\s+#.*", "", line).strip() for line in lines]
    return [line for line in lines if line and not line.startswith("#")]


def exemption(line: str) -> str | None:
    """The EXEMPT key ``line`` starts with: a whole word, or a folder's scripts (a key ending in ``/``)."""
    return next((key for key in EXEMPT if line == key or line.startswith(key + " ")
                 or (key.endswith("/") and line.startswith(key))), None)


class Session:
    """The session's files: the Hub cache, ComfyUI's files, the dataset, one slab and one LoRA, and the outputs of
    the commands already run (by their arguments and environment)."""

    def __init__(self, root: Path):
        self.root = root
        self.count = 0
        self.ran: dict[tuple, tuple[str, Path]] = {}
        self.gate: Path | None = None
        pipe = stand_in_pipeline()
        self.cache = root / "hf-cache"
        self.snapshot = write_hub_cache(self.cache, pipe)
        self.home = root / "home"
        models = self.home / "ComfyUI" / "models"
        files = write_comfyui_files(pipe, root / "files")
        files["t5_fp8"] = write_comfyui_files(pipe, root / "fp8", t5_dtype=torch.float8_e4m3fn)["t5"]
        for path in files.values():
            (models / COMFYUI.get(path.name, "text_encoders")).mkdir(parents=True, exist_ok=True)
            path.rename(models / COMFYUI.get(path.name, "text_encoders") / path.name)
        self.comfyui = models
        self.images = write_tiny_dataset(root / "my_images")
        self.env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(self.cache), "HOME": str(self.home)}
        # the quickstart's compile and train when the README has them (then they run once), else the same plainly
        lines = [line for b in SNIPPETS if b.doc == "README.md" and b.kind == "shell" for line in command_lines(b)]
        for what, start, default in (
                ("slab", f"squareq compile {STAND_IN_REPO} ", f"squareq compile {STAND_IN_REPO} --budget 8GB -o "
                                                               "flux1-dev.slab"),
                ("lora", "squareq train flux1-dev.slab ", "squareq train flux1-dev.slab --data my_images -o my_lora")):
            args = shlex.split(next((line for line in lines if line.startswith(start) and " -o " in line), default))
            _, cwd = self.squareq(args[1:], {})
            setattr(self, what, cwd / args[args.index("-o") + 1])

    def folder(self) -> Path:
        """A fresh working folder with the tiny dataset in ``my_images``."""
        self.count += 1
        cwd = self.root / f"run-{self.count}"
        cwd.mkdir()
        shutil.copytree(self.images, cwd / "my_images")
        return cwd

    def gate_slab(self) -> Path:
        """A slab of the default formats and rounding, made once when a doc runs `squareq accept`: FAST's coarse
        compile fails its block drift gate."""
        if self.gate is None:
            _, cwd = self.squareq(["compile", STAND_IN_REPO, "--budget", "8GB", "--calib-resolution", "64",
                                   "--calib-samples", "8", "-o", "gate.slab"], {}, fast=False)
            self.gate = cwd / "gate.slab"
        return self.gate

    def provide(self, cwd: Path, name: str, what: str) -> None:
        """Put the session's slab, gate slab or LoRA (``what``) at ``name`` in ``cwd``, unless something is there: a
        LoRA named as a file is the file of that name in the LoRA folder (else its diffusers file)."""
        target = cwd / name.rstrip("/")
        if name.startswith("/") or target.exists():
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        if what == "lora" and target.suffix == ".safetensors":
            files = {p.name: p for p in self.lora.glob("*.safetensors")}
            shutil.copy2(files.get(target.name, self.lora / "pytorch_lora_weights.safetensors"), target)
        else:
            shutil.copytree(self.gate_slab() if what == "gate" else getattr(self, what), target)

    def prepare(self, cwd: Path, args: list[str]) -> None:
        """The inputs a squareq command names: slabs, LoRAs, a config's slab, the stand-in's single files, a path
        of this repository (examples/...)."""
        outputs = {args[i + 1] for i, a in enumerate(args[:-1]) if a in ("-o", "--out", "--output")}
        for i, arg in enumerate(args[1:], 1):
            value = arg.split("=", 1)[1] if arg.startswith("--") and "=" in arg else arg
            if value in outputs or value.startswith("-"):
                continue
            if value.rstrip("/").endswith(".slab"):
                self.provide(cwd, value, "gate" if args[0] == "accept" else "slab")
            elif args[i - 1] == "--lora" or (args[0] == "export-lora" and i == 1):
                self.provide(cwd, value, "lora")
            elif Path(value).name in STAND_IN_FILES and not (cwd / value).exists():
                source = next(self.comfyui.rglob(Path(value).name))
                (cwd / value).parent.mkdir(parents=True, exist_ok=True)
                (cwd / value).symlink_to(source)
            elif not value.startswith("/") and (ROOT / value).exists() and not (cwd / value).exists():
                (cwd / value).parent.mkdir(parents=True, exist_ok=True)
                (cwd / value).symlink_to(ROOT / value)
            if args[i - 1] == "--config" and value.endswith(".toml") and (cwd / value).is_file():
                slab = tomllib.loads((cwd / value).read_text()).get("slab")
                if isinstance(slab, str):
                    self.provide(cwd, slab, "slab")

    def squareq(self, args: list[str], env: dict, fast: bool = True) -> tuple[str, Path]:
        """``squareq ARGS`` (with FAST's flags) in a fresh prepared folder, once per arguments and environment:
        its output and folder. AssertionError when it fails."""
        args = args + FAST.get(args[0], []) if args and fast else args
        key = (tuple(args), tuple(sorted(env.items())))
        if key not in self.ran:
            cwd = self.folder()
            self.prepare(cwd, args)
            with pytest.MonkeyPatch.context() as mp:
                mp.chdir(cwd)
                for name, value in {**self.env, **env}.items():
                    mp.setenv(name, value)
                result = CliRunner().invoke(main, args)
            assert result.exit_code == 0, f"squareq {shlex.join(args)} in {cwd}:\n{result.output[-3000:]}" + (
                f"\n{result.exception!r}" if result.exception and not isinstance(result.exception, SystemExit)
                else "")
            self.ran[key] = (result.output, cwd)
        return self.ran[key]


def stand_in(text: str, session: Session) -> str:
    """``text`` with any FLUX.1-dev folder made the stand-in's snapshot folder."""
    return FLUX_PATH.sub(lambda m: m[0] if m[0] == STAND_IN_REPO else str(session.snapshot), text)


def expand(word: str, variables: dict, session: Session) -> str:
    """A shell word with a leading ``~`` (of the word or of an assignment's value) and its variables expanded, as
    bash does, and FLUX.1-dev made the stand-in."""
    word = re.sub(r"^(\w+=)?~(?=/|$)", lambda m: (m[1] or "") + str(session.home), word)
    word = re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m[1], m[0]), word)
    return stand_in(word, session)


def run_shell(block: Block, session: Session) -> list[str]:
    """Run a shell block's command lines; the outputs of the squareq commands. AssertionError when one fails."""
    variables = {"HOME": str(session.home)}
    exported: dict[str, str] = {}
    outputs = []
    for line in command_lines(block):
        if exemption(line):
            continue
        words = [expand(w, variables, session) for w in shlex.split(line, comments=True)]
        if "&&" in words or ";" in words or "|" in words:
            outputs.append(run_subprocess(words, session, exported))
            continue
        env = {}
        while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
            name, value = words.pop(0).split("=", 1)
            env[name] = value
        if words[:1] == ["export"]:
            for assignment in words[1:]:
                name, value = assignment.split("=", 1)
                exported[name] = variables[name] = value
            continue
        if not words or words[0] == "cd":  # each command runs in a fresh folder: the docs' `cd squareq` is the clone
            variables.update(env)
            continue
        if words[0] == "squareq":
            outputs.append(session.squareq(words[1:], {**exported, **env})[0])
        else:
            outputs.append(run_subprocess(words, session, {**exported, **env}))
    return outputs


def run_subprocess(words: list[str], session: Session, env: dict) -> str:
    """A command other than squareq, through bash in a fresh prepared folder, this environment's bin/ first."""
    cwd = session.folder()
    session.prepare(cwd, words)
    line = " ".join(w if w in ("&&", ";", "|", "||") else shlex.quote(w) for w in words)
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    done = subprocess.run(["bash", "-c", line], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **session.env, "PATH": path, "PYTHONPATH": str(ROOT), **env})
    assert done.returncode == 0, f"{line} in {cwd}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    return done.stdout


def run_python(block: Block, session: Session) -> dict:
    """``exec`` a Python block in a fresh namespace and a fresh prepared folder; its namespace."""
    code = CUDA.sub(r"\1cpu\1", stand_in(block.body, session))
    cwd = session.folder()
    outputs = set(re.findall(r"compile_slab\([^,]+,\s*[\"']([^\"']+)[\"']", code))
    for name in re.findall(r"[\"']([^\"']+\.slab)/?[\"']", code):
        if name not in outputs:
            session.provide(cwd, name, "slab")
    for name in re.findall(r"load_lora\w*\(\s*[\"']([^\"']+)[\"']", code):
        session.provide(cwd, name, "lora")
    from huggingface_hub import constants

    namespace = {"__name__": "__snippet__"}
    with pytest.MonkeyPatch.context() as mp:
        fast_defaults(mp)
        mp.chdir(cwd)
        for name, value in session.env.items():
            if name != "HOME":
                mp.setenv(name, value)
        mp.setattr(constants, "HF_HUB_OFFLINE", True)  # read when huggingface_hub was imported
        mp.setattr(constants, "HF_HUB_CACHE", str(session.cache))
        exec(compile(code, f"{block.doc} block {block.index}", "exec"), namespace)
    return namespace


def fast_defaults(mp: pytest.MonkeyPatch) -> None:
    """FAST_COMPILE and FAST_PIPELINE_SIDE as the defaults a snippet's CompileOptions, calibration images and
    FluxPipeline see."""
    import diffusers

    import squareq.compiler

    images = importlib.import_module("squareq.compiler.calibration_images")

    class CompileOptions(squareq.compiler.CompileOptions):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**FAST_COMPILE, **kwargs})

    mp.setattr(squareq.compiler, "CompileOptions", CompileOptions)
    mp.setattr(images, "calibration_images", functools.partial(images.calibration_images,
                                                               resolution=FAST_PIPELINE_SIDE))
    init = diffusers.FluxPipeline.__init__

    @functools.wraps(init)  # diffusers reads the components from its signature
    def small_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.default_sample_size = FAST_PIPELINE_SIDE // self.vae_scale_factor

    mp.setattr(diffusers.FluxPipeline, "__init__", small_init)


def check_config(block: Block, session: Session) -> None:
    """A TOML block that is a thresholds file or a training config loads through squareq's own reader."""
    from squareq.compiler.thresholds import Thresholds
    from squareq.train.config import load_config

    path = session.folder() / "snippet.toml"
    path.write_text(block.body)
    if "[thresholds]" in block.body:
        Thresholds.from_toml(path)
    else:
        load_config(path)


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    return Session(tmp_path_factory.mktemp("snippets"))


SNIPPETS = snippets()


@pytest.mark.parametrize("block", SNIPPETS, ids=[f"{b.doc}:{b.index}:{b.first[:40]}" for b in SNIPPETS])
def test_the_snippet_runs_as_written(block, session):
    if block.kind == "toml":
        check_config(block, session)
    elif block.kind == "python":
        reason = EXEMPT_PYTHON.get((block.doc, block.first))
        if reason:
            pytest.skip(reason)
        run_python(block, session)
    else:
        run_shell(block, session)


def test_every_exemption_names_a_command_the_docs_still_hold():
    lines = [line for b in SNIPPETS if b.kind == "shell" for line in command_lines(b)]
    stale = [key for key in EXEMPT if not any(exemption(line) == key for line in lines)]
    assert not stale, f"EXEMPT names commands that no doc holds any more: {stale}; delete them"
    firsts = {(b.doc, b.first) for b in SNIPPETS if b.kind == "python"}
    stale = [key for key in EXEMPT_PYTHON if key not in firsts]
    assert not stale, f"EXEMPT_PYTHON names snippets that no doc holds any more: {stale}; delete them"
    assert exemption("pip install -e '.[all]'") == "pip install" and exemption("pipx run squareq") is None


def test_the_runner_fails_a_misspelt_flag_and_a_name_error(session):
    good = "squareq sample flux1-dev.slab --lora my_lora --prompt 'a red square' -o red"
    run_shell(Block("README.md", 0, "bash", good), session)
    assert (session.root / f"run-{session.count}" / "red" / "sample-000.png").is_file()
    for bad in (good.replace("--prompt", "--promt"), good.replace("sample", "smaple", 1)):
        with pytest.raises(AssertionError, match="squareq (sample|smaple)"):
            run_shell(Block("README.md", 0, "bash", bad), session)
    check_config(Block("docs/compiler.md", 0, "toml", "[thresholds]\nout = 0.02\n"), session)
    with pytest.raises(ValueError, match="unknown threshold keys"):
        check_config(Block("docs/compiler.md", 0, "toml", "[thresholds]\nouts = 0.02\n"), session)
    assert run_python(Block("README.md", 0, "python", "x = 6 * 7\n"), session)["x"] == 42
    with pytest.raises(NameError):
        run_python(Block("README.md", 0, "python", "x = 6 * 7\nprint(y)\n"), session)


def test_blocks_are_classified_by_tag_and_first_line():
    kinds = {body: Block("x.md", 0, lang, body).kind for lang, body in (
        ("", "squareq compile black-forest-labs/FLUX.1-dev -o x.slab\n"), ("", "make demo  # the demo\n"),
        ("", "SQUAREQ_KERNELS=torch squareq train x.slab\n"), ("", "squareq accept SLAB [--steps N]\n"),
        ("", "Usage: squareq [OPTIONS]\n"), ("toml", "[other]\n"), ("py", "import torch\n"),
        ("console", "$ squareq inspect x.slab\n"), ("toml", "[thresholds]\nout = 0.01\n"), ("toml", "slab = 'x'\n"),
        ("", "# the step\npython benchmarks/x.py\n"), ("", "# W = q * s\nW_eff = bf16(q)\n"))}
    assert list(kinds.values()) == ["shell", "shell", "shell", None, None, None, "python", "shell", "toml", "toml",
                                    "shell", None]
    session = SimpleNamespace(snapshot=Path("/cache/snapshot"), home=Path("/home/u"))
    url = "https://huggingface.co/black-forest-labs/FLUX.1-dev"
    assert stand_in(f'open_source("path/to/FLUX.1-dev") # {url}', session) == f'open_source("/cache/snapshot") # {url}'
    assert expand("M=~/ComfyUI", {}, session) == "M=/home/u/ComfyUI" and expand("a~/x", {}, session) == "a~/x"
    assert expand("${M}/ae.safetensors", {"M": "/home/u/ComfyUI"}, session) == "/home/u/ComfyUI/ae.safetensors"
    assert CUDA.sub(r"\1cpu\1", """x.to("cuda"); y.to('cuda:1'); z = "cudagraphs\"""") == \
        """x.to("cpu"); y.to('cpu'); z = "cudagraphs\""""
    lines = command_lines(Block("x.md", 0, "console", "$ squareq inspect x.slab \\\n  --json  # as JSON\nmodel: x\n"))
    assert [line.split() for line in lines] == [["squareq", "inspect", "x.slab", "--json"]]
