"""`squareq inspect` and `squareq families`: what is in a slab (layers, formats, sizes, metrics, optionally its
checksums verified), and which model families SquareQ knows."""
from __future__ import annotations

import json
from pathlib import Path

import click

from ..slab import open_slab
from ..slab.summary import format_summary, summarize


@click.command()
@click.argument("slab", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--verify", is_flag=True, help="Check every block's and resident tensor's sha256 first.")
def inspect(slab: Path, as_json: bool, verify: bool) -> None:
    """Show a slab's layers, formats, sizes and metrics."""
    with open_slab(slab, verify="eager" if verify else "off") as s:
        report = summarize(s)
    report["verified"] = verify
    # slabs written before the resident layout digest still open; --verify says what they lack and how to add it
    unhashed = verify and s.manifest.resident and not s.manifest.resident_layout_sha256
    note = (f"note: {slab} was written before resident tensors had a layout digest, so their names, dtypes and "
            "shapes are checked but not hashed; recompile it with `squareq compile` to protect them")
    if as_json:
        click.echo(json.dumps(report, indent=1))
        if unhashed:
            click.echo(note, err=True)
        return
    click.echo(format_summary(report))
    if verify:
        click.echo("verify: every block and resident tensor matches its sha256")
    if unhashed:
        click.echo(note)


@click.command()
def families() -> None:
    """The model families SquareQ knows and what it does for each (compile, stream, train, sample)."""
    from ..models import families_table

    click.echo(families_table(), nl=False)
