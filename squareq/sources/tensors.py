"""Lazy reads of a checkpoint's tensors, seen under the model's own (diffusers/transformers) names.

A ``Tensors`` knows every tensor's name and shape from the file headers alone and reads only the tensors asked for:
a built-in model's state dict, one or several (sharded) safetensors files read through a mmap, a BFL single-file
FLUX.1 checkpoint converted tensor by tensor, a checkpoint whose names carry (or lack) its base model's prefix, or
shapes only, for a model whose weights are not fetched yet. Every tensor read is checked for NaN/Inf.
"""
from __future__ import annotations

import contextlib
import hashlib
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from ..models import ModelError, flux_bfl
from .file_kind import unreadable

MISMATCH = "the checkpoint does not match its config"


def few(names: Iterable[str], n: int = 3) -> str:
    """The first ``n`` names in order, and how many more, for a sentence."""
    names = sorted(names)
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def _check_finite(t: torch.Tensor, name: str, file) -> torch.Tensor:
    if t.is_floating_point() and t.numel():
        values = t if t.element_size() > 1 else t.float()  # float8 has no aminmax kernel on the CPU
        # the least and the greatest value: NaN if any is (aminmax propagates it), ±Inf if any is; one pass at memory
        # speed, where isfinite(t).all() writes a mask and runs 30x slower on a bf16 CPU tensor (the whole source is
        # checked before a compile calibrates: Source.check_finite)
        lo, hi = torch.aminmax(values)
        if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
            kind = "NaN" if bool(torch.isnan(lo) or torch.isnan(hi)) else "Inf"
            raise ModelError(f"tensor {name} in {file} contains {kind} values, so the checkpoint is damaged; "
                             "re-download or re-export it.")
    return t


@contextlib.contextmanager
def _safe_open(path: Path):
    from safetensors import safe_open

    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise ModelError(f"{unreadable(path, exc)}; re-download or re-export it.") from None
    with handle as h:
        yield h


def header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with _safe_open(path) as h:
        return {k: tuple(int(d) for d in h.get_slice(k).get_shape()) for k in h.keys()}


class Tensors:
    """A checkpoint seen under the skeleton's (diffusers/transformers) tensor names."""

    label: str  # the file or folder, for messages
    shapes: dict[str, tuple[int, ...]]

    def file_of(self, name: str) -> str:
        return self.label

    def display(self, name: str) -> str:
        """How the checkpoint itself names ``name``."""
        return name

    def identity(self) -> list:
        """What identifies these weights without reading them all: files with size and modification time."""
        return [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in self.files()]

    def files(self) -> list[Path]:
        return []

    def read(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        raise NotImplementedError


class MemoryTensors(Tensors):
    """A built-in model's state dict; read returns copies so callers never alias the built model."""

    def __init__(self, state: Mapping[str, torch.Tensor], label: str):
        self.state, self.label = dict(state), label
        self.shapes = {k: tuple(v.shape) for k, v in self.state.items()}

    def identity(self) -> list:
        h = hashlib.sha256()  # in memory, so small: hash the values themselves
        for name in sorted(self.state):
            h.update(name.encode())
            h.update(self.state[name].detach().float().contiguous().numpy().tobytes())
        return [h.hexdigest()]

    def read(self, names):
        return {n: _check_finite(self.state[n].detach().clone(), n, self.label) for n in names}


class SafetensorsFiles(Tensors):
    """One or several (sharded) safetensors files whose names are already the model's."""

    def __init__(self, files: Sequence[Path], label: str):
        self.label = label
        self.shapes, self._file = {}, {}
        for f in files:
            for k, shape in header_shapes(f).items():
                self.shapes[k], self._file[k] = shape, f

    def file_of(self, name):
        return str(self._file.get(name, self.label))

    def files(self) -> list[Path]:
        return sorted(set(self._file.values()))

    def read(self, names):
        by_file: dict[Path, list[str]] = defaultdict(list)
        for n in names:
            by_file[self._file[n]].append(n)
        out = {}
        for f, group in by_file.items():
            with _safe_open(f) as h:
                for n in group:
                    out[n] = _check_finite(h.get_tensor(n), n, f)
        return out


class BFLFile(Tensors):
    """A BFL single-file FLUX.1 checkpoint mapped to diffusers names, tensor by tensor."""

    def files(self) -> list[Path]:
        return [self.path]

    def __init__(self, path: Path, prefix: str, shapes: Mapping[str, tuple[int, ...]]):
        self.path, self.label = path, str(path)
        raw = {k[len(prefix):]: k for k in shapes if k.startswith(prefix)}  # BFL name -> key in the file
        unknown = [n for n in raw if not flux_bfl.is_bfl_name(n)]
        if unknown:
            raise ModelError(f"{path} has {len(unknown)} tensors that are not BFL FLUX.1 names ({few(unknown)}); "
                             f"{MISMATCH}.")
        self._key = raw
        bfl_shapes = {n: shapes[k] for n, k in raw.items()}
        self.config = flux_bfl.infer_bfl_config(bfl_shapes, where=str(path))
        self.shapes, self._origin = {}, {}
        for n, shape in bfl_shapes.items():  # map shapes on the meta device: no data is read
            for d, t in self._convert({n: torch.empty(shape, device="meta")}).items():
                self.shapes[d], self._origin[d] = tuple(t.shape), n

    def _convert(self, raw):
        try:
            return flux_bfl.bfl_to_diffusers(raw, self.config)
        except ModelError as exc:
            raise ModelError(f"{self.path}: {exc}") from None

    def display(self, name):
        bfl = self._origin.get(name) or flux_bfl.bfl_name(name)
        return f"{bfl} (diffusers {name})"

    def read(self, names):
        needed = sorted({self._origin[n] for n in names})
        with _safe_open(self.path) as h:
            raw = {b: _check_finite(h.get_tensor(self._key[b]), self._key[b], self.path) for b in needed}
        converted = self._convert(raw)
        return {n: converted[n] for n in names}


class Renamed(Tensors):
    """A checkpoint seen with its base model's prefix (``bert.``) added to or taken off its names, as
    ``from_pretrained`` sees it."""

    def __init__(self, inner: Tensors, add: str = "", strip: str = ""):
        self.inner, self.label = inner, inner.label
        # taking the prefix off leaves the head's tensors under their own names: extras, left out with a warning
        self._key = {(k[len(strip):] if strip and k.startswith(strip) else add + k): k for k in inner.shapes}
        self.shapes = {n: inner.shapes[k] for n, k in self._key.items()}

    def file_of(self, name):
        return self.inner.file_of(self._key.get(name, name))

    def display(self, name):
        return self.inner.display(self._key.get(name, name))

    def identity(self) -> list:
        return self.inner.identity()

    def files(self) -> list[Path]:
        return self.inner.files()

    def read(self, names):
        got = self.inner.read([self._key[n] for n in names])
        return {n: got[self._key[n]] for n in names}


class ShapesOnly(Tensors):
    """A model's own tensor names and shapes, no data: a source to plan for before its weights are fetched."""

    def __init__(self, skeleton: nn.Module, label: str):
        self.label = label
        self.shapes = {n: tuple(t.shape) for n, t in skeleton.state_dict(keep_vars=True).items()}

    def read(self, names):
        raise ModelError(f"{self.label}: its weights are not fetched yet.")

