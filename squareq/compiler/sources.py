"""Where the compiler reads a model from, one block at a time.

``open_source(MODEL)`` accepts a built-in name (``tiny-flux``), a diffusers pipeline folder (its ``transformer/`` is
used) or model folder, a transformers model folder, a BFL single-file FLUX.1 checkpoint, or a Hugging Face Hub ID of
a pipeline or model (squareq.models.hub: from the local cache, or downloading only the files the compile reads). It
builds the model's own class on the meta device (the skeleton), checks every tensor name and shape in the checkpoint
headers against it, and then reads weights lazily: ``load_block`` reads only that block's tensors through a
safetensors mmap, so host memory stays near one block and the whole model never has to fit anywhere. Every tensor
read is checked for NaN/Inf.

Bad input raises ``ModelError`` with one sentence naming the file or tensor and what to do.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import logging
import os
import re
import types
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..models import BUILTIN_MODELS, FamilyAdapter, ModelError, adapter_for, flux_bfl, hub, load_builtin
from ..models.base import PIPELINE_DENOISER, diffusers_class, read_json_object
from ..models.local_files import refuse_pickled
from ..models.skeleton import build_meta, place_tensor
from ..slab.signature import model_signature

__all__ = ["Source", "open_source"]

log = logging.getLogger("squareq.compiler")

_WHAT_TO_PASS = "pass a Hugging Face Hub ID, a diffusers folder, a BFL .safetensors file or tiny-flux"
_MISMATCH = "the checkpoint does not match its config"


def _few(names: Iterable[str], n: int = 3) -> str:
    names = sorted(names)
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


# --------------------------------------------------------------------------- skeletons


def _alias_groups(model: nn.Module) -> dict[str, list[str]]:
    """Parameter names that share one tensor (tied weights), each name -> its whole group."""
    by_tensor: dict[int, list[str]] = defaultdict(list)
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor[id(p)].append(name)
    return {name: names for names in by_tensor.values() if len(names) > 1 for name in names}


# --------------------------------------------------------------------------- checkpoints


def _check_finite(t: torch.Tensor, name: str, file) -> torch.Tensor:
    if t.is_floating_point():
        values = t if t.element_size() > 1 else t.float()  # float8 has no isfinite kernel everywhere
        if not bool(torch.isfinite(values).all()):
            kind = "NaN" if bool(torch.isnan(values).any()) else "Inf"
            raise ModelError(f"tensor {name} in {file} contains {kind} values, so the checkpoint is damaged; "
                             "re-download or re-export it.")
    return t


@contextlib.contextmanager
def _safe_open(path: Path):
    from safetensors import safe_open

    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise ModelError(f"{path} is not a readable safetensors file ({exc}); re-download or re-export it.") from None
    with handle as h:
        yield h


def _header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with _safe_open(path) as h:
        return {k: tuple(int(d) for d in h.get_slice(k).get_shape()) for k in h.keys()}


class _Tensors:
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


class _MemoryTensors(_Tensors):
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


class _SafetensorsFiles(_Tensors):
    """One or several (sharded) safetensors files whose names are already the model's."""

    def __init__(self, files: Sequence[Path], label: str):
        self.label = label
        self.shapes, self._file = {}, {}
        for f in files:
            for k, shape in _header_shapes(f).items():
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


class _BFLFile(_Tensors):
    """A BFL single-file FLUX.1 checkpoint mapped to diffusers names, tensor by tensor."""

    def files(self) -> list[Path]:
        return [self.path]

    def __init__(self, path: Path, prefix: str, shapes: Mapping[str, tuple[int, ...]]):
        self.path, self.label = path, str(path)
        raw = {k[len(prefix):]: k for k in shapes if k.startswith(prefix)}  # BFL name -> key in the file
        unknown = [n for n in raw if not flux_bfl.is_bfl_name(n)]
        if unknown:
            raise ModelError(f"{path} has {len(unknown)} tensors that are not BFL FLUX.1 names ({_few(unknown)}); "
                             f"{_MISMATCH}.")
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


class _Renamed(_Tensors):
    """A checkpoint seen with its base model's prefix (``bert.``) added to or taken off its names, as
    ``from_pretrained`` sees it."""

    def __init__(self, inner: _Tensors, add: str = "", strip: str = ""):
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


