"""Every benchmark script runs its tiny path (``--tiny``: tiny models and shapes, a few iterations, on the CPU) and
prints JSON lines that hold every field its markdown table shows, so a benchmark cannot rot between GPU runs.

Each run is ``python benchmarks/SCRIPT --tiny ...`` in a process of its own, forked from this one after it imported the
heavy libraries once (:data:`PRELOAD`): fifteen fresh interpreters would spend about a minute of a CPU on imports."""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import runpy
import subprocess
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def _load_common():
    """benchmarks/common.py under a name of its own: a benchmark run forked from this process must import its
    ``common`` itself, through its own sys.path set-up, or a broken one would pass here."""
    spec = importlib.util.spec_from_file_location("benchmarks_common_under_test", BENCHMARKS / "common.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


common = _load_common()

# script -> the arguments of its tiny run after --tiny ({work}: a fresh folder). Where a script's --tiny runs several
# setups, the arguments pick those that need no compiler of their own (torch.compile on a CPU takes minutes).
TINY_ARGS = {
    "attention_backends.py": [],
    "cards.py": ["--workdir", "{work}"],
    "compile.py": ["--workdir", "{work}"],
    "dequant.py": [],
    "effects.py": [],
    "fp8_linear.py": [],
    "ladder_formats.py": [],
    "matmul.py": [],
    "quality.py": [],
    "real_text_model.py": [],
    "sample.py": ["--workdir", "{work}", "--prefetch", "auto", "--steps", "2",
                  "--only", "slab,resident,squareq,group_offload,model_offload,sequential_offload"],
    "search_cost.py": [],
    "train_ddp.py": ["--workdir", "{work}", "--only", "setup,scale", "--gpus", "1", "--steps", "2", "--skip", "1"],
    "train_e2e.py": ["--workdir", "{work}"],
    "train_step.py": ["--workdir", "{work}", "--only", "slab,squareq,resident,bnb,group_offload", "--prefetch", "2",
                      "--steps", "2", "--warmup", "1"],
}
# The kernel benchmarks keep the Triton kernels (interpreted); the others run the bit-identical torch reference, as the
# runtime and trainer tests do (docs/development.md), since the interpreter makes a training step ~30x slower.
KERNEL_BENCHMARKS = {"dequant.py", "fp8_linear.py", "matmul.py"}
# What most benchmarks import first, about 4 s of a CPU each time: imported once here, and every tiny run starts as a
# process forked from this one. Only installed packages: the benchmarks' own modules are imported by each run.
PRELOAD = ("diffusers", "transformers", "peft", "squareq.compiler", "squareq.runtime", "squareq.train.loop")


def tiny_env(script: str, work: Path) -> dict[str, str]:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               TMPDIR=str(work))  # what a script puts in a temporary folder goes with the test's
    if script not in KERNEL_BENCHMARKS:
        env["SQUAREQ_KERNELS"] = "torch"
    return env


def run_tiny(script: str, work: Path) -> tuple[int, str, str]:
    """``python benchmarks/SCRIPT --tiny ARGS`` with :func:`tiny_env`: its exit status, stdout and stderr. Forked from
    this process where it can be (no CUDA here, which a fork could not use); else a new interpreter."""
    argv = [str(BENCHMARKS / script), "--tiny", *(a.replace("{work}", str(work)) for a in TINY_ARGS[script])]
    if not hasattr(os, "fork") or torch.cuda.is_available():
        done = subprocess.run([sys.executable, *argv], cwd=ROOT, env=tiny_env(script, work), capture_output=True,
                              text=True, timeout=600)
        return done.returncode, done.stdout, done.stderr
    out, err = work / "stdout.txt", work / "stderr.txt"
    pid = os.fork()
    if pid == 0:
        _run_forked(argv, tiny_env(script, work), out, err)  # never returns
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out.read_text(), err.read_text()


def _run_forked(argv: list[str], env: dict[str, str], out: Path, err: Path) -> None:
    """In the forked child: run ``argv`` as ``python`` would (``__main__``, the script's folder first on sys.path, its
    own environment and working directory, output to ``out`` and ``err``), then exit with its status."""
    code = 1
    try:
        os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
        os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
        sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)  # noqa: SIM115
        os.chdir(ROOT)
        os.environ.clear()
        os.environ.update(env)
        tempfile.tempdir = None  # read TMPDIR again
        warnings.resetwarnings()  # not the test session's filters
        sys.argv = argv
        sys.path.insert(0, str(Path(argv[0]).parent))
        runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


@pytest.fixture(scope="module")
def preloaded():
    for name in PRELOAD:
        importlib.import_module(name)


def test_every_script_has_a_tiny_run():
    scripts = {p.name for p in BENCHMARKS.glob("*.py")} - {"common.py"}
    assert scripts == set(TINY_ARGS)


@pytest.mark.parametrize("script", sorted(TINY_ARGS))
def test_tiny_path(script, tmp_path, preloaded):
    code, stdout, stderr = run_tiny(script, tmp_path)
    assert code == 0, stderr[-3000:]
    records = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert records, stdout[-2000:]
    tables = common.declared_tables(stderr)
    assert tables, "the script printed no table through common.table"
    problems = [p for t in tables for p in common.missing_fields(records, t)]
    assert not problems, problems


def test_the_check_sees_a_missing_field():
    """The negative control: a row without a field its table shows fails the check, as do an error row and a table
    without rows; a skipped row passes."""
    declared = {"where": {"what": "run"}, "fields": ["step_s", "peak_GB"]}
    whole = {"what": "run", "step_s": 0.1, "peak_GB": 1.0}
    assert common.missing_fields([whole, {"what": "env"}], declared) == []
    assert common.missing_fields([{"what": "run", "skipped": "no CUDA device"}, whole], declared) == []
    lacking = common.missing_fields([whole, {"what": "run", "step_s": 0.2}], declared)
    assert len(lacking) == 1 and "peak_GB" in lacking[0]
    assert common.missing_fields([{**whole, "error": "boom"}], declared)
    assert common.missing_fields([{"what": "env"}], declared)


def test_a_table_declares_what_it_prints(capsys):
    """common.table names on stderr the rows it printed and every field its cells read, ``also`` included."""
    columns = [common.Column("setup", "what"), common.Column("step s", "step_s", ".3f"),
               common.Column("ratio", "step_s", lambda r: r["step_s"] / r["base_s"], also=("base_s",)),
               common.Column("notes", None, lambda r: r.get("note", ""))]
    text = common.table([{"what": "run", "step_s": 0.5, "base_s": 0.25}, {"what": "env"}], columns,
                        where={"what": "run"})
    assert text.splitlines()[2] == "| run | 0.500 | 2.0 |  |" and len(text.splitlines()) == 3
    assert common.declared_tables(capsys.readouterr().err) == [
        {"where": {"what": "run"}, "fields": ["what", "step_s", "base_s"]}]
