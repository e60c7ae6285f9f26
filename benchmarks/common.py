"""What the benchmark scripts share: one JSON line per measurement (kept for the final table and the --out file),
progress on stderr, the commit measured, and the markdown table, whose columns each script names once
(:class:`Column`, :func:`table`) so that tests/test_benchmarks.py can check every JSON line has what the table shows."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS: list[dict] = []
COLUMNS_LINE = "# columns: "  # the stderr line a table declares its rows and fields on (tests/test_benchmarks.py)
NOT_MEASURED = "n/a"  # a table cell whose value this run did not measure (None in its JSON line, never 0)
# The compile options of the tiny paths (--tiny) that compile: the compiler's search in its cheapest form (few
# calibration samples and rows, plain rounding, no rotation or learned rounding, two effect probes). The same code
# runs as in a real run; only the work per layer shrinks.
TINY_SEARCH = {"calib_samples": 4, "rounding": "nearest", "rotation": False, "learned_rounding": False,
               "max_rows": 64, "effect_probes": 2}


def emit(rec: dict) -> dict:
    """Print ``rec`` as one JSON line and keep it."""
    RECORDS.append(rec)
    print(json.dumps(rec, sort_keys=True), flush=True)
    return rec


def not_measured(rec: dict, *fields: str) -> dict:
    """``rec`` with ``fields`` None and named in its ``not_measured`` list: figures this run could not measure (GPU
    memory on a CPU, a ratio to a peer the run left out). :func:`missing_fields` accepts a None only so listed."""
    if fields:
        rec.update(dict.fromkeys(fields))
        rec["not_measured"] = sorted({*rec.get("not_measured", ()), *fields})
    return rec


def set_figure(rec: dict, field: str, value) -> None:
    """``rec[field] = value`` for a figure set again as a run goes on (a ratio to a peer measured later): None is
    listed as not measured (:func:`not_measured`), a value is taken off that list."""
    if value is None:
        not_measured(rec, field)
        return
    rec[field] = value
    if field in rec.get("not_measured", ()):
        rec["not_measured"] = [f for f in rec["not_measured"] if f != field]


def write_records(out, name: str, records: list[dict] | None = None) -> None:
    """With ``--out DIR``: every kept line (or ``records``) to ``DIR/name``, whole or not at all (nothing without
    ``--out``)."""
    if out is None:
        return
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in (RECORDS if records is None else records))
    os.replace(path + ".tmp", path)


def log(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


def git_commit() -> str:
    """``SQUAREQ_COMMIT`` when set (the device receives a working tree whose git history is stale), else the
    checkout's short commit."""
    if os.environ.get("SQUAREQ_COMMIT"):
        return os.environ["SQUAREQ_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name() -> str:
    """The GPU's name, or ``cpu`` without one."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Column:
    """One column of a benchmark's markdown table: its header, the record field its cell shows, and how: a format
    spec of that field's value (``".3f"``) or a function of the whole record, for a cell derived from the field and
    the fields named in ``also``: every field a cell reads is named in ``field`` or ``also``, so :func:`missing_fields`
    checks it. ``field=None``: a cell made only of fields some rows have and others not (notes, errors)."""

    header: str
    field: str | None
    show: str | Callable[[dict], object] = ""
    also: tuple[str, ...] = ()

    def cell(self, rec: dict) -> str:
        """Empty where ``rec`` lacks a field the cell reads (a row that failed or was skipped); :data:`NOT_MEASURED`
        where its field is None (not measured in this run), or what the cell makes of the record is."""
        if any(f not in rec for f in (self.field, *self.also) if f):
            return ""
        if self.field is not None and rec[self.field] is None:
            return NOT_MEASURED
        value = self.show(rec) if callable(self.show) else rec[self.field]
        if value is None:
            return NOT_MEASURED
        return str(value) if callable(self.show) else format(value, self.show)


def matches(rec: dict, where: dict | None) -> bool:
    """Whether ``rec`` has, for every field of ``where``, its value (or one of its values, given a list)."""
    return all(rec.get(k) in (v if isinstance(v, list) else [v]) for k, v in (where or {}).items())


def table(records: list[dict], columns: list[Column], where: dict | None = None) -> str:
    """The markdown table of the records that match ``where`` ({field: value or [values]}), a row each: the one
    place a script names its table's columns. A row without a field shows an empty cell. It also declares on stderr
    (:data:`COLUMNS_LINE`) which records are rows and which fields they show, for :func:`missing_fields`."""
    fields = list(dict.fromkeys(f for c in columns for f in (c.field, *c.also) if f))
    print(COLUMNS_LINE + json.dumps({"where": where or {}, "fields": fields}), file=sys.stderr, flush=True)
    lines = ["| " + " | ".join(c.header for c in columns) + " |", "|" + "---|" * len(columns)]
    for rec in records:
        if matches(rec, where):
            lines.append("| " + " | ".join(c.cell(rec).replace("|", "/") for c in columns) + " |")
    return "\n".join(lines)


def declared_tables(stderr: str) -> list[dict]:
    """The tables a run declared (:func:`table`) in its stderr ``stderr``."""
    return [json.loads(line[len(COLUMNS_LINE):]) for line in stderr.splitlines() if line.startswith(COLUMNS_LINE)]


def missing_fields(records: list[dict], declared: dict) -> list[str]:
    """What is wrong with ``records`` (JSON lines) for the table ``declared``: no record is one of its rows, a row
    holds an error, a row lacks a field the table shows, or holds None in one without naming it in its
    ``not_measured`` list (:func:`not_measured`), or names one there that holds a value. A row that says why it was
    skipped (``skipped``) needs no measurement."""
    rows = [r for r in records if matches(r, declared["where"])]
    if not rows:
        return [f"no record is a row of the table of {declared['fields']} (where {declared['where']})"]
    problems = []
    for r in rows:
        if "error" in r:
            problems.append(f"a row has an error: {str(r['error'])[:300]}")
            continue
        if r.get("skipped"):
            continue
        which = f"a row ({ {k: r[k] for k in list(declared['where'])} })"
        listed = set(r.get("not_measured", ()))
        for what, fields in (
                ("lacks", [f for f in declared["fields"] if f not in r]),
                ("holds None, not listed as not measured, in",
                 [f for f in declared["fields"] if f in r and r[f] is None and f not in listed]),
                ("lists as not measured but holds a value in",
                 [f for f in declared["fields"] if f in listed and r.get(f) is not None])):
            if fields:
                problems.append(f"{which} {what} {fields}")
    return problems


class HostPeaks:
    """The peaks of a process's anonymous memory (RssAnon), of its own memory (RssAnon + RssShmem: SquareQ's
    page-locked blobs are shared anonymous pages, which the kernel counts as shmem) and of its RSS, per phase, read
    from ``/proc/<pid>/status`` every ``every`` seconds by a thread: :meth:`phase` names the phase the next reads
    count for; :meth:`fields` gives ``<phase>_rss_anon_peak_GB``, ``<phase>_rss_peak_GB`` and
    ``<phase>_own_peak_GB``, None where not measured
    (no /proc: not Linux; a phase too short for a read still gets the read :meth:`phase` takes on entering it).
    ``ram_files``: a folder (or several) on a RAM file system standing in for a disk; the pages of its files that the
    process maps are shmem too, where on a disk they would be page cache, so they are subtracted from the own memory
    (read from ``/proc/<pid>/smaps``)."""

    def __init__(self, phases: tuple[str, ...], pid: int | str = "self", every: float = 0.1,
                 ram_files: str | list[str] | None = None) -> None:
        import threading

        self.phases, self.path, self.every = phases, f"/proc/{pid}/status", every
        folders = [ram_files] if isinstance(ram_files, str) else ram_files or []
        self.smaps, self.ram_files = f"/proc/{pid}/smaps", tuple(os.path.realpath(f) + os.sep for f in folders)
        self.peaks: dict[str, list[int]] = {}
        self.current: str | None = None
        self._ram_seen = (-1, 0)  # (RssShmem, the RAM files' kB) at the last smaps read
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.available = os.path.exists(self.path)

    def _read(self) -> None:
        if self.current is None or not self.available:
            return
        try:
            with open(self.path) as f:
                kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)
                      if k in ("VmRSS", "RssAnon", "RssShmem")}
        except (OSError, ValueError):
            return
        peak = self.peaks.setdefault(self.current, [0, 0, 0])
        shmem = kb.get("RssShmem", 0)
        # parsing smaps holds the GIL ~10 ms: redone only when RssShmem, which holds the RAM files' pages, has moved
        if shmem != self._ram_seen[0]:
            self._ram_seen = (shmem, self._ram_file_kb())
        own = kb.get("RssAnon", 0) + shmem - self._ram_seen[1]  # pinned: shared anonymous pages
        peak[0], peak[1], peak[2] = max(peak[0], kb.get("RssAnon", 0)), max(peak[1], kb.get("VmRSS", 0)), \
            max(peak[2], own)

    def _ram_file_kb(self) -> int:
        """Resident kB of the mappings of files under ``ram_files`` (0 without any)."""
        if not self.ram_files:
            return 0
        total, counting = 0, False
        try:
            with open(self.smaps) as f:
                for line in f:
                    head = line.split(None, 1)[0]
                    if "-" in head and not head.endswith(":"):  # a mapping's first line: range perms ... path
                        fields = line.split(None, 5)
                        counting = len(fields) == 6 and fields[5].startswith(self.ram_files)
                    elif counting and head == "Rss:":
                        total += int(line.split()[1])
        except (OSError, ValueError):
            return 0
        return total

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            self._read()

    def phase(self, name: str | None) -> None:
        self._read()  # the phase that ends gets its last read, the one that starts its first
        self.current = name
        self._read()

    def __enter__(self) -> HostPeaks:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.phase(None)
        self.stop.set()
        self.thread.join()

    def fields(self, rec: dict) -> dict:
        """The peaks into ``rec`` (GB); phases never entered, or no /proc, listed as not measured."""
        for name in self.phases:
            keys = (f"{name}_rss_anon_peak_GB", f"{name}_rss_peak_GB", f"{name}_own_peak_GB")
            if name in self.peaks:
                for key, kb in zip(keys, self.peaks[name], strict=True):
                    rec[key] = kb * 1024 / 1e9
            else:
                not_measured(rec, *keys)
        return rec
