"""Where a model's VAE and text encoders come from, and the error when they cannot be found. Shared by the FLUX
encoders (encoders.py) and the other families' (pipeline_encoders.py): the latter imports it, not encoders.py, so the
two modules do not import each other.

An :class:`EncoderSource` is a built-in tiny model, a diffusers pipeline folder, or a pipeline's Hugging Face Hub ID
(``org/name@revision``), plus any encoders given as single files the way ComfyUI users hold them (``--clip-l``,
``--clip-g``, ``--t5``, ``--vae``): those come from the files, and the pipeline gives only their configs, with the
tokenizers, the scheduler and every encoder not given as a file.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..models import ADAPTERS, BUILTIN_MODELS, ModelError
from ..models.base import PIPELINE_ENCODER_PARTS
from ..sources import hub
from .boundary import check_parts
from .local_files import refuse_pickled, source_identity

log = logging.getLogger("squareq.sources")
_UNVERIFIED: set[str] = set()  # paths already named as unverified: a run picks its encoders more than once
_MATCHED: set[tuple[str, str]] = set()  # (path, recorded identity) found unchanged in this process

# the single-file flags, each naming the pipeline component it replaces by that component's class
SINGLE_FILE_FLAGS = ("clip_l", "clip_g", "t5", "vae")
CLIP_CLASSES = ("CLIPTextModel", "CLIPTextModelWithProjection")
T5_CLASSES = ("T5EncoderModel", "UMT5EncoderModel")
WEIGHTED_PARTS = ("vae", "text_encoder")  # the encoder components with weights (tokenizers and schedulers have none)


class EncoderError(ValueError):
    """The VAE or text encoders cannot be found; the message names where SquareQ looked."""


def cli_flag(name: str) -> str:
    """A single-file key as its command-line flag: clip_l -> --clip-l."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class EncoderSource:
    """Where the VAE, text encoders, tokenizers and scheduler come from: ``where`` (a built-in model name, a pipeline
    folder or a Hub ID), except the encoders in ``files`` ((flag name, single file) pairs)."""

    where: str
    files: tuple[tuple[str, str], ...] = ()
    # what the slab recorded of its local paths (path, source_identity), checked when a command uses them unasked
    identity: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)

    @classmethod
    def of(cls, source: EncoderSource | str | Path) -> EncoderSource:
        return source if isinstance(source, EncoderSource) else cls(str(source))

    @property
    def file_map(self) -> dict[str, str]:
        return dict(self.files)

    def __str__(self) -> str:
        given = ", ".join(f"{cli_flag(k)} {v}" for k, v in self.files)
        return f"{self.where} ({given})" if given else self.where

    def origin(self, flag: str) -> str:
        """Where the component that ``flag`` (a single-file flag name: clip_l, t5, vae) gives comes from: its single
        file where one was given, else the pipeline; what an error about that component's weights names."""
        return self.file_map.get(flag) or self.where

    def record(self) -> dict[str, str]:
        """What a slab records (ModelRecord.encoders) so later commands find the same encoders."""
        return {"where": self.where, **self.file_map}

    @classmethod
    def from_record(cls, record: Mapping[str, str]) -> EncoderSource:
        if not isinstance(record.get("where"), str):
            raise EncoderError(f"the slab's model.encoders {dict(record)} names no pipeline (where); pass the encoders "
                               "with --model, or --clip-l, --t5 and --vae.")
        return cls(record["where"], tuple((k, record[k]) for k in SINGLE_FILE_FLAGS if record.get(k)))


def single_files(values: Mapping[str, str | Path | None]) -> tuple[tuple[str, str], ...]:
    """The given single files of ``values`` (flag name -> path or None), as absolute paths, in flag order."""
    unknown = sorted(set(values) - set(SINGLE_FILE_FLAGS))
    if unknown:
        raise EncoderError(f"{', '.join(unknown)}: not single-file encoder flags ({', '.join(SINGLE_FILE_FLAGS)}).")
    return tuple((k, str(Path(values[k]).expanduser().resolve())) for k in SINGLE_FILE_FLAGS if values.get(k))


