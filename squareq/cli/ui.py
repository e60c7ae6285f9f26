"""`squareq ui`: the local page that watches and steers training runs (squareq/ui/), served by uvicorn."""
from __future__ import annotations

import os
from pathlib import Path

import click

from ..extras import check_installed
from ..ui.paths import Roots, UiError, check_bind

UI_MODULES = ("starlette", "uvicorn")  # the [ui] extra


def roots_of(runs: Path, data_roots: tuple[Path, ...]) -> Roots:
    """The server's folders, absolute, each one checked to exist (the runs folder is made)."""
    for root in data_roots:
        if not root.is_dir():
            raise UiError(f"--data-root {root} is not a folder; name a folder that holds dataset folders.")
    runs.mkdir(parents=True, exist_ok=True)
    return Roots(runs.resolve(), tuple(r.resolve() for r in data_roots or (Path.cwd(),)))


@click.command("ui")
@click.option("--port", type=int, default=8675, show_default=True, help="The port to serve the page on.")
@click.option("--runs", type=click.Path(path_type=Path, file_okay=False), default=Path("runs"), show_default=True,
              help="The folder of run folders: each one a `squareq train -o` output. Runs started from the page go "
                   "here too; the queue is kept in its .squareq-ui folder.")
@click.option("--data-root", "data_roots", type=click.Path(path_type=Path), multiple=True,
              help="A folder whose folders the page may train on (repeat for several; default: the current folder). "
                   "No other dataset folder can be chosen.")
@click.option("--bind", "host", default="127.0.0.1", show_default=True,
              help="The address to bind; anything but this machine's loopback needs --token.")
@click.option("--token", envvar="SQUAREQ_UI_TOKEN", help="A secret every request must carry (open the page as "
              "http://HOST:PORT/?token=TOKEN once); needed for a --bind other machines can reach. Also read from "
              "SQUAREQ_UI_TOKEN, which keeps it out of the process list.")
def ui(port, runs, data_roots, host, token) -> None:
    """Serve a local page to watch and steer training runs: status, curves, samples, memory, logs; start, stop, resume.

    Every run folder in --runs shows, whether the page or a terminal started it: the page reads the files the trainer
    writes. Runs started from the page queue one at a time per GPU.
    """
    check_bind(host, token)
    check_installed(UI_MODULES, "squareq ui")
    import uvicorn

    from ..ui.app import create_app

    roots = roots_of(runs, data_roots)
    app = create_app(roots, token=token, host=host)
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"squareq ui: http://{shown}:{port}/{'?token=…' if token else ''} (runs: {roots.runs}; datasets from: "
               f"{', '.join(map(str, roots.data))}; working folder {os.getcwd()}); Ctrl-C stops the page, not the "
               "runs")
    uvicorn.run(app, host=host, port=port, log_level="warning")
