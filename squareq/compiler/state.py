"""The compile state folder beside the output: finished blocks survive a crash, and `--resume` reuses them.

``<out>.state/state.json`` fingerprints what the measurements depend on (the source, the calibration data and the
search options; not the thresholds, the budget or the objective, which only the plan reads); ``block.<k>.safetensors``
holds every candidate measured for the block's layers and ``block.<k>.json`` their measurements. The JSON is
written last, so a block counts as finished only when both files are complete. ``effects.json`` holds each
layer's measured effect on the model's output once that pass has run. ``spill.<part>.scratch`` files are not state:
a pass's tensors that did not fit ``--host-budget`` (compiler/spill.py), deleted when the pass ends and, left by a
killed compile, when the folder is opened again. A folder made with other inputs is refused when it holds finished
work (a block, the effects, a refused plan: :data:`REFUSED`), and discarded with a line when it holds none (a compile
refused or killed before its first block finished), so the rerun that fixed its inputs needs no hand deletion.
"""
from __future__ import annotations

import hashlib
import json
import math
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from ..quant import QuantizedWeight, QuantSpec, SpecError, tensor_layout
from ..slab.atomic import atomic_write_bytes, atomic_write_parts
from ..slab.digest import file_sha256
from ..slab.safetensors_file import DTYPE_NAMES, safetensors_parts
from .ladder import LayerDecision
from .layer_search import Candidate


class StateError(ValueError):
    """The state folder cannot be used for this compile."""


SPILL_GLOB = "spill.*.scratch"
REFUSED = "refused.json"  # the compile's plan was refused after every layer was measured


def state_folder(out: Path) -> Path:
    """The state folder of the compile that writes the slab ``out``: ``<out>.state`` beside it."""
    return out.parent / f"{out.name}.state"


def spill_path(folder: Path, part: str) -> Path:
    """The scratch file of one pass's spilled tensors in the state folder ``folder`` (matches :data:`SPILL_GLOB`)."""
    return Path(folder) / f"spill.{part}.scratch"


