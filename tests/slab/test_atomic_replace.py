"""Replacing an output folder (`--force`): at no moment is neither the old output nor the new one in place, and a kill
in the two-rename fallback's window leaves the old one to be put back by the next writer (the third audit's crash
window: the next compile deleted both hidden copies)."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from squareq.cli import main
from squareq.slab import atomic
from squareq.slab.atomic import atomic_directory, remove_debris, restore_replaced


def _output(folder, text):
    folder.mkdir()
    (folder / "slab.safetensors").write_text(text)


def _text(folder):
    return (folder / "slab.safetensors").read_text()


@pytest.mark.parametrize("swaps", [True, False])
def test_a_replace_leaves_the_new_output_and_nothing_hidden(tmp_path, monkeypatch, swaps):
    if not swaps:  # a system or file system without renameat2's exchange: two renames
        monkeypatch.setattr(atomic, "swap_paths", lambda a, b: False)
    final = tmp_path / "s.slab"
    _output(final, "old")
    with atomic_directory(final, overwrite=True) as tmp:
        (tmp / "slab.safetensors").write_text("new")
    assert _text(final) == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["s.slab"]


def test_a_failure_between_the_two_renames_puts_the_old_output_back(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "swap_paths", lambda a, b: False)
    real, calls = atomic.os.replace, []

    def second_fails(a, b):
        calls.append((a, b))
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C between the renames
        real(a, b)

    monkeypatch.setattr(atomic.os, "replace", second_fails)
    final = tmp_path / "s.slab"
    _output(final, "old")
    with pytest.raises(KeyboardInterrupt), atomic_directory(final, overwrite=True) as tmp:
        (tmp / "slab.safetensors").write_text("new")
    assert _text(final) == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["s.slab"]


def test_a_kill_between_the_renames_leaves_the_old_output_for_the_next_writer_to_put_back(tmp_path):
    final = tmp_path / "s.slab"
    _output(tmp_path / ".s.slab.old-0000cafe", "old")  # what SIGKILL between the renames leaves
    _output(tmp_path / ".s.slab.tmp-0000beef", "new")
    assert remove_debris(final) == [tmp_path / ".s.slab.tmp-0000beef"]
    assert _text(final) == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["s.slab"]
    # negative control: with the output in place, a hidden old copy is debris, not put back
    _output(tmp_path / ".s.slab.old-0000dead", "older")
    assert restore_replaced(final) is None and remove_debris(final) == [tmp_path / ".s.slab.old-0000dead"]
    assert _text(final) == "old"


def test_compile_puts_a_slab_back_that_a_killed_force_left_hidden_before_it_checks_the_path(tmp_path):
    out = tmp_path / "s.slab"
    _output(tmp_path / ".s.slab.old-0000cafe", "the user's slab")
    result = CliRunner().invoke(main, ["compile", "tiny-flux", "-o", str(out), "--budget", "2MB"])
    assert result.exit_code == 1, result.output
    assert f"put {out} back from .s.slab.old-0000cafe" in result.output
    assert f"error: {out} already exists; choose another output path or pass --force." in result.output
    assert _text(out) == "the user's slab"


def test_a_refused_compile_removes_what_a_killed_one_left_beside_the_slab(tmp_path):
    """The refusal for a taken path still removes a killed compile's hidden copies (the fourth audit found the .tmp-
    copy kept); a compile's own output is never removed."""
    out = tmp_path / "s.slab"
    _output(out, "the user's slab")
    _output(tmp_path / ".s.slab.tmp-0000beef", "a killed compile's new slab")
    _output(tmp_path / ".s.slab.old-0000dead", "a stale copy")
    _output(tmp_path / ".other.slab.tmp-0000beef", "another output's")  # negative control: not this slab's debris
    result = CliRunner().invoke(main, ["compile", "tiny-flux", "-o", str(out), "--budget", "2MB"])
    assert result.exit_code == 1 and "already exists" in result.output, result.output
    assert f"removed {tmp_path / '.s.slab.tmp-0000beef'}, left by a compile that was killed" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.slab.tmp-0000beef", "s.slab"]
    assert _text(out) == "the user's slab"
