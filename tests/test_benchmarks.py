"""Every benchmark script runs its tiny path (``--tiny``: tiny models and shapes, a few iterations, on the CPU) and
keeps JSON lines that hold every field its markdown table shows, each measured or listed as not measured, so a
benchmark cannot rot between GPU runs.

Each run is ``python benchmarks/SCRIPT --tiny ...`` in a process of its own, forked from this one after it imported the
heavy libraries once (:data:`PRELOAD`): fifteen fresh interpreters would spend about a minute of a CPU on imports. It
forks only where a fork is safe (:func:`fork_refusal`), and either way a run has :data:`TIMEOUT_S` seconds."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
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

# script -> the arguments of its tiny run after --tiny ({work}: a fresh folder; every run also gets --out {work}/out).
# Where a script's --tiny runs several setups, the arguments pick those that need no compiler of their own
# (torch.compile on a CPU takes minutes).
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
# Further tiny runs, a test each: name -> (script, its arguments as in TINY_ARGS, what each of its measurements must
# hold beyond its tables' fields). train_step.py's video family: Wan's clips (--frames, --size: 2 latent frames of
# 4x6 latents, 2x2 patches), its attention and FFN targets, a rank of its own, activation offloading.
TINY_VARIANTS = {
    "train_step.py-wan": ("train_step.py", ["--workdir", "{work}", "--family", "wan", "--frames", "5", "--size",
                                            "32x48", "--only", "slab,squareq,resident", "--prefetch", "2",
                                            "--disk-res", "--steps", "2", "--warmup", "1", "--rank", "4",
                                            "--targets", "attention-ffn", "--offload-activations", "off", "on"],
                          {"frames": 5, "size": "32x48", "latent_frames": 2, "tokens": 12}),
    # Wan 2.2-TI2V-5B's shapes: its 16x VAE's latents, so the default tiny clip (64x96) is as many tokens
    "train_step.py-wan2.2-5b": ("train_step.py", ["--workdir", "{work}", "--family", "wan2.2-5b", "--only",
                                                  "slab,squareq,resident", "--prefetch", "2", "--disk-res", "--steps",
                                                  "2", "--warmup", "1", "--targets", "attention-ffn"],
                                {"frames": 5, "size": "64x96", "latent_frames": 2, "tokens": 12}),
}
TINY_RUNS = {**{script: (script, args, {}) for script, args in TINY_ARGS.items()}, **TINY_VARIANTS}
# The kernel benchmarks keep the Triton kernels (interpreted); the others run the bit-identical torch reference, as the
# runtime and trainer tests do (docs/development.md), since the interpreter makes a training step ~30x slower.
KERNEL_BENCHMARKS = {"dequant.py", "fp8_linear.py", "matmul.py"}
# What most benchmarks import first, about 4 s of a CPU each time: imported once here, and every tiny run starts as a
# process forked from this one. Only installed packages: the benchmarks' own modules are imported by each run.
PRELOAD = ("diffusers", "transformers", "peft", "squareq.compiler", "squareq.runtime", "squareq.train.loop")


# What a forked child may still set in its environment, since it is read where used (SQUAREQ_KERNELS,
# TOKENIZERS_PARALLELISM; TMPDIR once tempfile forgets its folder) or applied by hand (OMP_NUM_THREADS:
# torch.set_num_threads). Any other variable tiny_env sets must already hold that value here: TRITON_INTERPRET, for
# one, is read at import by triton.jit and squareq/kernels/triton_fused.py, which a child forked from here never redoes.
SET_IN_CHILD = frozenset({"SQUAREQ_KERNELS", "TOKENIZERS_PARALLELISM", "TMPDIR", "OMP_NUM_THREADS"})
TIMEOUT_S = 300  # per tiny run (seconds each, on a loaded CPU tens): past it the run is killed and the test fails


def tiny_env(script: str, work: Path) -> dict[str, str]:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               TMPDIR=str(work))  # what a script puts in a temporary folder goes with the test's
    if script not in KERNEL_BENCHMARKS:
        env["SQUAREQ_KERNELS"] = "torch"
    return env


def run_tiny(script: str, args: list[str], work: Path) -> tuple[int, str, str]:
    """``python benchmarks/SCRIPT --tiny ARGS`` with :func:`tiny_env`: its exit status, stdout and stderr. Forked from
    this process where :func:`fork_refusal` finds nothing against it; else a new interpreter. A run that takes over
    :data:`TIMEOUT_S` seconds is killed and fails the test."""
    argv = [str(BENCHMARKS / script), "--tiny", *(a.replace("{work}", str(work)) for a in args),
            "--out", str(work / "out")]
    env = tiny_env(script, work)
    if fork_refusal(env) is not None:
        try:
            done = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{script} --tiny ran past {TIMEOUT_S} s (a new interpreter) and was killed.")
        return done.returncode, done.stdout, done.stderr
    out, err = work / "stdout.txt", work / "stderr.txt"
    pid = os.fork()
    if pid == 0:
        _run_forked(argv, env, out, err)  # never returns
    status = _wait(pid, time.monotonic() + TIMEOUT_S)
    if status is None:
        pytest.fail(f"{script} --tiny ran past {TIMEOUT_S} s (forked) and was killed; its stderr ends: "
                    f"{err.read_text()[-2000:]}")
    return os.waitstatus_to_exitcode(status), out.read_text(), err.read_text()


def fork_refusal(env: dict[str, str]) -> str | None:
    """Why a run with ``env`` must start a new interpreter rather than fork from this process, or None. A fork copies
    only the calling thread, so a lock another thread holds stays held in the child for ever; CUDA cannot be used
    in a forked child; and a variable read at import keeps this process's value there (:data:`SET_IN_CHILD`)."""
    if not hasattr(os, "fork"):
        return "no os.fork here"
    if torch.cuda.is_available():
        return "CUDA: a forked child cannot use it"
    if threading.active_count() != 1:
        return f"{threading.active_count()} threads run here"
    stale = sorted(k for k in (set(env) | set(os.environ)) - SET_IN_CHILD if env.get(k) != os.environ.get(k))
    return f"{', '.join(stale)} differ here, and a forked child keeps what was read at import" if stale else None