def _record_hash(record: dict) -> str:
    """sha256 of a record's canonical JSON (key order and spacing do not matter, every value does)."""
    return hashlib.sha256(json.dumps(record, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class CompileState:
    """Read and write one compile's state folder."""

    def __init__(self, folder: Path, fingerprint: dict, resume: bool, echo=lambda line: None) -> None:
        self.folder = Path(folder)
        self.echo = echo  # says so when a damaged block is measured again
        self._verified: set[int] = set()
        self._pending: tuple[int, Future] | None = None  # the block a worker is writing
        meta = self.folder / "state.json"
        found = self._json(meta) if self.folder.exists() and meta.is_file() else None
        if found is not None and not isinstance(found, dict):
            raise StateError(f"{meta} is damaged (it holds no JSON object); delete {self.folder} to start the compile "
                             "over.")
        if found is not None and found != fingerprint:
            # a damaged state.json's keys are said as Python writes them: one sentence, whatever they hold
            changed = sorted(k if k.isprintable() else repr(k) for k in set(found) | set(fingerprint)
                             if found.get(k) != fingerprint.get(k))
            if self._holds_work():
                raise StateError(f"{self.folder} was made by a compile with different inputs ({', '.join(changed)}); "
                                 "rerun with the same model and options to continue it, or delete the folder to "
                                 "start over.")
            # a compile refused (a damaged source, fixed since) or killed before it finished a block: nothing to
            # keep, so the corrected rerun starts over rather than asking for the folder to be deleted by hand
            echo(f"starting over in {self.folder}: the compile that made it had different inputs "
                 f"({', '.join(changed)}) and finished no block")
            self._discard()
            found = None
        if self.folder.exists() and not resume:
            if found is None or not (self.folder / REFUSED).is_file():
                raise StateError(f"{self.folder} holds an earlier, unfinished compile; pass --resume to continue it, "
                                 "or delete the folder to start over.")
            # a compile that measured everything and was refused by its plan (the budget), rerun with another
            # --budget or --thresholds as its error says: the same inputs measure the same numbers
            echo(f"continuing the compile in {self.folder}: it measured every layer with the same model and options "
                 "and was refused by its budget, so its measurements are reused (delete the folder to measure again)")
        self.folder.mkdir(parents=True, exist_ok=True)
        # a write a kill interrupted and a killed pass's spill files (tens of GB): never read, only filling the disk
        for leftover in [*self.folder.glob(".*.tmp"), *self.folder.glob(SPILL_GLOB)]:
            leftover.unlink(missing_ok=True)
        atomic_write_bytes(meta, json.dumps(fingerprint, indent=1, sort_keys=True).encode())

    def _holds_work(self) -> bool:
        """Whether the folder holds anything a compile finished: a block's record, the effects or a refused plan."""
        return any(self.folder.glob("block.*.json")) or (self.folder / "effects.json").exists() \
            or (self.folder / REFUSED).exists()

    def _discard(self) -> None:
        """Remove a state that holds no finished work; its state.json goes last, so an interrupted discard is done
        again by the next compile rather than read as an unfinished one."""
        for entry in self.folder.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            elif entry.name != "state.json":
                entry.unlink()
        (self.folder / "state.json").unlink()
        self.folder.rmdir()

    def mark_refused(self, why: str) -> None:
        """Note that the compile measured everything and its plan was refused (``why``): rerun with the same model and
        measurement options, the next compile continues from this state without --resume."""
        atomic_write_bytes(self.folder / REFUSED, json.dumps({"refused": why}).encode())

    def _json(self, path: Path):
        """A JSON file of the state; a damaged one (a disk error, an edit) is refused in a sentence."""
        try:
            return json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise StateError(f"{path} is damaged ({' '.join(str(exc).split())[:120]}); delete {self.folder} to start "
                             "the compile over.") from None

    def _paths(self, index: int) -> tuple[Path, Path]:
        return self.folder / f"block.{index}.safetensors", self.folder / f"block.{index}.json"

    def has_block(self, index: int) -> bool:
        """Whether block ``index`` finished and its files are as they were written: the tensors' sha256 and the
        record's are checked (once per compile), so a damaged block is measured again, never built into a slab
        whose own hashes would then match the damage."""
        self.wait(index)
        data, meta = self._paths(index)
        if not meta.is_file():
            return False
        if index in self._verified:
            return True
        why = self._damage(data, meta)
        if why is None:
            self._verified.add(index)
            return True
        self.echo(f"{data.name} and {meta.name} {why} in {self.folder}; measuring that block again.")
        meta.unlink(missing_ok=True)
        data.unlink(missing_ok=True)
        return False

    def _damage(self, data: Path, meta: Path) -> str | None:
        """Why a finished block's files cannot be trusted, or None."""
        try:
            record = json.loads(meta.read_text())
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            return "have an unreadable record"
        if not isinstance(record, dict) or not isinstance(record.get("sha256"), str):
            return "carry no hash (an older SquareQ wrote them)"
        body = {k: v for k, v in record.items() if k != "record_sha256"}
        if record.get("record_sha256") != _record_hash(body):
            return "have a record that changed after it was written"
        try:
            found = file_sha256(data)
        except OSError:
            return "have no readable tensors file"
        if found != record["sha256"]:
            return "have tensors whose bytes changed after they were written"
        return _unreadable(record, data)

    def save_block(self, index: int, decisions: list[LayerDecision], info: dict) -> None:
        """Write a finished block's candidates and record. A worker thread writes them while the next block is
        measured (hashing and fsyncing a FLUX.1 double block's 1.5 GB took a fifth of its time); one block at a time,
        so the host holds this block's candidates and the next one's. A write's error (a full disk) is raised by the
        next save or read."""
        tensors, records = {}, []
        for d in decisions:
            tried = []
            for c in d.tried:
                for role, t in c.qweight.tensors.items():
                    tensors[f"{d.name}:{c.rung}:{role}"] = t.detach().contiguous().cpu()
                tried.append({"spec": c.qweight.spec.to_dict(), "shape": list(c.qweight.shape), "alpha": c.alpha,
                              "metrics": c.metrics})
            records.append({"name": d.name, "chosen": d.tried.index(d.chosen), "reasons": d.reasons, "tried": tried})
        self.wait()
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="squareq-state-write")
        self._pending = (index, pool.submit(self._write_block, index, tensors, {"layers": records, **info}))
        pool.shutdown(wait=False)  # the thread ends with its write

    def _write_block(self, index: int, tensors: dict, record: dict) -> None:
        data, meta = self._paths(index)
        parts = safetensors_parts(tensors)
        digest = hashlib.sha256()
        for part in parts:  # hashing and writing release the GIL: the next block's search goes on meanwhile
            digest.update(part)
        record = {**record, "sha256": digest.hexdigest()}
        record["record_sha256"] = _record_hash(record)
        # Tensors first, then the JSON that marks the block finished: both fsynced before their rename.
        atomic_write_parts(data, parts)
        atomic_write_bytes(meta, json.dumps(record, indent=1).encode())
        self._verified.add(index)

    def wait(self, index: int | None = None, quiet: bool = False) -> None:
        """Wait for the block being written (only if it is block ``index``, when given), raising its error unless
        ``quiet`` (a pass that failed already: its own error is the one to report)."""
        if self._pending is None or index not in (None, self._pending[0]):
            return
        pending, self._pending = self._pending[1], None
        try:
            pending.result()
        except Exception:
            if not quiet:
                raise

    def load_block(self, index: int, tensors: bool = True) -> tuple[list[LayerDecision], dict]:
        """A finished block's decisions. With ``tensors=False`` the candidates' tensors are meta-device
        stand-ins of the right dtype and shape: enough to plan sizes without reading the data."""
        self.wait(index)
        data, meta = self._paths(index)
        record = self._json(meta)
        record.pop("sha256", None)
        record.pop("record_sha256", None)
        stored = load_file(str(data)) if tensors else {}
        decisions = []
        for layer in record.pop("layers"):
            tried = []
            for c in layer["tried"]:
                spec, shape = QuantSpec.from_dict(c["spec"]), tuple(c["shape"])
                if tensors:
                    prefix = f"{layer['name']}:{spec.short_label}:"
                    qt = {k[len(prefix):]: v for k, v in stored.items() if k.startswith(prefix)}
                    qw = QuantizedWeight(spec, shape, qt)
                else:
                    qw = QuantizedWeight.placeholder(spec, shape)
                tried.append(Candidate(qw, c["alpha"], c["metrics"]))
            decisions.append(LayerDecision(layer["name"], tried[layer["chosen"]], tried, layer["reasons"]))
        return decisions, record

    def load_weights(self, index: int, wanted) -> dict[str, dict[str, QuantizedWeight]]:
        """Only the candidates ``wanted(name, rung)`` selects from a finished block, read from its file one tensor
        at a time (the effects pass needs the quantized rungs, the slab writer one rung per layer: reading every
        rung of every layer twice is most of a large model's state I/O)."""
        self.wait(index)
        data, meta = self._paths(index)
        out: dict[str, dict[str, QuantizedWeight]] = {}
        with safe_open(str(data), framework="pt", device="cpu") as f:
            for layer in self._json(meta)["layers"]:
                for c in layer["tried"]:
                    spec, shape = QuantSpec.from_dict(c["spec"]), tuple(c["shape"])
                    rung = spec.short_label
                    if wanted(layer["name"], rung):
                        prefix = f"{layer['name']}:{rung}:"
                        qt = {role: f.get_tensor(prefix + role) for role in tensor_layout(spec, shape)}
                        out.setdefault(layer["name"], {})[rung] = QuantizedWeight(spec, shape, qt)
        return out

    def save_effects(self, effects: dict, info: dict) -> None:
        data = {"effects": effects, "info": info}
        data["record_sha256"] = _record_hash(data)
        atomic_write_bytes(self.folder / "effects.json", json.dumps(data, indent=1).encode())

    def load_effects(self) -> tuple[dict[str, dict[str, float]], dict] | None:
        """The effects pass's results, or None when it has not finished or its file changed after it was written
        (then the pass runs again, and a line says so)."""
        path = self.folder / "effects.json"
        if not path.is_file():
            return None
        data = self._json(path)
        if not isinstance(data, dict) or data.pop("record_sha256", None) != _record_hash(data) \
                or not _effects_readable(data):
            self.echo(f"{path} changed after it was written; measuring the effects again.")
            path.unlink(missing_ok=True)
            return None
        return data["effects"], data["info"]

    def remove(self) -> None:
        self.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def _unreadable(record: dict, data: Path) -> str | None:
    """Why a block record whose hashes match cannot be read back (a record forged with its hashes, or written by
    another SquareQ), or None: each layer's candidates, and their tensors' dtypes and shapes in the tensors file."""
    try:
        with safe_open(str(data), framework="pt", device="cpu") as f:
            stored = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
        layers, fixed = record["layers"], record.get("fixed_bytes")
        _need(isinstance(layers, list) and type(fixed) is int and fixed >= 0, "layers or fixed_bytes")
        for layer in layers:
            tried, chosen = layer["tried"], layer["chosen"]
            _need(isinstance(layer["name"], str) and isinstance(layer["reasons"], list) and isinstance(tried, list)
                  and type(chosen) is int and 0 <= chosen < len(tried), "a layer's fields")
            for c in tried:
                spec, shape = QuantSpec.from_dict(c["spec"]), c["shape"]
                _need(isinstance(shape, list) and len(shape) == 2 and all(type(d) is int and d > 0 for d in shape)
                      and isinstance(c["alpha"], (int, float)) and isinstance(c["metrics"], dict), "a candidate")
                for role, (dtype, dims) in tensor_layout(spec, tuple(shape)).items():
                    found = stored.get(f"{layer['name']}:{spec.short_label}:{role}")
                    _need(found == (DTYPE_NAMES[dtype], tuple(dims)), f"the tensor {role}")
    except (KeyError, TypeError, ValueError, AttributeError, SpecError, SafetensorError) as exc:
        return f"have a record this SquareQ cannot read ({type(exc).__name__}: {' '.join(str(exc).split())[:80]})"
    return None


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"{what} does not match the tensors file")


def _effects_readable(data: dict) -> bool:
    """Whether an effects record holds finite numbers by layer and rung, and its measurement's info."""
    effects = data.get("effects")
    return isinstance(effects, dict) and isinstance(data.get("info"), dict) and all(
        isinstance(rungs, dict) and all(isinstance(e, (int, float)) and math.isfinite(e) for e in rungs.values())
        for rungs in effects.values())
