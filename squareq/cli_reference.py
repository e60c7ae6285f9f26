"""Render docs/cli.md from the click commands themselves, so the reference cannot drift from the code.

Regenerate with ``python -m squareq.cli_reference > docs/cli.md``; a test fails when they differ.
"""
from __future__ import annotations

import click

from .cli import main
from .cli.train_help import FULL_HELP


def render() -> str:
    """Markdown with the ``--help`` text of the group and of every command (`squareq train`'s with each option's
    help in full, where its --help shows one line each)."""
    # A fixed width keeps the output identical on every terminal and in CI.
    ctx = click.Context(main, info_name="squareq", terminal_width=88, max_content_width=88, **main.context_settings)
    ctx.meta[FULL_HELP] = True
    parts = [
        "# CLI reference",
        "",
        "Generated from the code by `python -m squareq.cli_reference > docs/cli.md`; "
        "`tests/test_cli_reference.py` fails when this file is stale.",
        "",
        "```",
        main.get_help(ctx).rstrip(),
        "```",
    ]
    for name in main.list_commands(ctx):
        cmd = main.get_command(ctx, name)
        sub = click.Context(cmd, info_name=name, parent=ctx, terminal_width=88, max_content_width=88)
        parts += ["", f"## squareq {name}", "", "```", cmd.get_help(sub).rstrip(), "```"]
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    print(render(), end="")