def recorded_encoders(record) -> EncoderSource:
    """The encoders a slab's model record names: those its compile calibrated with, else its source's own."""
    encoders = getattr(record, "encoders", None)
    source = EncoderSource.from_record(encoders) if encoders else EncoderSource(record.source)
    known = getattr(record, "source_identity", None) or {}
    return dataclasses.replace(source, identity=tuple(sorted(known.items())))


def encoder_source_for(recorded: EncoderSource | str, family: str, config=None,
                       model: EncoderSource | str | None = None, revision: str | None = None,
                       files: Mapping[str, str | Path | None] | None = None) -> EncoderSource:
    """The encoders a command uses: ``model`` (a pipeline folder or Hub ID, at ``revision``; the recorded commit when
    it names the recorded repository without one) when given, else the ``recorded`` ones (a slab's, or the compiled
    source's); single ``files`` replace their components. With no pipeline to take configs from (a BFL file's slab),
    a family's complete set of single files takes them from its reference pipeline on the Hub (FLUX.1-dev or
    -schnell), as diffusers' from_single_file does."""
    given = single_files(files or {})
    recorded = EncoderSource.of(recorded)
    if isinstance(model, EncoderSource):
        base = model
    elif model:
        base = EncoderSource(_named(model, revision, recorded.where))
    else:
        if revision:
            raise EncoderError(f"--revision {revision} names a revision of --model; pass the Hub ID with --model.")
        base = recorded
        check_unchanged(recorded, [k for k, _ in given])
    if not given:
        return base
    merged = {**base.file_map, **dict(given)}
    where = base.where
    if not _is_pipeline(where):
        adapter = ADAPTERS.get(family)
        needed = adapter.single_file_encoders if adapter is not None else ()
        if adapter is None or adapter.reference_pipeline is None:
            raise EncoderError(f"{', '.join(cli_flag(k) for k, _ in given)} need a pipeline whose configs and "
                               f"tokenizers go with the files, and {where} is not one; pass its Hub ID or folder "
                               "with --model (compile: --encoders).")
        if set(needed) - set(merged):
            raise EncoderError(f"{where} is a single model file, so every {family} encoder must come as a file too: "
                               f"give {', '.join(cli_flag(k) for k in needed)} together, or the pipeline the others "
                               "come from with --model (compile: --encoders), a folder or Hub ID.")
        where = adapter.reference_pipeline(config or {})
    return EncoderSource(where, tuple((k, merged[k]) for k in SINGLE_FILE_FLAGS if k in merged))


def slab_encoders(record, model: EncoderSource | str | None = None, revision: str | None = None,
                  files: Mapping[str, str | Path | None] | None = None,
                  unrecorded: EncoderSource | str | None = None) -> EncoderSource:
    """The VAE and text encoders a command on a slab with model ``record`` uses: ``model`` (at ``revision``) when
    given, else the slab's recorded ones (``unrecorded`` in their place, where given, when the slab recorded none);
    the single ``files`` replace their components."""
    own = unrecorded if unrecorded is not None and not getattr(record, "encoders", None) else recorded_encoders(record)
    return encoder_source_for(own, record.family, record.config, model, revision, files)


