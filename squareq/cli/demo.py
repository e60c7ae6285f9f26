"""`squareq demo`: compile → train → sample → accept on the built-in tiny model (squareq/demo.py), the training on
the shared progress bar, and where everything was written."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from ..sizes import parse_size


@click.command()
@click.option("-o", "--out", type=click.Path(path_type=Path), default=Path("squareq-demo"), show_default=True,
              help="Folder for the demo's slab, data, LoRA, sample image and acceptance report.")
@click.option("--budget", default="2MB", show_default=True, help="Size budget for the tiny model's slab.")
@click.option("--steps", type=int, default=200, show_default=True, help="LoRA training steps.")
@click.option("--force", is_flag=True, help="Replace an earlier demo in --out.")
def demo(out: Path, budget: str, steps: int, force: bool) -> None:
    """compile → train → sample → accept on the built-in tiny model and dataset (a few minutes on a CPU)."""
    from ..demo import run_demo

    started = time.perf_counter()
    # the training's bar on a terminal; in a log, a line at each quarter of the steps, on stderr as the bar is
    result = run_demo(out, parse_size(budget, "--budget"), overwrite=force, steps=steps, echo=click.echo,
                      status=lambda line: click.echo(line, err=True))
    details = {g.name: g.details for g in result.report.gates}
    verdict = {"PASSED": "all gates passed", "FAILED": "a gate FAILED", "INCONCLUSIVE": "a gate was INCONCLUSIVE"}
    click.echo(f"\nslab:   {result.slab}  (squareq inspect {result.slab})\nLoRA:   {result.lora}\n"
               f"sample: {result.sample}\nreport: {result.report_path}\n"
               f"images: {details['image drift'].get('grid')}  (bf16 | slab | difference)\n"
               f"loss curves: {details['convergence'].get('plot')}\n"
               f"{verdict[result.report.verdict]} in {time.perf_counter() - started:.0f} s")
    sys.exit({"PASSED": 0, "FAILED": 3, "INCONCLUSIVE": 4}[result.report.verdict])
