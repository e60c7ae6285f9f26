"""The ``Source``: a model to compile, its skeleton on the meta device bound to its checkpoint's tensors.

At open time, from the headers only, each tensor the model's class expects is bound to a checkpoint tensor the way
its library loads it (misshapen and missing tensors refused, extras left out with a warning). Then ``load_block``
reads one block's tensors, so host memory stays near one block and the whole model never has to fit anywhere, and
``shell`` runs the model's own forward with each streamed block handed to the caller.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..models import BUILTIN_MODELS, FamilyAdapter, ModelError, adapter_for
from ..models.skeleton import place_tensor
from ..slab.signature import model_signature
from .hub import HubRef
from .materialize import alias_groups, cast_while_running, materialize, own_copy
from .tensors import MISMATCH, Tensors, few

log = logging.getLogger("squareq.sources")


class Source:
    """A model to compile: its skeleton on the meta device and lazy, checked access to its weights."""

    _checked_finite = False  # check_finite found every tensor finite

    def __init__(self, description: str, skeleton: nn.Module, tensors: Tensors,
                 blocks: Sequence[str] | None = None):
        self.description = description
        self.pipeline: Path | None = None  # the diffusers pipeline folder around the model, if any
        self.folder: Path | None = None  # the model's own folder (config.json, tokenizer files), if it has one
        self.hub: HubRef | None = None  # the Hub repository and commit it came from, if it came from the Hub
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
        self._aliases = alias_groups(skeleton)
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
                                 f"but {cls} with this config expects {list(shape)}; {MISMATCH}.")
            key[name] = found
        ignore = _patterns(self._skeleton, "_keys_to_ignore_on_load_unexpected") + _legacy_buffers(self._skeleton)
        extra = [n for n in set(t.shapes) - set(key.values()) if not any(p.search(n) for p in ignore)]
        if missing:
            held = few(t.display(n) for n in extra) or "none"
            raise ModelError(f"{t.label} has no tensor {t.display(missing[0])}, which {cls} with this config expects "
                             f"({len(missing)} missing in all, e.g. {few(missing)}; tensors it holds that {cls} does "
                             f"not have: {held}); {MISMATCH}: pass the class it was saved from with --model-class "
                             "or fix its config.json.")
        self.ignored = sorted(t.display(n) for n in extra)
        if extra:
            log.warning("%s has %d tensors that %s with this config does not have (%s); they are left out, as "
                        "from_pretrained leaves them out. If the checkpoint should match, check its config.json.",
                        t.label, len(extra), cls, few(self.ignored))
        return key

    # -- the API the compiler uses

    def fingerprint(self) -> str:
        """Changes when the weights may have: the description, the model signature and each weight file's path, size
        and modification time (an in-memory built-in model: a hash of its values)."""
        parts = [self.description, model_signature(self._skeleton), self._tensors.identity()]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]

    def check_finite(self, say: Callable[[str], None] = lambda line: None) -> None:
        """Read every checkpoint tensor the model binds, the resident ones and then one block at a time (host memory:
        one block as read, what ``load_block`` holds), and refuse the first holding NaN or Inf in tensors.py's
        sentence naming the tensor and its file: before a compile encodes or calibrates anything, not when it
        reaches that block. One pass at memory or disk speed (``say`` says it starts); once per source."""
        if self._checked_finite:
            return
        say(f"checking the {len(set(self._key.values()))} tensors of {self._tensors.label} for NaN and Inf values")
        prefixes = [p + "." for p in self.block_paths]
        groups: dict[str, set[str]] = {p: set() for p in ["", *prefixes]}
        for name, key in self._key.items():
            groups[next((p for p in prefixes if name.startswith(p)), "")].add(key)
        for keys in groups.values():
            self._tensors.read(sorted(keys))  # checked as read (tensors.py), then let go
        self._checked_finite = True

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
        materialize(module, self._read([n for n in names if n not in unread], strip=prefix), device, dtype,
                     unread={n[len(prefix):] for n in unread}, keep=linears if upcast_linears else frozenset())
        if upcast_linears and dtype is not None:
            cast_while_running([m for m in module.modules() if isinstance(m, nn.Linear)])
        # frozen: the source is read, never trained (a backward pass through a block would also compute, and hold,
        # a gradient for every weight)
        return module.requires_grad_(False)

    def resident_state(self, device="cpu", dtype: torch.dtype | None = torch.float32,
                       keep: frozenset = frozenset()) -> dict[str, torch.Tensor]:
        """Every state-dict entry outside the streamed blocks, under the model's own names (those in ``keep`` in
        the checkpoint's dtype)."""
        prefixes = tuple(p + "." for p in self.block_paths)
        names = [n for n in self._expected if not n.startswith(prefixes)]
        return {n: own_copy(t, device, None if n in keep else dtype) for n, t in self._read(names).items()}

    def load_model(self, device="cpu", dtype: torch.dtype | None = torch.float32) -> nn.Module:
        """The whole model materialized (small models and tests only)."""
        model = copy.deepcopy(self._skeleton)
        materialize(model, self._read(list(self._expected)), device, dtype)
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
        cast_while_running([model.get_submodule(name.rpartition(".")[0]) for name in linears])
        for i, path in enumerate(self.block_paths):
            owner, _, idx = path.rpartition(".")
            model.get_submodule(owner)[int(idx)] = _BlockStandIn(run_block, i, path, model.get_submodule(path))
        if not tracing:  # buffers the class builds on the host and no checkpoint holds (BERT's token_type_ids)
            for sub in model.modules():
                for name, buf in sub._buffers.items():
                    if buf is not None and not buf.is_meta and buf.device != torch.device(device):
                        sub._buffers[name] = own_copy(buf, device, dtype)
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