def _fit_base_prefix(skeleton: nn.Module, tensors: _Tensors, chosen: bool) -> tuple[nn.Module, _Tensors]:
    """Match a transformers checkpoint saved from the base model to a head class, or the reverse, as
    ``from_pretrained`` does: the base model's prefix is added to or taken off the checkpoint's names. A checkpoint
    with none of the head's tensors under a config naming a head class (sentence-transformers models) builds the base
    model instead, as ``AutoModel`` does, unless ``chosen`` (--model-class): a slab must not keep a random head."""
    from transformers import PreTrainedModel

    prefix = getattr(skeleton, "base_model_prefix", "")
    if not isinstance(skeleton, PreTrainedModel) or not isinstance(prefix, str) or not prefix:
        return skeleton, tensors
    dot, expected = prefix + ".", list(skeleton.state_dict(keep_vars=True))
    has, expects = any(k.startswith(dot) for k in tensors.shapes), any(n.startswith(dot) for n in expected)
    if has and not expects:
        return skeleton, _Renamed(tensors, strip=dot)
    if not expects or has:
        return skeleton, tensors
    base = getattr(skeleton, prefix, None)
    head = [n for n in expected if not n.startswith(dot)]
    if not chosen and isinstance(base, PreTrainedModel) and not any(n in tensors.shapes for n in head):
        log.info("%s holds a %s without its head, so it is compiled as %s, as AutoModel loads it.", tensors.label,
                 type(skeleton).__name__, type(base).__name__)
        return _built_base(base), tensors
    return skeleton, _Renamed(tensors, add=dot)


def _base_for_blocks(skeleton: nn.Module, blocks) -> nn.Module:
    """Before a Hub repository's weights are fetched, which class it compiles as is a guess: the base model when
    ``blocks`` name lists of the base and not of the head class its config names (a sentence-transformers model)."""
    prefix = getattr(skeleton, "base_model_prefix", "")
    base = getattr(skeleton, prefix, None) if isinstance(prefix, str) and prefix else None
    names = [blocks] if isinstance(blocks, str) else list(blocks or ())
    if base is None or not names or not isinstance(base, nn.Module) or base is skeleton:
        return skeleton
    with contextlib.suppress(AttributeError):
        for n in names:
            skeleton.get_submodule(n.strip())
        return skeleton
    return _built_base(base)


def _built_base(base: nn.Module) -> nn.Module:
    """The base model's class built afresh from its config, not copied out of the head class: a head may build its
    base without parts the base class has (BERT's masked-LM head leaves out the pooler)."""
    return build_meta(lambda: type(base)(base.config))


