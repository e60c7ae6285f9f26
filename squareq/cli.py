"""The `squareq` command line: a thin layer that parses flags, calls the library and prints."""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click

from . import __version__
from .models import ModelError
from .quant import QuantSpec, SpecError
from .slab import SlabError, open_slab
from .slab.summary import format_summary, summarize

USER_ERRORS = (SlabError, ModelError, SpecError)


class _Group(click.Group):
    """Turns the library's user-facing errors into one line on stderr and exit status 1."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except USER_ERRORS as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="squareq")
@click.option("-v", "--verbose", is_flag=True, help="Log which kernels and backends are used.")
def main(verbose: bool) -> None:
    """Compile a diffusion transformer into a W4/W6/W8 slab and train LoRAs on it by streaming blocks.

    \b
    squareq compile MODEL --budget 12GB -o model.slab
    squareq train model.slab --data DIR -o lora/
    squareq accept model.slab --model MODEL
    """
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(name)s: %(message)s")


def _not_yet(name: str, what: str):
    @main.command(name, context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
                  help=f"{what} (not in this version yet).", add_help_option=True)
    def _cmd() -> None:
        click.echo(
            f"error: `squareq {name}` is not in SquareQ {__version__} yet. Today `squareq demo` writes and checks a "
            "slab of the built-in tiny model and `squareq inspect SLAB` shows what a slab holds.",
            err=True,
        )
        sys.exit(2)

    return _cmd


_not_yet("compile", "Calibrate MODEL, choose W4/W6/W8 per layer under a size budget, write a slab")
_not_yet("train", "Train a LoRA on a slab, streaming its blocks through the GPU")
_not_yet("accept", "Gate a slab: layer MSE, convergence delta, peak VRAM")


@main.command()
@click.argument("slab", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--verify", is_flag=True, help="Check every block's and resident tensor's sha256 first.")
def inspect(slab: Path, as_json: bool, verify: bool) -> None:
    """Show a slab's layers, formats, sizes and metrics."""
    with open_slab(slab, verify="eager" if verify else "off") as s:
        report = summarize(s)
    report["verified"] = verify
    if as_json:
        click.echo(json.dumps(report, indent=1))
        return
    click.echo(format_summary(report))
    if verify:
        click.echo("verify: every block and resident tensor matches its sha256")


@main.command()
@click.option("-o", "--out", type=click.Path(path_type=Path), default=Path("squareq-demo/tiny-flux.slab"),
              show_default=True, help="Where to write the demo slab.")
@click.option("--bits", type=click.Choice(["4", "6", "8"]), default="4", show_default=True)
@click.option("--group-size", type=int, default=64, show_default=True)
@click.option("--force", is_flag=True, help="Replace an existing slab at --out.")
def demo(out: Path, bits: str, group_size: int, force: bool) -> None:
    """Run the pipeline on the built-in tiny model (what exists of it in this version)."""
    from .demo import run_demo

    result = run_demo(out, QuantSpec(bits=int(bits), group_size=group_size), overwrite=force, echo=click.echo)
    click.echo(f"slab: {result.slab_path}  (inspect it: squareq inspect {result.slab_path} --verify)")
    click.echo("not run in this version: squareq train, squareq accept (they are not built yet)")


if __name__ == "__main__":
    main()
