"""Hugging Face Hub repository IDs as model sources (``black-forest-labs/FLUX.1-dev``, ``org/name@revision``).

A Hub ID resolves through ``huggingface_hub`` to a snapshot folder of the local cache, which every loader then reads
as a local folder. Online, only the files a command needs are downloaded (with huggingface_hub's progress bars): a
pipeline's components by name (the transformer, VAE, text encoders, tokenizers, scheduler; only the configs of a
component whose weights come from a single file), or a model repository's configs, tokenizer files and safetensors
weights; never pickled weights, other frameworks' exports, fp16 variants or the single-file copies some pipeline
repositories also hold (FLUX.1-dev's 24 GB ``flux1-dev.safetensors``). Offline (``HF_HUB_OFFLINE=1``, or when the Hub
cannot be reached), the cache alone answers.

Every failure is one sentence naming the repository and what to do: a gated or private repository names the login
and the model's page, an uncached one offline names the cache.
"""
from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .. import settings
from ..models.base import ModelError, read_json_object
from ..third_party import download_bars
from .boundary import reading

# owner/name as the Hub spells repository IDs, with an optional @revision (a branch, tag or commit)
_COMMIT = re.compile(r"[0-9a-f]{40}")
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)(?:@(?P<revision>[^\s@]+))?")
# names that are files someone meant to pass, not repositories: a missing file stays a missing file
_FILE_SUFFIXES = (".safetensors", ".ckpt", ".bin", ".pt", ".pth", ".gguf", ".json", ".toml", ".slab")

# weights SquareQ never reads: pickles, other frameworks' exports, and precision variants of weights it reads
NOT_READ = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.msgpack", "*.h5", "*.onnx", "*.onnx_data", "*.pb",
            "*.gguf", "*.ot", "*.tflite", "*.mlmodel", "onnx/*", "openvino/*",
            "*.fp16.*", "*.fp16-*", "*.bf16.*", "*.bf16-*", "*.fp32.*", "*.fp32-*", "*.non_ema.*", "*.ema.*"]
# a repository that is one model (transformers or diffusers): its configs, tokenizer files and safetensors weights
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.vocab"]
PIPELINE_INDEX = "model_index.json"


@dataclass(frozen=True)
class HubRef:
    """A repository on the Hugging Face Hub and the revision asked for (None: the default branch)."""

    repo: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo + (f"@{self.revision}" if self.revision else "")

    @property
    def page(self) -> str:
        return f"https://huggingface.co/{self.repo}"


def hub_ref(model: str | Path, revision: str | None = None) -> HubRef | None:
    """``model`` as a Hub repository (``revision`` overrides one written after ``@``), or None when it is a local
    path that exists, or does not look like ``owner/name``."""
    text = str(model)
    if Path(text).expanduser().exists() or text.lower().endswith(_FILE_SUFFIXES):
        return None
    m = _HUB_ID.fullmatch(text)
    if m is None:
        return None
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:  # the Hub's own rules ("--" and ".." inside, a trailing ".", 96 characters at most)
        validate_repo_id(m["repo"])
    except HFValidationError:
        return None
    revision = revision or m["revision"]
    if revision is not None and not _good_revision(revision):
        raise ModelError(f"--revision {revision!r} of {m['repo']} is not a branch, tag or commit name (a revision "
                         "has no '..', no leading '/' or '.', and none of ~^:?*[\\ or spaces); give a branch such as "
                         "main, a tag, or a 40-hex commit.")
    return HubRef(m["repo"], revision)


# what git's check-ref-format refuses in a ref name, and so what no branch or tag on the Hub can hold: ".." (a path
# out of the cache's folders), a part that starts with "." or ends with ".lock", "@{", control characters and
# ~^:?*[\ and spaces
_BAD_REVISION = re.compile(r"\.\.|@\{|//|[\x00-\x20\x7f~^:?*\[\\]|(^|/)\.|\.lock(/|$)|^/|/$|\.$")