def _folder_weights(folder: Path) -> list[Path]:
    """The safetensors files of a model folder: the index's shards, else the one weights file."""
    indexes = sorted(folder.glob("*.safetensors.index.json"), key=lambda p: (len(p.name), p.name))
    if indexes:
        index = indexes[0]  # shortest name: the variant-free index when fp16 variants sit beside it
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise ModelError(f"{index} is not a safetensors index (no weight_map); re-save the model.") from None
        files = [folder / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelError(f"{index} lists the shard {f.name}, which is not in {folder}; copy the missing shard.")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if len(files) > 1:
        standard = [f for f in files if f.name in ("diffusion_pytorch_model.safetensors", "model.safetensors")]
        if len(standard) != 1:
            raise ModelError(f"{folder} holds several safetensors files ({_few(f.name for f in files)}) and no "
                             "*.safetensors.index.json; keep one weights file or add the index.")
        files = standard
    if not files:
        refuse_pickled(folder)
        raise ModelError(f"{folder} has no *.safetensors weights; {_WHAT_TO_PASS}.")
    return files


# --------------------------------------------------------------------------- the source


class Source:
    """A model to compile: its skeleton on the meta device and lazy, checked access to its weights."""

    def __init__(self, description: str, skeleton: nn.Module, tensors: _Tensors,
                 blocks: Sequence[str] | None = None):
        self.description = description
        self.pipeline: Path | None = None  # the diffusers pipeline folder around the model, if any
        self.folder: Path | None = None  # the model's own folder (config.json, tokenizer files), if it has one
        self.hub: hub.HubRef | None = None  # the Hub repository and commit it came from, if it came from the Hub
        self._skeleton = skeleton
        self._tensors = tensors
        self.adapter = _adapter(skeleton, blocks, description)
        self.family = self.adapter.family
        self.family_adapter = _family_of(skeleton)  # the model class's family, in generic mode too (None: unknown)
        self.ignored: list[str] = []  # checkpoint tensors the model's class does not have, left out as it would
        self.block_paths = self.adapter.blocks(skeleton)
        for a in self.block_paths:
            for b in self.block_paths:
                if b.startswith(a + "."):
                    raise ModelError(f"block {b} lies inside block {a}; pass block lists that do not nest.")
        self._expected = {n: tuple(t.shape) for n, t in skeleton.state_dict(keep_vars=True).items()}
        self._aliases = _alias_groups(skeleton)
        self._key = self._bind()

    def __repr__(self) -> str:
        return f"Source({self.description!r}, family={self.family!r}, blocks={len(self.block_paths)})"

    @property
    def encoder_source(self) -> str | None:
        """Where the family's VAE and text encoders are: the built-in model's name, the pipeline folder or its Hub ID,
        or None."""
        if self.description in BUILTIN_MODELS:
            return self.description
        if self.pipeline is None:
            return None
        return str(self.hub) if self.hub is not None else str(self.pipeline)

    # -- checks, at open time, from headers only

    def _bind(self) -> dict[str, str]:
        """Map each skeleton tensor to its checkpoint tensor the way the model's library loads it: a misshapen tensor
        is refused; a tensor the class declares ignorable, or a legacy copy of one of its buffers, is left out
        quietly; any other extra tensor is left out with a warning (``self.ignored``), as ``from_pretrained`` does.
        A missing tensor is refused unless the class declares it optional or it is tied to one that is there:
        ``from_pretrained`` would initialize it randomly, which a quantized slab must not silently keep."""
        t, cls = self._tensors, type(self._skeleton).__name__
        optional = _patterns(self._skeleton, "_keys_to_ignore_on_load_missing")
        key, missing = {}, []
        for name, shape in self._expected.items():
            candidates = [name] + [a for a in self._aliases.get(name, ()) if a != name]
            found = next((c for c in candidates if c in t.shapes), None)
            if found is None:
                if not any(p.search(name) for p in optional):
                    missing.append(name)
                continue
            if t.shapes[found] != shape:
                raise ModelError(f"tensor {t.display(found)} in {t.file_of(found)} has shape {list(t.shapes[found])}, "
                                 f"but {cls} with this config expects {list(shape)}; {_MISMATCH}.")
            key[name] = found
        ignore = _patterns(self._skeleton, "_keys_to_ignore_on_load_unexpected") + _legacy_buffers(self._skeleton)
        extra = [n for n in set(t.shapes) - set(key.values()) if not any(p.search(n) for p in ignore)]
        if missing:
            held = _few(t.display(n) for n in extra) or "none"
            raise ModelError(f"{t.label} has no tensor {t.display(missing[0])}, which {cls} with this config expects "
                             f"({len(missing)} missing in all, e.g. {_few(missing)}; tensors it holds that {cls} does "
                             f"not have: {held}); {_MISMATCH}: pass the class it was saved from with --model-class "
                             "or fix its config.json.")
        self.ignored = sorted(t.display(n) for n in extra)
        if extra:
            log.warning("%s has %d tensors that %s with this config does not have (%s); they are left out, as "
                        "from_pretrained leaves them out. If the checkpoint should match, check its config.json.",
                        t.label, len(extra), cls, _few(self.ignored))
        return key

    # -- the API the compiler uses

    def fingerprint(self) -> str:
        """Changes when the weights may have: the description, the model signature and each weight file's path, size
        and modification time (an in-memory built-in model: a hash of its values)."""
        parts = [self.description, model_signature(self._skeleton), self._tensors.identity()]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]

    def skeleton(self) -> nn.Module:
        """The model's own class built from its config on the meta device.

        The build is cached; each call returns a fresh copy of it, so a caller may install tensors in it or
        swap its blocks without changing what ``load_block`` and later ``skeleton()`` calls see.
        """
        return copy.deepcopy(self._skeleton)

    def load_block(self, path: str, device="cpu", dtype: torch.dtype | None = torch.float32,
                   linear_weights: bool = True, upcast_linears: bool = False) -> nn.Module:
        """A real copy of the module at ``path`` with weights read from the checkpoint (only its tensors).

        Floating tensors are cast to ``dtype`` (None keeps the checkpoint's dtype). ``linear_weights=False`` leaves
        the weights of its ``nn.Linear`` layers unread, on the meta device (the slab writer needs only the rest).
        ``upcast_linears=True`` keeps those weights in the checkpoint's dtype and casts each to ``dtype`` only while
        its layer runs: the same results as a block cast whole (the cast is exact), with one layer at a time in
        ``dtype`` instead of the block (a FLUX.2 double block is 3.9 GB in float32, 2 GB in bf16). Its parameters
        take no gradient.
        """
        try:
            template = self._skeleton.get_submodule(path)
        except AttributeError:
            raise ModelError(f"{type(self._skeleton).__name__} has no module {path!r}; its {len(self.block_paths)} "
                             f"blocks run from {self.block_paths[0]} to {self.block_paths[-1]}.") from None
        prefix = path + "."
        names = [n for n in self._expected if n.startswith(prefix)]
        module = copy.deepcopy(template)
        linears = {f"{rel}.weight" for rel, m in template.named_modules() if isinstance(m, nn.Linear)}
        unread = set() if linear_weights else {prefix + n for n in linears}
        _materialize(module, self._read([n for n in names if n not in unread], strip=prefix), device, dtype,
                     unread={n[len(prefix):] for n in unread}, keep=linears if upcast_linears else frozenset())
        if upcast_linears and dtype is not None:
            _upcast([m for m in module.modules() if isinstance(m, nn.Linear)])
        # frozen: the source is read, never trained (a backward pass through a block would also compute, and hold,
        # a gradient for every weight)
        return module.requires_grad_(False)

    def resident_state(self, device="cpu", dtype: torch.dtype | None = torch.float32,
                       keep: frozenset = frozenset()) -> dict[str, torch.Tensor]:
        """Every state-dict entry outside the streamed blocks, under the model's own names (those in ``keep`` in
        the checkpoint's dtype)."""
        prefixes = tuple(p + "." for p in self.block_paths)
        names = [n for n in self._expected if not n.startswith(prefixes)]
        return {n: _convert(t, device, None if n in keep else dtype) for n, t in self._read(names).items()}

    def load_model(self, device="cpu", dtype: torch.dtype | None = torch.float32) -> nn.Module:
        """The whole model materialized (small models and tests only)."""
        model = copy.deepcopy(self._skeleton)
        _materialize(model, self._read(list(self._expected)), device, dtype)
        return model

    def shell(self, run_block: Callable[[int, str, tuple, dict], Any], device="cpu",
              dtype: torch.dtype = torch.float32, upcast_linears: bool = False) -> nn.Module:
        """The model with its resident tensors loaded and each streamed block replaced by a stand-in that calls
        ``run_block(index, path, args, kwargs)``: the model's own forward, one block at a time, with the
        caller deciding what a block computes (the compiler quantizes it, ``squareq accept`` measures it).
        ``upcast_linears``: the resident linear layers keep the checkpoint's dtype and run in ``dtype``, as
        :meth:`load_block` does (FLUX.2's modulation and embedding layers are 3.3 GB in float32)."""
        model = self.skeleton()  # a fresh copy: the source keeps its own to copy blocks from
        prefixes = tuple(p + "." for p in self.block_paths)
        linears = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)
                   and not f"{n}.".startswith(prefixes)} if upcast_linears else frozenset()
        tracing = torch.device(device).type == "meta"  # shapes only: the skeleton's meta tensors are the residents
        state = {} if tracing else self.resident_state(device, dtype, keep=frozenset(linears))
        for name, t in state.items():
            place_tensor(model, name, t)
        _upcast([model.get_submodule(name.rpartition(".")[0]) for name in linears])
        for i, path in enumerate(self.block_paths):
            owner, _, idx = path.rpartition(".")
            model.get_submodule(owner)[int(idx)] = _BlockStandIn(run_block, i, path, model.get_submodule(path))
        if not tracing:  # buffers the class builds on the host and no checkpoint holds (BERT's token_type_ids)
            for sub in model.modules():
                for name, buf in sub._buffers.items():
                    if buf is not None and not buf.is_meta and buf.device != torch.device(device):
                        sub._buffers[name] = _convert(buf, device, dtype)
        left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
        if left and not tracing:
            raise ModelError(f"{self.description}: tensors outside the blocks were not found in the checkpoint "
                             f"({', '.join(left[:3])}); check the checkpoint and --blocks.")
        return model.eval()

    def _read(self, names: Sequence[str], strip: str = "") -> dict[str, torch.Tensor]:
        keys = {n: self._key[n] for n in names}
        tensors = self._tensors.read(sorted(set(keys.values())))
        return {n[len(strip):]: tensors[k] for n, k in keys.items()}