def check_unchanged(recorded: EncoderSource, replaced: list[str] = ()) -> None:
    """Refuse a local folder or file a slab names that changed since its compile (its ``source_identity`` no longer
    matches what the slab recorded), except the single files ``replaced`` by flags; one line for a slab that predates
    the record, whose paths are used unverified. Only what is picked by default comes here: a path the user passes
    is used as it is."""
    known = dict(recorded.identity)
    used = [("--model", recorded.where)] + [(cli_flag(k), p) for k, p in recorded.files if k not in replaced]
    for flag, where in used:
        if not (Path(where).is_absolute() and Path(where).exists()):
            continue  # a built-in name, a Hub ID (pinned to its commit), or a path gone (the loader says so)
        if where not in known:
            if where not in _UNVERIFIED:
                _UNVERIFIED.add(where)
                log.warning("%s: the slab records no identity for it (compiled before SquareQ recorded one), so it is "
                            "used unverified; recompile the slab to have it checked.", where)
        elif (where, known[where]) in _MATCHED:
            continue  # checked once in this process: a run opens its encoders several times
        elif source_identity(where) == known[where]:
            _MATCHED.add((where, known[where]))
        else:
            raise EncoderError(f"{where}, which the slab records as its source, changed since the slab was compiled "
                               f"(its configs or weights differ from what it recorded); pass it explicitly with {flag} "
                               f"{where} to use it as it is now, or recompile the slab from it.")


def _named(model: str, revision: str | None, recorded: str) -> str:
    """``model`` as given to --model: a Hub ID with its revision (the recorded commit when it names the recorded
    repository without one, so a command reads what the slab was compiled from), or an absolute path."""
    ref = hub.hub_ref(model, revision)
    if ref is None:
        if revision:
            raise EncoderError(f"--revision {revision} is for a Hugging Face Hub ID, and {model} is a local path.")
        return model if model in BUILTIN_MODELS else str(Path(model).expanduser().resolve())
    return str(hub.like_recorded(ref, recorded))


def pinned(source: EncoderSource) -> EncoderSource:
    """``source`` with a Hub ID pinned to the commit its files were fetched from (what a slab records)."""
    ref = hub.hub_ref(source.where)
    if ref is None:
        return source
    return EncoderSource(str(hub.resolved(ref, pipeline_folder(source))), source.files)


def _is_pipeline(where: str) -> bool:
    """Whether ``where`` can give configs and tokenizers: a built-in model, a pipeline folder, or a Hub pipeline."""
    if where in BUILTIN_MODELS:
        return True
    ref = hub.hub_ref(where)
    if ref is not None:
        try:
            return hub.index_of(ref)[1] is not None
        except ModelError as exc:
            raise EncoderError(str(exc)) from None
    path = Path(where).expanduser()
    return (path / "model_index.json").is_file() or (path.parent / "model_index.json").is_file()


def file_components(index: Mapping, flags) -> dict[str, str]:
    """The pipeline components (model_index.json) the single-file ``flags`` replace: ``vae`` the VAE; ``t5`` the T5
    or UMT5 text encoder; ``clip_l`` the first CLIP text encoder and ``clip_g`` the second (FLUX.1's CLIP-L; SD3's and
    SDXL's L and G). A flag with no such component is refused."""
    def cls(name: str) -> str:
        value = index.get(name)
        return value[1] if isinstance(value, list) and len(value) == 2 else ""

    encoders = sorted(n for n in index if n.startswith("text_encoder"))
    clips = [n for n in encoders if cls(n) in CLIP_CLASSES]
    found = {"vae": "vae" if "vae" in index else None,
             "t5": next((n for n in encoders if cls(n) in T5_CLASSES), None),
             "clip_l": clips[0] if clips else None, "clip_g": clips[1] if len(clips) > 1 else None}
    out = {}
    for name in flags:
        if found.get(name) is None:
            kinds = ", ".join(f"{n} ({cls(n)})" for n in ["vae", *encoders] if n in index) or "none"
            raise EncoderError(f"{cli_flag(name)}: the pipeline {index.get('_class_name', '')} has no component it "
                               f"replaces (its encoders: {kinds}); leave the flag out.")
        out[name] = found[name]
    return out