def _good_revision(revision: str) -> bool:
    """Whether ``revision`` can be a branch, tag or commit of a Hub repository (and so a safe path part)."""
    return bool(revision) and len(revision) <= 255 and _BAD_REVISION.search(revision) is None


def like_recorded(ref: HubRef, recorded: str) -> HubRef:
    """``ref`` at the commit ``recorded`` (a slab's source or encoders) is pinned to, when it names the same repository
    without a revision of its own: a command then reads what the slab was compiled from."""
    pinned = hub_ref(recorded)
    return pinned if ref.revision is None and pinned is not None and pinned.repo == ref.repo else ref


def pipeline_components(index: dict, prefixes: Iterable[str]) -> list[str]:
    """The components of a pipeline's ``model_index.json`` whose names start with one of ``prefixes``."""
    prefixes = tuple(prefixes)
    return sorted(name for name, value in index.items()
                  if not name.startswith("_") and isinstance(value, list) and name.startswith(prefixes))


def pipeline_patterns(weights: Iterable[str], configs: Iterable[str] = ()) -> list[str]:
    """The files of a pipeline repository that hold ``weights`` (components, whole) and ``configs`` (components whose
    weights come from elsewhere: their JSON files only)."""
    return [PIPELINE_INDEX] + [f"{c}/*" for c in weights] + [f"{c}/*.json" for c in configs]


def offline() -> bool:
    """Whether downloads are off: ``HF_HUB_OFFLINE`` as huggingface_hub reads it, now or when it was imported."""
    from huggingface_hub import constants

    return settings.hub_offline() or bool(constants.HF_HUB_OFFLINE)


def read_index(folder: Path) -> dict | None:
    """A snapshot's ``model_index.json`` (a diffusers pipeline), or None when it is one model."""
    path = Path(folder) / PIPELINE_INDEX
    return read_json_object(path, "delete that file from the cache and run again") if path.is_file() else None


def index_of(ref: HubRef) -> tuple[Path, dict | None]:
    """The snapshot folder of ``ref`` holding at least its ``model_index.json`` or ``config.json``, and its pipeline
    index (None for a one-model repository): what the caller needs to choose which files to fetch."""
    folder = fetch(ref, (PIPELINE_INDEX, "config.json"))
    return folder, read_index(folder)


def fetch(ref: HubRef, allow: Iterable[str], ignore: Iterable[str] = NOT_READ) -> Path:
    """The local snapshot folder of ``ref`` with the files matching ``allow`` and not ``ignore``: downloaded if
    needed and allowed, else from the cache. One sentence (:class:`ModelError`) when it cannot be had."""
    return Path(_fetch(ref, tuple(allow), tuple(ignore), offline(), settings.hub_cache()))


def resolved(ref: HubRef, folder: Path) -> HubRef:
    """``ref`` pinned to the commit its snapshot folder is (what a slab records, so later commands read the same
    files, offline too)."""
    return HubRef(ref.repo, Path(folder).name)


def require(folder: Path, ref: HubRef, components: Iterable[str], weights: Iterable[str] = ()) -> None:
    """Refuse a cached snapshot that lacks a component folder the command needs, or the safetensors weights of one
    in ``weights`` (a partial download, or an earlier one of its configs only)."""
    folder = Path(folder)
    missing = [f"{c}/" for c in components if not (folder / c).is_dir()]
    missing += [f"{c}/*.safetensors" for c in weights if (folder / c).is_dir() and not any((folder / c).glob(
        "*.safetensors"))]
    if missing:
        raise ModelError(f"the cached copy of {ref} has no {', '.join(missing)}; run the command once with network "
                         f"access (HF_HUB_OFFLINE unset) to download it, or `hf download {ref.repo}`.")