class _BlockStandIn(nn.Module):
    """Stands in for one streamed block inside the model's own forward (see :meth:`Source.shell`).

    Other attributes read through to the block's skeleton (weights on meta), because some forwards inspect their
    blocks: a UNet counts ``up_block.resnets`` and asks ``has_cross_attention``; and ``isinstance`` sees the block's
    class, because Würstchen picks each block's arguments by its class."""

    def __init__(self, run_block, index: int, path: str, template: nn.Module) -> None:
        super().__init__()
        self._run_block = run_block
        self.index = index
        self.path = path
        object.__setattr__(self, "_template", template)  # not a submodule: its meta tensors are no part of the shell

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_template"], name)

    @property
    def __class__(self):  # noqa: PLE0241 - isinstance() consults __class__ when the real type does not match
        return type(self.__dict__["_template"])

    def forward(self, *args, **kwargs):
        return self._run_block(self.index, self.path, args, kwargs)


def _patterns(model: nn.Module, attr: str) -> list[re.Pattern]:
    """The regular expressions a model class (and, as transformers collects them, its submodules) declares in
    ``attr`` (``_keys_to_ignore_on_load_unexpected`` / ``_keys_to_ignore_on_load_missing``)."""
    found = set()
    for module in model.modules():
        found.update(getattr(module, attr, None) or ())
    return [re.compile(p) for p in sorted(found)]