def _wait(pid: int, deadline: float) -> int | None:
    """The forked child ``pid``'s wait status, or None when it ran past ``deadline``: its own alarm ended it, or, a
    little later, this poll kills it (a child stuck before it set its alarm)."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return None if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGALRM else status
        if time.monotonic() > deadline + 5:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.02)


def _run_forked(argv: list[str], env: dict[str, str], out: Path, err: Path) -> None:
    """In the forked child: run ``argv`` as ``python`` would (``__main__``, the script's folder first on sys.path, its
    own environment and working directory, output to ``out`` and ``err``), then exit with its status. First one
    OpenMP thread: a pool the parent started is gone in the child, and a parallel op waiting on it would hang; then an
    alarm that ends the child at :data:`TIMEOUT_S` (the default action of SIGALRM: terminate)."""
    torch.set_num_threads(1)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(TIMEOUT_S)
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
    scripts = {p.name for p in BENCHMARKS.glob("*.py")} - {"common.py", "user_layout.py"}  # modules, not scripts
    assert scripts == set(TINY_ARGS)


@pytest.mark.parametrize("run", sorted(TINY_RUNS))
def test_tiny_path(run, tmp_path, preloaded):
    """The run exits 0, prints its JSON lines, and the lines it keeps (``--out``: what benchmarks/results/ holds,
    with the figures its driver adds last, such as ratios to a peer) have every field its tables show."""
    script, args, holds = TINY_RUNS[run]
    code, stdout, stderr = run_tiny(script, args, tmp_path)
    assert code == 0, stderr[-3000:]
    assert any(line.startswith("{") for line in stdout.splitlines()), stdout[-2000:]
    records = [json.loads(line) for path in sorted((tmp_path / "out").glob("*.jsonl"))
               for line in path.read_text().splitlines()]
    assert records, f"no JSON lines in --out {tmp_path / 'out'}"
    tables = common.declared_tables(stderr)
    assert tables, "the script printed no table through common.table"
    problems = [p for t in tables for p in common.missing_fields(records, t)]
    assert not problems, problems
    measured = [r for r in records if "step_s" in r]
    assert not holds or measured and all(r.items() >= holds.items() for r in measured), measured


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


def test_the_check_takes_none_only_as_listed_not_measured():
    """A None in a field the table shows passes only where the record lists it as not measured (a GPU figure on a
    CPU), and a field listed so must hold None: no row can stand in a placeholder for a figure or hide one."""
    declared = {"where": {"what": "run"}, "fields": ["step_s", "peak_GB"]}
    unlisted = {"what": "run", "step_s": 0.1, "peak_GB": None}
    problems = common.missing_fields([unlisted], declared)
    assert len(problems) == 1 and "peak_GB" in problems[0] and "not listed" in problems[0]
    listed = common.not_measured({"what": "run", "step_s": 0.1}, "peak_GB")
    assert listed == {"what": "run", "step_s": 0.1, "peak_GB": None, "not_measured": ["peak_GB"]}
    assert common.missing_fields([listed], declared) == []
    assert common.missing_fields([{**listed, "peak_GB": 0.0}], declared)  # listed, yet a number
    assert common.missing_fields([{"what": "run", "step_s": 0.1, "not_measured": ["peak_GB"]}], declared)  # absent
    common.set_figure(listed, "peak_GB", 2.0)  # measured after all: off the list
    assert listed["not_measured"] == [] and common.missing_fields([listed], declared) == []
    common.set_figure(listed, "step_s", None)
    assert listed["not_measured"] == ["step_s"] and common.missing_fields([listed], declared) == []


def test_a_table_declares_what_it_prints(capsys):
    """common.table names on stderr the rows it printed and every field its cells read, ``also`` included; a figure
    not measured shows as such, never as a number."""
    columns = [common.Column("setup", "what"), common.Column("step s", "step_s", ".3f"),
               common.Column("ratio", "step_s", lambda r: r["step_s"] / r["base_s"], also=("base_s",)),
               common.Column("peak GB", "peak_GB", lambda r: f"{r['peak_GB']:.2f}"),
               common.Column("notes", None, lambda r: r.get("note", ""))]
    rows = [{"what": "run", "step_s": 0.5, "base_s": 0.25, "peak_GB": 1.0},
            common.not_measured({"what": "run", "step_s": 0.5, "base_s": 0.25}, "peak_GB"), {"what": "env"}]
    text = common.table(rows, columns, where={"what": "run"})
    assert text.splitlines()[2:] == ["| run | 0.500 | 2.0 | 1.00 |  |",
                                     f"| run | 0.500 | 2.0 | {common.NOT_MEASURED} |  |"]
    assert common.declared_tables(capsys.readouterr().err) == [
        {"where": {"what": "run"}, "fields": ["what", "step_s", "base_s", "peak_GB"]}]


def test_files_on_a_ram_file_system_are_not_counted_as_own_memory(tmp_path):
    """A folder standing in for a disk (``ram_files``): the pages of its mapped files come off the own memory,
    and a file mapped from elsewhere does not (the negative control)."""
    import mmap

    common = _load_common()
    if not os.path.exists("/proc/self/smaps"):
        pytest.skip("no /proc/self/smaps: not Linux")
    disk, other = tmp_path / "disk", tmp_path / "other"
    disk.mkdir(), other.mkdir()
    size = 8 << 20
    maps = []
    for folder in (disk, other):
        path = folder / "blob"
        path.write_bytes(b"\1" * size)
        with open(path, "rb") as f:
            maps.append(mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ))
        sum(maps[-1][i] for i in range(0, size, 4096))  # every page resident
    try:
        counted = common.HostPeaks(("x",), ram_files=str(disk))._ram_file_kb()
        assert 0.9 * size / 1024 <= counted <= 1.1 * size / 1024
        assert common.HostPeaks(("x",))._ram_file_kb() == 0
        assert common.HostPeaks(("x",), ram_files=str(tmp_path / "none"))._ram_file_kb() == 0
        both = common.HostPeaks(("x",), ram_files=[str(disk), str(other)])._ram_file_kb()  # several folders
        assert 0.9 * 2 * size / 1024 <= both <= 1.1 * 2 * size / 1024
    finally:
        for m in maps:
            m.close()


def test_a_compile_cut_by_sigterm_resumes_from_its_state(tmp_path):
    """compile.py's two-call run: SIGTERM in the calibration pass (``timeout``) ends the run with a ``cut`` line and
    the finished blocks kept in the state (here through --state-dir's link, the source in --source-dir); the same
    command again resumes them and adds the cut call's wall time to its own."""
    argv = [sys.executable, str(BENCHMARKS / "compile.py"), "--tiny", "--workdir", str(tmp_path / "work"),
            "--source-dir", str(tmp_path / "src"), "--state-dir", str(tmp_path / "state"), "--out", str(tmp_path)]
    env = tiny_env("compile.py", tmp_path)
    first = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    timer = threading.Timer(TIMEOUT_S, first.kill)
    timer.start()
    try:
        for line in first.stderr:
            if "block 2/" in line and "calibrating" in line:  # block 1 is measured: cut while block 2 is
                first.send_signal(signal.SIGTERM)
                break
        first.communicate()
    finally:
        timer.cancel()
    assert first.returncode == 128 + signal.SIGTERM

    def records(kind: str) -> dict:
        return next(r for r in map(json.loads, (tmp_path / "compile-flux1.jsonl").read_text().splitlines())
                    if r["kind"] == kind)

    cut = records("cut")
    assert cut["phase"] == "compile free" and cut["state_blocks"] >= 1 and cut["host_rss_anon_peak_gb"] > 0
    assert (tmp_path / "work" / "flux1-tiny-free.slab.state").is_symlink()
    done = subprocess.run([*argv, "--phase", "compile"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    rec = records("compile")
    assert rec["resumed_blocks"] == cut["state_blocks"] and rec["cut_calls_wall_s"] == [cut["wall_s"]]
    assert rec["total_wall_s"] == pytest.approx(rec["wall_s"] + cut["wall_s"])
    assert not os.path.lexists(tmp_path / "work" / "flux1-tiny-free.slab.state")  # the link and its folder removed
    assert not any((tmp_path / "state").iterdir())


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}_under_test", BENCHMARKS / f"{name}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look it up there
    spec.loader.exec_module(module)
    return module


def _load_cards():
    return _load_script("cards")


def test_a_median_step_leaves_out_the_steps_that_compiled(tmp_path):
    """cards.py's step median: the first step and those in which torch.compile compiled are left out, so the arm that
    runs first does not pay the other's compile; with every step compiling, all but the first count."""
    cards = _load_cards()
    rows = [{"step": 1, "seconds": 40.0, "compile_s": 34.0}, {"step": 2, "seconds": 1.1, "compile_s": 0.0},
            {"step": 3, "seconds": 38.0, "compile_s": 37.0}, {"step": 4, "seconds": 1.2, "compile_s": 0.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r["step"] for r in cards.step_rows(tmp_path)[1]] == [2, 4]
    for r in rows:
        r["compile_s"] = 5.0
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r["step"] for r in cards.step_rows(tmp_path)[1]] == [2, 3, 4]


def test_a_video_configs_noise_clips_hold_its_longest_window(tmp_path):
    """cards.py's noise clips for each video example config have frames enough that its longest window is cut from
    them after source_fps drops frames to the family's rate; the data scan reads them as clips, not images."""
    from squareq.train.clips import FAMILY_FPS, TEMPORAL_STRIDE, frame_count, resampled, windows
    from squareq.train.config import load_config
    from squareq.train.data import scan_dataset

    cards = _load_cards()
    video = {name: family for name, (family, _) in cards.CARDS.items() if family in FAMILY_FPS}
    assert set(video) == {"wan2.1-t2v-14b-16gb", "wan2.1-t2v-14b-24gb", "wan2.2-ti2v-5b", "hunyuan-video-24gb"}
    for name, family in video.items():
        settings, _ = load_config(ROOT / "examples" / f"{name}.toml").frame_settings.for_family(family)
        frames = cards.clip_frames(settings, FAMILY_FPS[family])
        kept = len(resampled(frames, settings.source_fps, FAMILY_FPS[family])) if settings.source_fps else frames
        assert max(n for _, n in windows(kept, settings, TEMPORAL_STRIDE[family])) == \
            settings.longest(TEMPORAL_STRIDE[family]), name
    cards.write_clips(tmp_path, 2, 7, 16)
    data = scan_dataset(tmp_path, min_side=16, clips=True)
    assert not data.items and not data.skipped
    assert [(p.name, frame_count(p)) for p, _, _ in data.clips] == [("clip0", 7), ("clip1", 7)]


def test_a_config_cut_while_sampling_keeps_its_figures_until_then():
    """cards.py: a config's process killed by --timeout while sampling keeps the figures it printed before sampling
    (sampling's listed as not measured) and says why; one cut before that keeps only why."""
    cards = _load_cards()
    before = common.not_measured({"what": cards.PARTIAL, "config": "flux2-dev", "step_s": 1.8},
                                 *cards.SAMPLE_FIELDS)
    out = "noise\n" + json.dumps(before) + "\n"
    rec = cards.cut_record("flux2-dev", "hub", out, "timed out after 400 s (--timeout)")
    assert rec["what"] == "card" and rec["step_s"] == 1.8 and rec["sample_s"] is None
    assert "sample_peak_reserved_GB" in rec["not_measured"] and rec["error"].endswith("while sampling")
    bare = cards.cut_record("flux2-dev", "hub", out.encode().replace(b'"step_s"', b'"x"')[:5], "timed out")
    assert bare == {"what": "card", "config": "flux2-dev", "layout": "hub", "error": "timed out"}


def test_a_kontext_step_appends_the_control_s_tokens_with_first_id_1_and_learns_on_the_target_s():
    """train_step.py --controls 1: the batch holds the target's tokens then as many control tokens, the control's
    ids the target's grid with the first id 1 (FluxKontextPipeline's); the loss sees the target's tokens only.
    Negative control: without --controls the batch is the target's alone."""
    step = _load_script("train_step")
    side = 128 // 16
    for controls in (1, 0):
        setup = step.Setup(step.parse_args(["--tiny", "--controls", str(controls), "--workdir", "/nonexistent"]))
        batch, target = step.make_batch(setup, 128, None)
        assert batch["hidden_states"].shape[1] == side * side * (1 + controls) and target.shape[1] == side * side
        ids = batch["img_ids"]
        assert ids.shape[0] == side * side * (1 + controls) and not ids[:side * side, 0].any()
        if controls:
            assert (ids[side * side:, 0] == 1).all() and torch.equal(ids[side * side:, 1:], ids[:side * side, 1:])
        out = torch.randn(1, batch["hidden_states"].shape[1], 4)
        assert torch.equal(step.predicted(out, target), out[:, :side * side])


def test_the_wan22_5b_config_runs_on_the_5b_s_slab_and_snapshot(tmp_path):
    """cards.py: wan2.2-ti2v-5b's slab is train_step.py's wan2.2-5b (48 latent channels; at full size 30 blocks), its
    manifest's family squareq's wan, and its Hub snapshot the 5B release's, whose VAE is Wan 2.2's (48 channels, 16x a
    side) in a pipeline of per-token timesteps. Negative control: the 14B config's slab and snapshot are the 14B's, so
    the 5B config on the 14B's files (the stand-in it ran on before) fails here."""
    from squareq.slab import open_slab

    cards, step = _load_cards(), _load_script("train_step")
    from user_layout import snapshot_of  # cards.py put benchmarks/ on sys.path

    args = argparse.Namespace(workdir=str(tmp_path), files_dir=None, tiny=True)
    seen = {}
    for name in ("wan2.2-ti2v-5b", "wan2.1-t2v-14b-16gb"):
        shape, repo = cards.shape_of(name), cards.repo_of(name)
        cards.ensure_slab(args, shape)
        cards.write_user_files(args, shape, cards.CARDS[name][0], repo)
        model = open_slab(cards.slab_path(tmp_path, shape, True), verify="off").manifest.model
        snapshot = snapshot_of(cards.hub_dir(args), repo)
        vae = json.loads((snapshot / "vae" / "config.json").read_text())
        index = json.loads((snapshot / "model_index.json").read_text())
        full = step.FAMILIES[shape][1]
        seen[name] = (model.family, model.config["in_channels"], repo, vae["z_dim"], vae["scale_factor_spatial"],
                      index["expand_timesteps"], full["in_channels"], full["num_layers"])
    assert seen["wan2.2-ti2v-5b"] == ("wan", 48, "Wan-AI/Wan2.2-TI2V-5B-Diffusers", 48, 16, True, 48, 30)
    assert seen["wan2.1-t2v-14b-16gb"] == ("wan", 4, "Wan-AI/Wan2.1-T2V-14B-Diffusers", 4, 8, False, 16, 40)
