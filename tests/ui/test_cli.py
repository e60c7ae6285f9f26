"""`squareq ui` on the command line (squareq/cli/ui.py): a bind other machines can reach is refused without --token,
in one sentence naming the flag; with it, or on this machine, the page is served (uvicorn.run stands in here); without
the [ui] extra, the command names the pip command that installs it."""
import sys

import pytest
from click.testing import CliRunner

from squareq.cli import main


@pytest.fixture
def served(monkeypatch):
    """What uvicorn.run was asked to serve, instead of serving it."""
    import uvicorn

    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.append((app, kw)))
    return calls


def test_a_bind_beyond_this_machine_without_a_token_is_refused(tmp_path, served, monkeypatch):
    monkeypatch.delenv("SQUAREQ_UI_TOKEN", raising=False)
    result = CliRunner().invoke(main, ["ui", "--bind", "0.0.0.0", "--runs", str(tmp_path / "runs")])
    assert result.exit_code == 1 and served == [] and not (tmp_path / "runs").exists()
    assert result.output.startswith("error: --bind 0.0.0.0 lets other machines reach the page, so it needs --token")
    assert result.output.count("\n") == 1, result.output


@pytest.mark.parametrize("args", [["--bind", "0.0.0.0", "--token", "s3cret"], []])
def test_with_a_token_or_on_this_machine_the_page_is_served(tmp_path, served, args):
    result = CliRunner().invoke(main, ["ui", "--runs", str(tmp_path / "runs"), "--data-root", str(tmp_path), *args])
    assert result.exit_code == 0, result.output
    (app, options), = served
    assert options == {"host": args[1] if args else "127.0.0.1", "port": 8675, "log_level": "warning"}
    assert (tmp_path / "runs").is_dir() and result.output.startswith("squareq ui: http://")


def test_without_the_ui_extra_the_pip_command_is_named(tmp_path, served, monkeypatch):
    monkeypatch.setitem(sys.modules, "starlette", None)
    result = CliRunner().invoke(main, ["ui", "--runs", str(tmp_path / "runs")])
    assert result.exit_code == 1 and served == []
    assert "squareq ui needs starlette, which is not installed; install SquareQ's ui extra with: pip install" in \
        result.output and "[ui]'" in result.output


def test_a_data_root_that_is_no_folder_is_refused(tmp_path, served):
    result = CliRunner().invoke(main, ["ui", "--runs", str(tmp_path / "runs"), "--data-root", str(tmp_path / "no")])
    assert result.exit_code == 1 and result.output.startswith(f"error: --data-root {tmp_path / 'no'} is not a folder")