def _legacy_buffers(model: nn.Module) -> list[re.Pattern]:
    """Checkpoint names of buffers the model class keeps out of its state dict (``position_ids``, rotary
    ``inv_freq``): older checkpoints saved them, and the libraries skip them on load (transformers by name wherever
    such a buffer now lives, since it may have moved)."""
    persistent = set(model.state_dict(keep_vars=True))
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_buffers() if n not in persistent}
    return [re.compile(rf"(^|\.){re.escape(n)}$") for n in sorted(names)]


def _family_of(skeleton: nn.Module) -> FamilyAdapter | None:
    try:
        return adapter_for(skeleton)
    except ModelError:
        return None


def _convert(t: torch.Tensor, device, dtype) -> torch.Tensor:
    """``t`` on ``device``, floating tensors in ``dtype`` (None: as stored), always in an allocation of its own. A
    tensor read through the safetensors mmap sits wherever its file put it, a split BFL projection at an offset into
    the fused one, and a CPU matmul on such an address takes another path: the same model read from a BFL file and
    from a diffusers folder gave outputs 1.2e-6 apart, and a compile's measured effects with them, until both were
    copied."""
    return t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype, copy=True)


class _UpcastLinear(torch.autograd.Function):
    """``linear(x, weight.to(x.dtype), bias)`` for a frozen weight, returning the input's gradient only (the
    weight and bias take none), with the weight saved as stored: autograd would keep the cast copy for the backward
    pass, a float32 copy of every layer of the block (measured: 5 GB of a FLUX.2 block's effects pass)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(weight)
        return torch.nn.functional.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return grad @ weight.to(grad.dtype), None, None


def _upcast_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    frozen = not (self.weight.requires_grad or (self.bias is not None and self.bias.requires_grad))
    if frozen and torch.is_grad_enabled() and x.requires_grad:
        return _UpcastLinear.apply(x, self.weight, self.bias)
    return torch.nn.functional.linear(x, self.weight.to(x.dtype), self.bias)


def _upcast(linears: Iterable[nn.Linear]) -> None:
    """Each linear casts its weight to its input's dtype while it runs (the weight stays as stored)."""
    for mod in linears:
        # bound to a weak proxy: a method bound to the module itself, kept in the module, is a reference cycle, and
        # a loaded block would then wait for the garbage collector (measured: the previous 2 GB FLUX.2 block still
        # held while the next one was searched)
        mod.forward = types.MethodType(_upcast_forward, weakref.proxy(mod))


