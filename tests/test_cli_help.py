"""`squareq --help` imports no torch (issue 60: it took 4-9 s), the group's listing matches each command's own help,
and `squareq train --help` is grouped, at most 120 lines, with every option once and its default."""
import re
import subprocess
import sys
import time

import click
import pytest

from squareq.cli import main
from squareq.cli.group import COMMANDS
from squareq.cli.train_help import SECTIONS

HEAVY = ("torch", "diffusers", "transformers", "numpy")
LOADED = ("import sys\n{setup}\nfrom squareq.cli import main\n"
          "try:\n    main({args!r}, prog_name='squareq')\nexcept SystemExit:\n    pass\n"
          "print('LOADED', sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r}))\n")


def heavy_modules(args: list[str], setup: str = "") -> list[str]:
    """The heavy libraries a fresh interpreter has imported after ``squareq ARGS``."""
    done = subprocess.run([sys.executable, "-c", LOADED.format(setup=setup, args=args, heavy=HEAVY)],
                          capture_output=True, text=True, timeout=120)
    line = next(line for line in done.stdout.splitlines() if line.startswith("LOADED"))
    return eval(line[len("LOADED "):])


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["-h"]])
def test_help_and_version_import_no_torch(args):
    assert heavy_modules(args) == []


def test_the_import_check_sees_torch():
    """The negative control: a command module imports torch, and the same check reports it."""
    assert "torch" in heavy_modules(["--help"], setup="import squareq.cli.train")


def test_help_finishes_within_a_generous_bound():
    """The one timed test the issue asks for: under 1 s on the CI machine (docs/development.md), 3 s here."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "squareq", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "Commands:" in done.stdout
    assert time.perf_counter() - started < 3.0


def test_the_listing_shows_each_commands_own_help():
    """The group lists commands from cli/group.py's COMMANDS without importing them; each recorded text gives the
    short help the command's own does, at any width, and every command is recorded."""
    ctx = click.Context(main, info_name="squareq")
    for name, (_, _, recorded) in COMMANDS.items():
        command = main.get_command(ctx, name)
        assert command is not None and command.name == name
        for limit in (45, 70, 300):
            assert click.Command(name, help=recorded).get_short_help_str(limit) == command.get_short_help_str(limit)
    assert main.get_command(ctx, "nonesuch") is None


def train_help(width: int = 80) -> str:
    # the group's context settings (its -h): a command's help option is cached at first use (click 8.2)
    ctx = click.Context(main, info_name="squareq", terminal_width=width, max_content_width=width,
                        **main.context_settings)
    command = main.get_command(ctx, "train")
    return command.get_help(click.Context(command, info_name="train", parent=ctx, terminal_width=width,
                                          max_content_width=width))


def listing_problems(text: str, command: click.Command) -> list[str]:
    """Each visible option of ``command`` whose long flag is not listed exactly once at the start of a line of
    ``text``, and each section of SECTIONS missing."""
    problems = []
    for param in command.params:
        if isinstance(param, click.Option) and not param.hidden:
            flag = max(param.opts, key=len)
            count = len(re.findall(rf"^\s+(?:-\w, )?{re.escape(flag)}(?=[ ,\n]|$)", text, re.M))
            if count != 1:
                problems.append(f"{flag} listed {count} times")
    problems += [f"no section {title}" for title in SECTIONS if f"\n{title}:\n" not in text]
    return problems


def test_train_help_is_grouped_short_and_lists_every_option_once_with_defaults():
    text = train_help()
    lines = text.splitlines()
    assert len(lines) <= 120, len(lines)
    assert max(map(len, lines)) <= 80
    ctx = click.Context(main, info_name="squareq")
    command = main.get_command(ctx, "train")
    assert listing_problems(text, command) == []
    assert "\nOther:\n" not in text  # every option is in a section
    for flag, shown in (("--rank", "16"), ("--lr", "0.0001"), ("--steps", "1000"), ("--compute", "auto"),
                        ("--resolution", "1024"), ("--save-every", "250"), ("--cache-dir", "OUT/cache")):
        line = next(line for line in lines if line.strip().startswith(flag + " "))
        assert f"[default: {shown}]" in line, line


def test_the_listing_check_sees_a_missing_or_repeated_option():
    """The negative control: the listing with --rank's line removed, or --lr's repeated, fails the same check."""
    text = train_help()
    command = main.get_command(click.Context(main, info_name="squareq"), "train")
    without = "\n".join(line for line in text.splitlines() if not line.strip().startswith("--rank "))
    assert listing_problems(without, command) == ["--rank listed 0 times"]
    lr = next(line for line in text.splitlines() if line.strip().startswith("--lr "))
    assert listing_problems(text + "\n" + lr, command) == ["--lr listed 2 times"]