@functools.lru_cache(maxsize=64)
def _fetch(ref: HubRef, allow: tuple[str, ...], ignore: tuple[str, ...], local_only: bool, cache_dir) -> str:
    from huggingface_hub import snapshot_download

    cache = cache_dir or _default_cache()
    storage = Path(cache) / f"models--{ref.repo.replace('/', '--')}"
    with reading(f"{ref} through the Hugging Face cache ({storage})", "where the cached copy is damaged, delete that "
                 "folder and run the command with network access to download it again"), \
            _hub_errors(ref, local_only, cache):
        _check_cached_ref(storage, ref)
        with contextlib.nullcontext() if local_only else download_bars():
            return snapshot_download(ref.repo, revision=ref.revision, allow_patterns=list(allow),
                                     ignore_patterns=list(ignore), local_files_only=local_only, cache_dir=cache_dir)


def _check_cached_ref(storage: Path, ref: HubRef) -> None:
    """A cached ``refs/<branch>`` file must hold a commit: an empty one (a download cut before it was written) would
    have the snapshot's parent folder read as the model, and said wrongly as "not a pipeline"."""
    revision = ref.revision or "main"
    refs = storage / "refs" / revision
    if _COMMIT.fullmatch(revision) or not refs.is_file():
        return
    held = refs.read_bytes().strip()
    if not _COMMIT.fullmatch(held.decode("ascii", "replace")):
        what = "is empty" if not held else f"holds {held[:40]!r}, not a 40-hex commit"
        raise ModelError(f"{refs} {what}, so the cached {ref} names no snapshot (a download was cut or the file was "
                         f"edited); delete {storage} and download it again (`hf download {ref.repo}`).")


@contextlib.contextmanager
def _hub_errors(ref: HubRef, local_only: bool, cache: str):
    """huggingface_hub's own errors for ``ref``, each as the sentence that says what to do about it."""
    from huggingface_hub import errors as hf

    try:
        yield
    except hf.GatedRepoError:
        raise ModelError(f"{ref.repo} is gated: accept its license at {ref.page} and log in with `hf auth login` "
                         "(`huggingface-cli login` before huggingface_hub 1.0) or set HF_TOKEN, then run the command "
                         "again.") from None
    except hf.RevisionNotFoundError:
        raise ModelError(f"{ref.repo} has no revision {ref.revision!r}; pass a branch, tag or commit that "
                         f"{ref.page} lists to --revision.") from None
    except hf.RepositoryNotFoundError:
        raise ModelError(f"{ref.repo} is neither a local path nor a repository SquareQ can see on the Hugging Face "
                         f"Hub: check the name at {ref.page}, and for a private or gated model log in with `hf auth "
                         "login` (`huggingface-cli login` before huggingface_hub 1.0) or set HF_TOKEN.") from None
    except getattr(hf, "IncompleteSnapshotError", ()) as exc:  # huggingface_hub 2; a LocalEntryNotFoundError too
        raise ModelError(f"the cached copy of {ref} is incomplete ({str(exc).split('. ')[0]}); run the command with "
                         "network access to finish the download.") from None
    except hf.LocalEntryNotFoundError as exc:
        where = f"{ref} is not a local path, nor in the Hugging Face cache ({cache})"
        if local_only or "HF_HUB_OFFLINE" in str(exc) or "outgoing traffic has been disabled" in str(exc):
            raise ModelError(f"{where}, and downloads are off (HF_HUB_OFFLINE=1); download it where there is network "
                             f"(`hf download {ref.repo}`) into this cache, or unset HF_HUB_OFFLINE.") from None
        reason = str(exc.__cause__ or exc).splitlines()[0]
        raise ModelError(f"{where}, and the Hub cannot be reached ({reason}); connect to the network, or point "
                         f"HF_HOME at a cache that holds {ref.repo}.") from None
    except hf.HfHubHTTPError as exc:
        raise ModelError(f"the Hugging Face Hub refused {ref} ({str(exc).splitlines()[0]}); check {ref.page} and "
                         "your token (HF_TOKEN), then run the command again.") from None


def _default_cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE
