"""What a person sees while SquareQ works (issue 60): one labelled bar per phase with its ETA on a terminal, plain
lines with an ETA in a log, and the libraries' own bars (diffusers' denoising loops, "Loading ..." bars, the Hub's
downloads) only under ``squareq -v``. Each has its negative control: an unlabelled bar is found where ``-v`` lets
one through, and the libraries' switches are on again under ``-v``."""
import re
import subprocess
import sys

import pytest

from squareq.cli import main
from squareq.compiler.plain import PlainOptions, write_rtn_slab
from squareq.models import load_builtin
from squareq.quant import QuantSpec

pytestmark = pytest.mark.usefixtures("torch_kernels")

BAR = re.compile(r"\d+%\|")  # a tqdm bar: "layer MSE:  50%|█████     | 2/4 [...]"
# every bar `squareq accept` draws, each titled with its gate (or the part of it that runs)
GATE_BARS = ("layer MSE", "block drift", "bf16 reference", "image drift (bf16)", "image drift (slab)", "cache",
             "gradient agreement", "convergence")
# the shortest run of every gate: the image drift's drawings and the training runs as short as the flags allow
SHORT = ("--steps", "4", "--images", "1", "--sample-steps", "2")


@pytest.fixture(scope="module")
def slab(tmp_path_factory):
    """tiny-flux written at W8 (round to nearest: no calibration to wait for)."""
    model, adapter = load_builtin("tiny-flux")
    out = tmp_path_factory.mktemp("output") / "tiny.slab"
    write_rtn_slab(model, adapter.blocks(model), {}, out,
                   PlainOptions(default_spec=QuantSpec(bits=8), family="flux", source="tiny-flux"))
    return out


def bar_titles(err: str) -> list[str]:
    """The title of each bar drawn in ``err`` (a tqdm line, each redraw after a carriage return); "" for a bar
    without one."""
    titles = []
    for segment in re.split(r"[\r\n]", err):
        found = BAR.search(segment)
        if found:
            titles.append(segment[:found.start()].strip().removesuffix(":"))
    return titles


def _run(args, capsys, monkeypatch, terminal: bool) -> str:
    """``squareq ARGS`` in this process, stderr a terminal or not; what it wrote on stderr."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    with pytest.raises(SystemExit) as ended:
        main.main(list(args), prog_name="squareq")
    err = capsys.readouterr().err
    assert ended.value.code in (0, 4, None), err  # 4: a convergence run this short may not decide
    return err


def test_accept_on_a_terminal_draws_each_gate_on_its_own_labelled_bar_and_no_other(slab, tmp_path, capsys,
                                                                                     monkeypatch):
    err = _run(["accept", str(slab), "--model", "tiny-flux", "--workdir", str(tmp_path / "w"), *SHORT], capsys,
               monkeypatch, terminal=True)
    titles = bar_titles(err)
    assert set(titles) == set(GATE_BARS), sorted(set(titles))  # no bar without a title, none from diffusers
    # each with its ETA: "[elapsed<remaining"
    assert all(re.search(rf"{re.escape(t)}: +\d+%\|.*\[\d\d:\d\d<(\?|\d\d:\d\d)", err) for t in GATE_BARS)
    # the control: the checker does see a bar without a title (diffusers' denoising bar, as it used to leak)
    assert bar_titles("\r  0%|          | 0/8 [00:00<?, ?it/s]\rlayer MSE:  50%|█  | 2/4 [00:01<00:01]") == \
        ["", "layer MSE"]


def test_accept_in_a_log_says_each_gates_progress_in_plain_lines_with_an_eta(slab, tmp_path, capsys, monkeypatch):
    err = _run(["accept", str(slab), "--model", "tiny-flux", "--workdir", str(tmp_path / "w"), *SHORT], capsys,
               monkeypatch, terminal=False)
    assert "\r" not in err and not bar_titles(err)  # nothing drawn in a log
    eta = r", ETA (\d\d:)?\d\d:\d\d$"
    for line in (r"layer MSE: 4/4 blocks", r"block drift: 5/5 forwards", r"bf16 reference: 4/4 blocks",
                 r"image drift \(bf16\): image 1/1 drawn", r"image drift \(slab\): image 1/1 drawn",
                 r"gradient agreement: 16/16 gradients", r"convergence: 12/12 steps"):
        assert re.search(rf"^{line}{eta}", err, re.M), line
    # item 8 of the issue: the slab is "the slab", once
    assert re.search(r"^image drift: drawing 1 image from the slab$", err, re.M) and "slab slab" not in err
    assert re.search(r"^image drift: drawing 1 image from the bf16 reference$", err, re.M)


def test_diffusers_bars_show_only_under_verbose(slab, tmp_path, capsys, monkeypatch):
    args = ["sample", str(slab), "--prompt", "a red circle", "--resolution", "64", "--steps", "3",
            "-o", str(tmp_path / "out")]
    assert set(bar_titles(_run(args, capsys, monkeypatch, terminal=True))) == {"sample"}
    # the control: with -v, diffusers' own denoising bar (no title) is drawn beside SquareQ's
    assert set(bar_titles(_run(["-v", *args], capsys, monkeypatch, terminal=True))) == {"sample", ""}
    _run(args, capsys, monkeypatch, terminal=True)  # leave this process as a plain `squareq` call does


def test_the_libraries_are_told_when_imported_and_again_under_verbose():
    """In a fresh process (nothing of theirs imported yet, as in `squareq`): diffusers', transformers' and the Hub's
    bars are off once each is imported, and on again after a later ``-v`` (the control); the Hub's are on while a
    download runs (a first download of FLUX.1-dev takes many minutes, and its bars name the files), and off after."""
    code = """
import sys
from squareq.third_party import quiet_third_parties
assert "diffusers" not in sys.modules and "huggingface_hub" not in sys.modules
quiet_third_parties(False)
import diffusers.utils.logging as d, transformers.utils.logging as t, huggingface_hub.utils as h
from squareq.third_party import download_bars
with download_bars():
    during = not h.are_progress_bars_disabled()
print(d.is_progress_bar_enabled(), t.is_progress_bar_enabled(), not h.are_progress_bars_disabled(), during)
quiet_third_parties(True)
print(d.is_progress_bar_enabled(), t.is_progress_bar_enabled(), not h.are_progress_bars_disabled())
"""
    env = {k: v for k, v in __import__("os").environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split("\n")[:2] == ["False False False True", "True True True"], out