def _materialize(module: nn.Module, state: Mapping[str, torch.Tensor], device, dtype, unread=frozenset(),
                 keep=frozenset()) -> None:
    """Give a meta-device module real tensors: ``state`` for its state dict (all of it but ``unread``, which stays on
    the meta device; those in ``keep`` in their own dtype), moved non-persistent buffers."""
    aliases = _alias_groups(module)
    result = module.load_state_dict({n: _convert(t, device, None if n in keep else dtype) for n, t in state.items()},
                                    strict=False, assign=True)
    if set(result.missing_keys) != set(unread) or result.unexpected_keys:
        raise ModelError(f"{type(module).__name__}: the tensors read do not match its state dict (missing "
                         f"{_few(set(result.missing_keys) - set(unread))}, unexpected {_few(result.unexpected_keys)}).")
    for names in {tuple(g) for g in aliases.values()}:  # assign=True unties shared parameters; tie them again
        shared = module.get_parameter(names[0])
        for name in names[1:]:
            place_tensor(module, name, shared)
    for sub in module.modules():  # non-persistent buffers were built real on the host
        for name, buf in sub._buffers.items():
            if buf is not None and not buf.is_meta:
                sub._buffers[name] = _convert(buf, device, dtype)
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    left = [n for n, t in tensors if t.is_meta and n not in unread]
    if left:
        raise ModelError(f"{type(module).__name__} still has tensors on the meta device after loading ({_few(left)}).")


def _adapter(skeleton: nn.Module, blocks: Sequence[str] | None, where: str) -> FamilyAdapter:
    cls = type(skeleton).__name__
    try:
        family = adapter_for(skeleton)
    except ModelError:
        family = None
    if blocks:  # generic mode; a known family still lends its calibration inputs
        attrs = tuple(b.strip() for b in ([blocks] if isinstance(blocks, str) else blocks) if b.strip())
        generic = FamilyAdapter(family="generic", class_name=cls, block_lists=attrs)
        return dataclasses.replace(generic, calibration_inputs=family.calibration_inputs) if family else generic
    if family is None:
        lists: list[str] = []  # the outermost non-empty ModuleLists, as a hint
        for n, m in skeleton.named_modules():
            if isinstance(m, nn.ModuleList) and len(m) and not any(n.startswith(o + ".") for o in lists):
                lists.append(n)
        lists = lists[:3]
        hint = f" (its nn.ModuleLists include {', '.join(lists)})" if lists else ""
        raise ModelError(f"{where} is a {cls}, which has no SquareQ family adapter; pass --blocks ATTR naming the "
                         f"nn.ModuleList that holds its blocks{hint}.")
    return family


# --------------------------------------------------------------------------- opening


def _chosen_class(name: str, library: str, lookup: Callable[[str], Any], base: type) -> type:
    """The class --model-class names, from ``library`` (``lookup`` finds it by name; ``base``: what it must be)."""
    cls = lookup(name) if name.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ModelError(f"--model-class {name} names no {library} model class; pass one such as "
                         f"{'BertModel' if library == 'transformers' else 'FluxTransformer2DModel'}, or leave "
                         "--model-class out to build the class config.json names.")
    return cls


def _built_as(name: str, folder: Path, build: Callable[[], nn.Module]) -> nn.Module:
    """The --model-class ``name`` built from ``folder``'s config; a class of another model type fails in its own
    constructor, which becomes one sentence."""
    try:
        return build_meta(build)
    except Exception as exc:  # noqa: BLE001 - whatever that class's constructor raises for a foreign config
        raise ModelError(f"--model-class {name} cannot be built from {folder / 'config.json'} ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:100]}); pass a class of that config's model type, or leave "
                         "--model-class out.") from None


