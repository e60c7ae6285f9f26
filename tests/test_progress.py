"""The one progress bar every long command shows (squareq/progress.py): its bar on a terminal or when asked, its
plain lines elsewhere; the cache fill's bar over the entries to compute, and the demo's training on the same bar.
Each bar has its negative control: off a terminal nothing is drawn."""
import re
import sys

import pytest
import torch

from squareq.demo import training_progress
from squareq.progress import Progress
from squareq.slab import open_slab
from squareq.train.cache import EmbeddingCache
from squareq.train.config import load_config
from squareq.train.prepare import prepare_data
from squareq.train.tiny_dataset import write_tiny_dataset


def _drawn(err: str, desc: str, unit: str, total: int) -> bool:
    """Whether ``err`` holds a finished tqdm bar titled ``desc`` over ``total`` ``unit``s, with its rate."""
    return f"{desc}: 100%" in err and f"{total}/{total} [" in err and (f"{unit}/s" in err or f"s/{unit}" in err)


def _cache_bar(err: str, total: int) -> bool:
    """Whether ``err`` holds the cache fill's bar over ``total`` entries (cleared when done: its line says the
    rest)."""
    return f"cache:   0%|          | 0/{total} [" in err and "entry/s" in err


def test_a_progress_draws_a_bar_when_shown_and_else_only_its_lines(capsys):
    lines = []
    with Progress(10, "train", "step", shown=True, echo=lines.append, every=4) as shown:
        for k in range(1, 11):
            shown.advance(status=f"loss {k}", line=f"step {k}/10")
    err = capsys.readouterr().err
    assert _drawn(err, "train", "step", 10) and "loss 10" in err and lines == []  # the status is the bar's text
    # the control: not shown, nothing is drawn and no tqdm is made; each every-th line and the last are printed
    with Progress(10, "train", "step", shown=False, echo=lines.append, every=4) as hidden:
        assert hidden.bar is None and hidden.eta() == "?"  # no unit done yet: no rate
        for k in range(1, 11):
            hidden.advance(status=f"loss {k}", line=f"step {k}/10")
    assert lines == ["step 4/10", "step 8/10", "step 10/10"] and capsys.readouterr().err == ""


def _damage(path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # the last value's last byte: the header still parses, the hash does not match
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damaged", [True, False])
def test_a_damaged_entry_the_fill_finds_is_added_to_its_bars_total(tmp_path, damaged):
    """The bar counts the entries missing when the fill begins; one found damaged on the way is encoded again and
    counted too (the control: an intact cache leaves the total as it was)."""
    cache = EmbeddingCache(tmp_path, echo=lambda line: None)

    def compute(indices):
        return [{"prompt_embeds": torch.full((2, 3), float(i))} for i in indices]

    cache.fill("text", ["a", "b", "c"], compute)
    if damaged:
        _damage(cache.path("text", "b"))
    with Progress(1, "cache", "entry", shown=False) as bar:  # "d" is missing
        made = cache.fill("text", ["a", "b", "c", "d"], compute, progress=bar)
    assert made == bar.n == bar.total == (2 if damaged else 1)


def _prepare(tmp_path, slab, name: str, progress=None) -> list[str]:
    """Fill a new cache for the tiny dataset through tiny-flux's toy encoders; the lines it printed."""
    data = write_tiny_dataset(tmp_path / "data", count=3)
    cfg = load_config(None, {"slab": str(slab), "data": str(data), "output": str(tmp_path / "out"),
                             "resolution": 64, "max_sequence_length": 16, "cache_dir": str(tmp_path / name)})
    with open_slab(slab, verify="off") as s:
        record = s.manifest.model
    lines = []
    prepare_data(cfg, record, torch.device("cpu"), echo=lines.append, progress=progress)
    return lines


def _entries(lines: list[str]) -> tuple[int, int]:
    """The fill's closing line, as it always was: "cache DIR: N new entries of M in X s"."""
    (summary,) = [line for line in lines if line.startswith("cache ")]
    found = re.fullmatch(r"cache .*: (\d+) new entries of (\d+) in \d+\.\d s", summary)
    assert found, summary
    return int(found[1]), int(found[2])


def test_filling_the_cache_is_a_bar_over_the_entries_to_compute_on_a_terminal(tmp_path, tiny_slab, capsys,
                                                                              monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # pytest's stderr, as a terminal would be
    made, total = _entries(_prepare(tmp_path, tiny_slab, "on-a-terminal"))
    assert made == total > 3  # three images, their captions and the empty caption
    assert _cache_bar(capsys.readouterr().err, total)
    # asked for, the bar is drawn off a terminal too
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert _entries(_prepare(tmp_path, tiny_slab, "asked", progress=True)) == (total, total)
    assert _cache_bar(capsys.readouterr().err, total)
    # the control: off a terminal, the same fill draws nothing; its line is the same
    assert _entries(_prepare(tmp_path, tiny_slab, "in-a-log")) == (total, total)
    err = capsys.readouterr().err
    assert "cache:" not in err and "entry/s" not in err and "\r" not in err
    # and a cache with nothing to compute draws no bar, even on a terminal
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert _entries(_prepare(tmp_path, tiny_slab, "in-a-log")) == (0, total)
    assert "cache:" not in capsys.readouterr().err


def test_the_demos_training_goes_through_the_shared_bar(capsys):
    lines = []
    with training_progress(12, lines.append, shown=True) as after_step:
        for step in range(1, 13):
            after_step(step)
    assert _drawn(capsys.readouterr().err, "train", "step", 12) and lines == []
    # the control: off a terminal, no bar, and a line at each quarter of the steps, as the demo always printed
    with training_progress(12, lines.append, shown=False) as after_step:
        for step in range(1, 13):
            after_step(step)
    assert capsys.readouterr().err == ""
    # each with the time left, as the bar shows it (tqdm's format: "00:00" at this speed)
    assert [re.fullmatch(rf"      training: step {k}/12, ETA (\d\d:)?\d\d:\d\d", line) is not None
            for k, line in zip((3, 6, 9, 12), lines, strict=True)] == [True] * 4
    with training_progress(12, None) as after_step:  # no status asked for: the trainer gets no callback
        assert after_step is None
