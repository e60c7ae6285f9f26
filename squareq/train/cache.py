"""The training cache: VAE latents and text embeddings computed once, stored as safetensors, found by content.

Each entry is one small safetensors file named by the sha256 of everything its value depends on (what
was encoded, the encoder's identity, the resolution or sequence length). Editing one caption therefore
re-encodes one entry; an entry that no caption or image asks for any more is simply not read. Files
are written under a temporary name and renamed, so a run killed while caching leaves only whole
entries, and the next run computes what is missing. ``squareq cache`` fills the cache without training;
the compiler's ``--calib-cache`` can read the same folder.
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from ..models.cache_entry import EntryFormError, read_entry
from ..progress import Progress
from ..slab.atomic import atomic_write_bytes
from ..slab.digest import DigestError, hashed_safetensors

KINDS = ("latents", "text")
DEBRIS_AGE_S = 60  # a temporary file older than this is a killed writer's, not a live one's
ENCODERS_FILE = "encoders.json"
IDENTITIES_FILE = "encoder_identities.json"  # the encoders' identities by their files (EmbeddingCache.identities)


class CacheError(ValueError):
    """A cache entry cannot be used; the message names the file."""


class EmbeddingCache:
    """Content-addressed tensors under ``root/<kind>/<key>.safetensors``."""

    def __init__(self, root: str | os.PathLike, echo: Callable[[str], None] | None = None,
                 fits: Callable[[str, dict], str | None] | None = None) -> None:
        self.root = Path(root)
        self.fits = fits  # (kind, tensors) -> why an entry was not made for this run's model (None: it was)
        self.echo = echo or (lambda line: print(line, file=sys.stderr))  # a re-encoded entry is said
        for kind in KINDS:
            (self.root / kind).mkdir(parents=True, exist_ok=True)
        self.removed = self._remove_debris()
        self.computed = 0  # entries written by this object (tests and progress lines read it)

    def _remove_debris(self) -> int:
        """Remove the temporary files a killed fill left (``.<entry>.<hex>.tmp``, atomic_write_bytes'): none is ever
        read, but each held disk. Only those a minute old: another process filling this cache now may be writing
        one."""
        now, removed = time.time(), 0
        for folder in (self.root, *(self.root / kind for kind in KINDS)):
            for path in folder.glob(".*.tmp"):
                try:
                    if now - path.stat().st_mtime > DEBRIS_AGE_S:
                        path.unlink()
                        removed += 1
                except OSError:
                    continue  # gone already, or not ours to remove: the cache works without it
        return removed

    def path(self, kind: str, key: str) -> Path:
        if kind not in KINDS:
            raise ValueError(f"cache kind {kind!r} is not one of {KINDS}.")
        return self.root / kind / f"{key}.safetensors"

    def has(self, kind: str, key: str) -> bool:
        return self.path(kind, key).is_file()

    def load(self, kind: str, key: str) -> dict[str, torch.Tensor]:
        """An entry's tensors, their hash and their kind's rules checked (models/cache_entry.py): one that fails is a
        :class:`CacheError` naming the file."""
        path = self.path(kind, key)
        try:
            return self._read(kind, path)
        except DigestError as exc:
            raise CacheError(f"cache entry {path} {exc}; delete it and the next run recomputes it.") from None

    def intact(self, kind: str, key: str, echo: Callable[[str], None] | None = None) -> bool:
        """Whether the entry is there, as it was written and of its kind's form; a damaged one, or one that does not
        fit its kind (an edited entry, re-hashed), is deleted, with a line saying so (through ``echo``, else the
        cache's), so that the fill encodes it again."""
        path = self.path(kind, key)
        if not path.is_file():
            return False
        try:
            self._read(kind, path)
        except DigestError as exc:
            (echo or self.echo)(f"cache entry {path} {exc}; encoding it again.")
            path.unlink(missing_ok=True)
            return False
        return True

    def _read(self, kind: str, path: Path) -> dict[str, torch.Tensor]:
        tensors = read_entry(path, kind)
        problem = self.fits(kind, tensors) if self.fits is not None else None
        if problem is not None:
            raise EntryFormError(f"{problem}, so it was not made by this run's encoders")
        return tensors

    def store(self, kind: str, key: str, tensors: dict[str, torch.Tensor]) -> None:
        atomic_write_bytes(self.path(kind, key), hashed_safetensors(tensors))
        self.computed += 1

    def record_pairs(self, pairs: list[tuple[str, str]]) -> None:
        """Write which text entry captions which latent entry (``pairs.json``), so that the compiler's
        ``--calib-cache`` calibrates each image with its own caption. The last fill's pairs win."""
        from ..models.calibration_set import PAIRS_FILE

        atomic_write_bytes(self.root / PAIRS_FILE, json.dumps([list(p) for p in pairs]).encode())

    def record_encoders(self, text_identity: str, placement: dict) -> None:
        """Note in ``encoders.json`` where the encoders of ``text_identity`` ran (whole or streamed, the budget, the
        expected peak): how the entries were made, beside what identifies them. Streaming changes no value, so it is
        not part of an entry's key."""
        self._note(ENCODERS_FILE, text_identity, placement)

    def remember_identities(self, files_key: str, record: dict) -> None:
        """Note ``record``, what names the entries the encoders of ``files_key`` (sources/encoder_files_key.py) make,
        for :meth:`identities`. The cache keeps it as given, a JSON object it does not read: its fields are its
        writer's (train/prepare.py ``EncoderIdentities.to_record``)."""
        self._note(IDENTITIES_FILE, files_key, record)

    def identities(self, files_key: str | None) -> dict | None:
        """The record noted for ``files_key``, as it was noted: the keys of a run's entries without loading its
        encoders; None where none was noted, or the note is not a JSON object (damaged: the encoders then load and
        note it again). Its fields are checked by its writer (``EncoderIdentities.from_record``)."""
        found = self._notes(IDENTITIES_FILE).get(files_key) if files_key else None
        return found if isinstance(found, dict) else None

    def _notes(self, name: str) -> dict:
        path = self.root / name
        try:
            found = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError):
            found = {}  # a damaged note is only a note: rewritten whole
        return found if isinstance(found, dict) else {}

    def _note(self, name: str, key: str, value) -> None:
        found = self._notes(name)
        found[key] = value
        atomic_write_bytes(self.root / name, json.dumps(found, indent=1, sort_keys=True).encode())

    def fill(self, kind: str, keys: Iterable[str], compute: Callable[[list[int]], list[dict[str, torch.Tensor]]],
             batch_size: int = 8, progress: Progress | None = None) -> int:
        """Compute the entries of ``keys`` that are missing: ``compute(indices)`` returns one tensor dict per index
        into ``keys``. Returns how many entries were computed. ``progress`` counts the entries that were missing
        when the fill began: each one stored moves it on, and a damaged one found on the way is added to its total.

        Batches are fixed runs of ``batch_size`` distinct keys in the given order, and a batch with any entry
        missing is computed whole: an entry is always computed next to the same neighbours, so a fill that
        was interrupted and resumed stores the bits an uninterrupted one would (batched kernels may round
        differently for other batch sizes)."""
        first: dict[str, int] = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        order = list(first.items())
        say = self.echo if progress is None else progress.above(self.echo)
        made = 0
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            missing = {key for key, _ in chunk if not self.has(kind, key)}
            # every entry checked: damaged ones are deleted
            damaged = [key for key, _ in chunk if key not in missing and not self.intact(kind, key, say)]
            if not missing and not damaged:
                continue
            if progress is not None:
                progress.expect(len(damaged))
            for (key, _), tensors in zip(chunk, compute([i for _, i in chunk]), strict=True):
                if not self.has(kind, key):
                    self.store(kind, key, tensors)
                    made += 1
                    if progress is not None:
                        progress.advance()
        return made
