"""The folders ``squareq ui`` may touch and nothing else: the runs folder (read, served, written) and the dataset
roots given at start (read). A path from a request is taken relative to one of them and refused when it is absolute,
climbs out with ``..`` or leads out through a symbolic link; the check is on the resolved path, so a link that stays
inside is fine."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

UI_STATE = ".squareq-ui"  # inside the runs folder: the queue and the jobs' configurations and logs


class UiError(ValueError):
    """A request or flag ``squareq ui`` refuses; the message is one sentence naming what and what to do."""

    status = 400


class OutsideError(UiError):
    """A path that leads outside the folders the page may touch."""

    status = 403


def inside(root: Path, relative: str, what: str = "path") -> Path:
    """``relative`` (a request's path, ``/``-separated) resolved under ``root``; :class:`OutsideError` where it is
    absolute, holds ``..`` or a NUL, or resolves (symbolic links followed) outside ``root``."""
    text = str(relative).replace("\\", "/")
    parts = PurePosixPath(text).parts
    if "\0" in text or text.startswith("/") or (parts and ":" in parts[0]) or ".." in parts:
        raise OutsideError(f"the {what} {relative!r} leads outside {root}; give a path inside it, without '..'.")
    base = root.resolve()
    path = (base / text).resolve()
    if not path.is_relative_to(base):
        raise OutsideError(f"the {what} {relative!r} leads outside {root} through a symbolic link; give a path "
                           "inside it.")
    return path


def within(path: str | Path, roots: list[Path]) -> bool:
    """Whether ``path`` (relative paths taken from the working folder) resolves inside one of ``roots``."""
    resolved = Path(path).expanduser().resolve()
    return any(resolved.is_relative_to(root.resolve()) for root in roots)


def is_local(host: str) -> bool:
    """Whether binding ``host`` keeps the page on this machine (a loopback address, or ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """A page bound beyond this machine must ask for a token."""
    if not is_local(host) and not token:
        raise UiError(f"--bind {host} lets other machines reach the page, so it needs --token (or SQUAREQ_UI_TOKEN): "
                      "pass a secret the browser must send, or leave --bind at 127.0.0.1.")


@dataclass(frozen=True)
class Roots:
    """The runs folder and the dataset roots of one server."""

    runs: Path
    data: tuple[Path, ...]

    @property
    def state(self) -> Path:
        return self.runs / UI_STATE

    def run(self, name: str) -> Path:
        """The run folder ``name``: one folder directly in the runs folder, not the server's own."""
        if not name or "/" in name.replace("\\", "/") or name.startswith("."):
            raise OutsideError(f"{name!r} is not a run folder's name; pick a run from the list.")
        return inside(self.runs, name, "run")

    def data_folder(self, root: int, relative: str) -> Path:
        """The dataset folder ``relative`` under dataset root number ``root``."""
        if not 0 <= root < len(self.data):
            raise UiError(f"dataset root {root} does not exist; pick a dataset folder from the list.")
        path = inside(self.data[root], relative or ".", "dataset folder")
        if not path.is_dir():
            raise UiError(f"the dataset folder {relative!r} does not exist under {self.data[root]}; pick one from the "
                          "list.")
        return path