def _diffusers_skeleton(folder: Path, config: dict, model_class: str | None = None) -> nn.Module:
    import diffusers

    if model_class:
        cls = _chosen_class(model_class, "diffusers", diffusers_class, diffusers.ModelMixin)
        return _built_as(model_class, folder, lambda: cls.from_config(config))
    name = config["_class_name"]
    cls = diffusers_class(name)
    if cls is None or not hasattr(cls, "from_config"):
        raise ModelError(f"{folder / 'config.json'} names the class {name!r}, which diffusers "
                         f"{diffusers.__version__} does not have; upgrade diffusers or {_WHAT_TO_PASS}.")
    return build_meta(lambda: cls.from_config(config))


def _transformers_skeleton(folder: Path, model_class: str | None = None) -> nn.Module:
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:
        raise ModelError(f"transformers cannot read {folder / 'config.json'} ({exc}); upgrade transformers "
                         "or fix the config.") from None
    if model_class:
        cls = _chosen_class(model_class, "transformers", lambda n: getattr(transformers, n, None),
                            transformers.PreTrainedModel)
        return _built_as(model_class, folder, lambda: cls(config))
    for arch in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, arch, None) if isinstance(arch, str) and arch.isidentifier() else None
        if cls is not None:
            return build_meta(lambda cls=cls: cls(config))
    try:
        return build_meta(lambda: transformers.AutoModel.from_config(config))
    except ValueError as exc:
        raise ModelError(f"transformers has no model class for {folder / 'config.json'} ({exc}).") from None


def _folder_model(folder: Path, model_class: str | None = None) -> tuple[nn.Module, Path, Path | None]:
    """The model a folder holds, built on the meta device from its config alone (as ``model_class`` when given): the
    skeleton, the model's own folder (a pipeline's ``transformer/``) and the pipeline folder around it (None when
    there is none)."""
    pipeline = None
    if (folder / "model_index.json").is_file():
        if not (folder / PIPELINE_DENOISER).is_dir():
            raise ModelError(f"{folder} is a pipeline folder without transformer/; pass one of its component "
                             f"folders (e.g. {folder / 'text_encoder'}) with --blocks ATTR.")
        pipeline, folder = folder, folder / PIPELINE_DENOISER
    elif (folder.parent / "model_index.json").is_file():
        pipeline = folder.parent
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{folder} has no config.json, so it is not a diffusers or transformers model folder; "
                         f"{_WHAT_TO_PASS}.")
    config = read_json_object(config_file, "re-save the model")
    if "_class_name" in config:
        return _diffusers_skeleton(folder, config, model_class), folder, pipeline
    if "architectures" in config or "model_type" in config:
        return _transformers_skeleton(folder, model_class), folder, pipeline
    raise ModelError(f"{config_file} has neither _class_name (diffusers) nor architectures/model_type "
                     f"(transformers); {_WHAT_TO_PASS}.")


def _open_folder(folder: Path, blocks, model_class: str | None = None) -> Source:
    skeleton, folder, pipeline = _folder_model(folder, model_class)
    tensors = _SafetensorsFiles(_folder_weights(folder), label=str(folder))
    skeleton, tensors = _fit_base_prefix(skeleton, tensors, chosen=bool(model_class))
    source = Source(str(folder), skeleton, tensors, blocks)
    source.pipeline, source.folder = pipeline, folder
    return source


def _open_file(path: Path, blocks) -> Source:
    if path.suffix != ".safetensors":
        raise ModelError(f"{path} is not a .safetensors file; SquareQ reads safetensors only, so convert it "
                         f"first or {_WHAT_TO_PASS}.")
    shapes = _header_shapes(path)
    prefix = flux_bfl.bfl_key_prefix(shapes)
    if prefix is None:
        raise ModelError(f"{path} is not a BFL FLUX.1 checkpoint (it has no double_blocks.0.img_attn.qkv.weight); "
                         "pass its diffusers or transformers model folder (with config.json) instead.")
    tensors = _BFLFile(path, prefix, shapes)
    from diffusers import FluxTransformer2DModel

    skeleton = build_meta(lambda: FluxTransformer2DModel(**tensors.config))
    return Source(f"{path} (BFL single file)", skeleton, tensors, blocks)


def _open_builtin(name: str, blocks) -> Source:
    model, _ = load_builtin(name)
    # parameters on meta, buffers real, as build_meta makes them: non-persistent buffers (rotary tables) are
    # in no checkpoint, so the skeleton must keep their values
    skeleton = copy.deepcopy(model).eval()
    for module in skeleton.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                module._parameters[attr] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
    return Source(name, skeleton, _MemoryTensors(model.state_dict(), label=f"built-in {name}"), blocks)


