"""The encoders' weights files before anything loads: which files each component reads, the dtype it loads in, and
its skeleton on the meta device, so a run plans its host and GPU memory from headers and configs alone.

A text encoder loads in its file's own dtype where the file holds one (fp16, bf16 or fp32): the libraries then hand
out tensors that map the file (transformers 5 over safetensors 0.8, measured: no anonymous memory for a bf16 T5),
and a streamed encoder is cast block by block as its blocks are packed (runtime/module_stream.py), never whole. A
file of another dtype (ComfyUI's fp8 T5) loads cast to the run's dtype, as a copy in host memory, which the host plan
counts (encoder_placement.py's ``host_copies``).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..models import ModelError
from ..runtime.host.budget import anonymous_memory
from ..sizes import format_size
from .encoder_placement import (
    EncoderRun,
    Placement,
    every_streamed,
    host_copies,
    module_bytes,
    plan_host,
    plan_placement,
    run_budget,
)
from .encoder_source import EncoderError, EncoderSource, file_components, pipeline_folder
from .file_kind import unreadable
from .hub import read_index
from .skeletons import folder_model, folder_weights

log = logging.getLogger("squareq.sources")

# safetensors dtype names a module can hold as parameters, mapped without a copy
MAPPED_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}


def component_files(source: EncoderSource, folder: Path, index: Mapping, component: str) -> list[Path]:
    """The weights files ``component`` of the pipeline in ``folder`` loads from: the single file that replaces it
    (``--t5 ...``), else its folder's safetensors."""
    parts = file_components(index, [flag for flag, _ in source.files])
    given = {parts[flag]: Path(path) for flag, path in source.files}
    if component in given:
        return [given[component]]
    try:
        return folder_weights(folder / component)
    except ModelError as exc:
        raise EncoderError(str(exc)) from None


def file_dtype(files: list[Path]) -> torch.dtype | None:
    """The one floating dtype every tensor of ``files`` is stored in, when a module can hold it as is (else None:
    mixed, or fp8)."""
    from safetensors import safe_open

    found = set()
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                found.update(f.get_slice(k).get_dtype() for k in f.keys())
        except Exception as exc:  # safetensors raises its own error types for a file that is not one
            raise EncoderError(f"{unreadable(path, exc)}; re-download it.") from None
    floating = {d for d in found if d.startswith(("F", "BF"))}
    return MAPPED_DTYPES.get(floating.pop()) if len(floating) == 1 else None


def mapped_dtypes(source: EncoderSource, folder: Path, index: Mapping, components) -> dict[str, torch.dtype]:
    """The text encoders of ``components`` whose files a module can hold as they are, with that dtype: they load in
    it (the others, and the VAE, in the run's dtype)."""
    out = {}
    for name in components:
        if name.startswith("text_encoder") and name in index:
            dtype = file_dtype(component_files(source, folder, index, name))
            if dtype is not None:
                out[name] = dtype
    return out


def as_loaded(mapped: Mapping[str, torch.dtype], before: int, owner, names,
              dtype: torch.dtype) -> dict[str, torch.dtype]:
    """``mapped`` as the library loaded ``owner``'s components ``names`` (missing ones skipped): empty where this
    process's own memory grew since ``before`` (:func:`~squareq.runtime.host.budget.anonymous_memory`) by more than
    the copies expected of the others (in ``dtype``) and half the mapped encoders: a library that copies the files
    rather than mapping them (a transformers release before 5 may), whose encoders then count as copies."""
    grown = anonymous_memory() - before
    parts = {n: getattr(owner, n) for n in names if getattr(owner, n, None) is not None}
    expected = sum(module_bytes(m, dtype) for n, m in parts.items() if n not in mapped)
    views = sum(module_bytes(parts[n], d) for n, d in mapped.items() if n in parts)
    if views and grown > expected + views // 2 + (256 << 20):
        log.warning("the text encoders were copied into memory as they loaded (%s more than expected), so the host "
                    "plan counts them as copies; transformers 5 maps safetensors files instead.",
                    format_size(grown - expected))
        return {}
    return dict(mapped)


def encoder_skeletons(folder: Path, index: Mapping, components: list[str]) -> dict[str, nn.Module]:
    """Each of ``components`` present in the pipeline built on the meta device from its config alone."""
    out = {}
    for name in components:
        if name not in index or not (folder / name / "config.json").is_file():
            continue
        try:
            out[name] = folder_model(folder / name)[0]
        except ModelError as exc:
            raise EncoderError(str(exc)) from None
    return out


@dataclass(frozen=True)
class EncoderFiles:
    """The encoders of a pipeline as its configs and file headers describe them: each component's skeleton on the
    meta device, and the text encoders that load as views of their files, with that dtype."""

    skeletons: dict[str, nn.Module]
    mapped: dict[str, torch.dtype]


def read_encoder_files(source: EncoderSource | str) -> EncoderFiles | None:
    """The VAE and text encoders of ``source`` from configs and headers alone, no weight read; None for a built-in
    model (its toy encoders run whole)."""
    source = EncoderSource.of(source)
    folder = pipeline_folder(source)
    if folder is None:
        return None
    index = read_index(folder) or {}
    names = [n for n in index if n == "vae" or n.startswith("text_encoder")]
    return EncoderFiles(encoder_skeletons(folder, index, names), mapped_dtypes(source, folder, index, names))


def planned_placement(files: EncoderFiles, device: torch.device, dtype: torch.dtype, run: EncoderRun,
                      stream_all: bool = False) -> Placement:
    """Where ``files``' encoders will run, on the GPU and on the host, before any weight loads: what
    ``open_encoders`` does with ``run`` (a VRAM budget nothing fits is refused as the loaders would refuse it).
    ``stream_all``: every text encoder that streaming makes smaller is planned streamed, the most host memory they
    can take, for encoders loaded beside a slab on the GPU, where the free memory is not known beforehand."""
    placement = plan_placement(files.skeletons, run_budget(run.budget, device), device, dtype, run.tokens,
                               run.pixels, run.flag, run.frames)
    if stream_all:
        placement = every_streamed(placement)
    return plan_host(placement, files.skeletons, dtype, run.host_budget,
                     host_copies(files.skeletons, files.mapped, dtype, device))