def pipeline_folder(source: EncoderSource | str | Path) -> Path | None:
    """The diffusers pipeline folder holding the VAE and text encoders (or their configs) of ``source``: a local
    folder, or a Hub ID's snapshot with the encoder files fetched (only configs for components given as single files).
    None for a built-in tiny model, whose encoders are built in; raises :class:`EncoderError` naming ``source`` when
    there is none."""
    source = EncoderSource.of(source)
    if source.where in BUILTIN_MODELS:
        return None
    ref = hub.hub_ref(source.where)
    try:
        folder = _hub_pipeline(ref, [k for k, _ in source.files]) if ref is not None else _local_pipeline(source)
        # every loader reads the folders of this one function: a pickled encoder is refused here, before any loads
        index = hub.read_index(folder) or {}
        replaced = set(file_components(index, [k for k, _ in source.files]).values())
        weighted = [c for c in hub.pipeline_components(index, WEIGHTED_PARTS) if c not in replaced]
        refuse_pickled(*(folder / c for c in weighted))
        check_parts(folder, weighted, f"download it again (`hf download {ref.repo}`)" if ref is not None else
                    "re-save the pipeline with save_pretrained or download it again")
    except ModelError as exc:
        raise EncoderError(str(exc)) from None
    return folder


def _local_pipeline(source: EncoderSource) -> Path:
    path = Path(source.where).expanduser()
    folder = path.parent if (path.parent / "model_index.json").is_file() else path
    if not (folder / "model_index.json").is_file():
        raise EncoderError(f"{path} is not a diffusers pipeline folder (no model_index.json there or in its parent), "
                           "so SquareQ cannot find the VAE and text encoders; pass the pipeline's folder or Hub ID "
                           "with --model, or the encoders' files with --clip-l, --t5 and --vae.")
    return folder


def _hub_pipeline(ref: hub.HubRef, flags: list[str]) -> Path:
    folder, index = hub.index_of(ref)
    if index is None:
        raise EncoderError(f"{ref} is one model, not a diffusers pipeline (no model_index.json), so it has no VAE and "
                           "text encoders; pass the pipeline's Hub ID or folder with --model.")
    ref = hub.resolved(ref, folder)  # every fetch reads this commit
    parts = hub.pipeline_components(index, PIPELINE_ENCODER_PARTS)
    from_files = set(file_components(index, flags).values())
    whole = [p for p in parts if p not in from_files]
    folder = hub.fetch(ref, hub.pipeline_patterns(whole, sorted(from_files)))
    hub.require(folder, ref, parts, weights=[p for p in whole if p.startswith(WEIGHTED_PARTS)])
    return folder


def whole_pipeline_folder(where: str | Path, skip: tuple[str, ...] = (), flag: str = "--model") -> Path:
    """A diffusers pipeline folder with the files of every component but those in ``skip`` (a local folder, or a
    Hub ID's snapshot, fetched): a pipeline that runs whole beside the slab (Würstchen's other stage). Pickled
    weights are refused; :class:`EncoderError` names ``flag`` and ``where``."""
    ref = hub.hub_ref(str(where))
    try:
        if ref is None:
            folder = Path(where).expanduser()
            index = hub.read_index(folder) if folder.is_dir() else None
            if index is None:
                raise EncoderError(f"{flag} {where} is not a diffusers pipeline folder (no model_index.json in it); "
                                   "pass the pipeline's folder or Hub ID.")
        else:
            folder, index = hub.index_of(ref)
            if index is None:
                raise EncoderError(f"{flag} {where} is one model, not a diffusers pipeline (no model_index.json); "
                                   "pass the pipeline's Hub ID or folder.")
            ref = hub.resolved(ref, folder)
            parts = [c for c in hub.pipeline_components(index, ("",)) if c not in skip]
            folder = hub.fetch(ref, hub.pipeline_patterns(parts))
            hub.require(folder, ref, parts, weights=[c for c in parts if not c.startswith(("scheduler", "tokenizer"))])
        refuse_pickled(*(folder / c for c in hub.pipeline_components(index, ("",)) if c not in skip))
    except ModelError as exc:
        raise EncoderError(f"{flag}: {exc}") from None
    return folder


def dtype_tag(dtype: torch.dtype) -> str:
    """The part of an encoder's cache identity that says which precision computed its entries (bf16 on a GPU and
    fp32 on a CPU give different bits)."""
    return f":{dtype}".replace("torch.", "")