class _ShapesOnly(_Tensors):
    """A model's own tensor names and shapes, no data: a source to plan for before its weights are fetched."""

    def __init__(self, skeleton: nn.Module, label: str):
        self.label = label
        self.shapes = {n: tuple(t.shape) for n, t in skeleton.state_dict(keep_vars=True).items()}

    def read(self, names):
        raise ModelError(f"{self.label}: its weights are not fetched yet.")


def _open_hub(ref: hub.HubRef, blocks, check, model_class: str | None = None) -> Source:
    """A Hub repository: a pipeline's transformer (its VAE and text encoders are fetched where they are loaded,
    squareq.train.encoder_source), or a one-model repository's configs, tokenizer and weights. The configs come
    first, so ``check`` can refuse the model before gigabytes of weights are downloaded. The source is named by the
    commit it resolved to, and every fetch reads that commit."""
    folder, index = hub.index_of(ref)
    ref = hub.resolved(ref, folder)
    if index is None:
        configs, weights = ["*.json"], hub.MODEL_FILES
    else:
        if PIPELINE_DENOISER not in hub.pipeline_components(index, (PIPELINE_DENOISER,)):
            raise ModelError(f"{ref} is a {index.get('_class_name', 'pipeline')} without a transformer/ component, "
                             "which SquareQ compiles from a pipeline; download it and pass its denoiser's folder with "
                             "--blocks ATTR.")
        configs, weights = hub.pipeline_patterns([], [PIPELINE_DENOISER]), hub.pipeline_patterns([PIPELINE_DENOISER])
    if check is not None:
        skeleton = _folder_model(hub.fetch(ref, configs), model_class)[0]
        skeleton = skeleton if model_class else _base_for_blocks(skeleton, blocks)
        check(Source(str(ref), skeleton, _ShapesOnly(skeleton, str(ref)), blocks))
    folder = hub.fetch(ref, weights)
    if index is not None:
        hub.require(folder, ref, [PIPELINE_DENOISER], weights=[PIPELINE_DENOISER])
    source = _open_folder(folder, blocks, model_class)
    source.hub = ref
    source.description = str(ref)
    return source


def open_source(model: str | os.PathLike, blocks: Sequence[str] | None = None, revision: str | None = None,
                check: Callable[[Source], None] | None = None, model_class: str | None = None) -> Source:
    """Open MODEL: a built-in name, a diffusers pipeline/model folder, a transformers folder, a BFL file or a Hub ID
    (``revision``: its branch, tag or commit).

    ``blocks`` names the ``nn.ModuleList`` attributes holding the blocks (``["encoder.layer"]``) for a
    model without a family adapter (generic mode); None uses the family adapter. ``check`` sees the source before
    any weight is read (a Hub ID's before its weights are downloaded) and may refuse it by raising. ``model_class``
    (--model-class) builds that transformers/diffusers class instead of the one config.json names.
    """
    if isinstance(model, str) and model in BUILTIN_MODELS:
        if revision:
            raise ModelError(f"--revision {revision}: {model} is a built-in model, not a Hugging Face Hub ID.")
        if model_class:
            raise ModelError(f"--model-class {model_class} is for a model folder or Hub ID, and {model} is a built-in "
                             "model; leave --model-class out.")
        source = _open_builtin(model, blocks)
    elif (ref := hub.hub_ref(model, revision)) is not None:
        return _open_hub(ref, blocks, check, model_class)
    elif revision:
        raise ModelError(f"--revision {revision} is for a Hugging Face Hub ID, and {model} is a local path.")
    else:
        path = Path(model).expanduser()
        if not path.exists():
            raise ModelError(f"{model} does not exist; {_WHAT_TO_PASS}.")
        path = path.resolve()
        if model_class and not path.is_dir():
            raise ModelError(f"--model-class {model_class} is for a diffusers or transformers model folder, and "
                             f"{model} is a file; leave --model-class out.")
        source = _open_folder(path, blocks, model_class) if path.is_dir() else _open_file(path, blocks)
    if check is not None:
        check(source)
    return source
