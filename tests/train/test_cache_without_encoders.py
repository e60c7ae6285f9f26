"""A run whose cache holds every entry its encoders would make names them from the identities the cache noted for
those encoder files, and never loads the encoders (a resumed FLUX.2 run skipped minutes of loading, pinning and
checksumming Mistral for nothing); changed files, a missing entry, or a note of another shape (EncoderIdentities
owns its fields) load them again."""
import json

import pytest
from safetensors.torch import load_file, save_file

from squareq.models import write_tiny_flux_pipeline
from squareq.train import prepare
from squareq.train.cache import IDENTITIES_FILE, EmbeddingCache

from .test_recorded_source import cache_command, slab_of

pytestmark = pytest.mark.usefixtures("torch_kernels")


@pytest.fixture
def opened(monkeypatch):
    """How many times a run opened its encoders."""
    calls = []
    real = prepare.open_encoders
    monkeypatch.setattr(prepare, "open_encoders", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    return calls


def entries(root):
    return sorted(p.relative_to(root / "cache").as_posix() for p in (root / "cache").rglob("*.safetensors"))


def test_a_full_cache_names_its_entries_without_loading_the_encoders(tmp_path, opened):
    pipeline = write_tiny_flux_pipeline(tmp_path / "flux")
    slab = slab_of(pipeline, tmp_path / "flux.slab")
    first = cache_command(slab, tmp_path)
    assert first.exit_code == 0, first.output
    made = entries(tmp_path)
    assert len(opened) == 1 and made and (tmp_path / "cache" / IDENTITIES_FILE).is_file()
    again = cache_command(slab, tmp_path)
    assert again.exit_code == 0, again.output
    assert len(opened) == 1 and "the VAE and text encoders were not loaded" in again.output
    assert entries(tmp_path) == made
    # negative control: an entry gone, the encoders load and make it alone
    (tmp_path / "cache" / made[0]).unlink()
    third = cache_command(slab, tmp_path)
    assert len(opened) == 2 and "1 new entries" in third.output and entries(tmp_path) == made


def test_changed_encoder_weights_load_the_encoders_and_make_new_entries(tmp_path, opened):
    """Negative control: the same folder with T5 retrained is another identity, so its text entries are made anew."""
    pipeline = write_tiny_flux_pipeline(tmp_path / "flux")
    slab = slab_of(pipeline, tmp_path / "flux.slab")
    assert cache_command(slab, tmp_path).exit_code == 0
    made = entries(tmp_path)
    weights = next((pipeline / "text_encoder_2").glob("*.safetensors"))
    tensors = load_file(str(weights))
    tensors = {k: v * 1.01 if v.is_floating_point() and v.dim() == 2 else v for k, v in tensors.items()}
    save_file(tensors, str(weights), metadata={"format": "pt"})
    again = cache_command(slab, tmp_path)
    assert again.exit_code == 0, again.output
    assert len(opened) == 2 and "were not loaded" not in again.output
    new = set(entries(tmp_path)) - set(made)
    assert new and all(p.startswith("text/") for p in new)


def test_the_identities_own_their_record_and_refuse_another_shape():
    """EncoderIdentities names and checks the fields of the record the cache notes; the cache keeps it as given."""
    ids = prepare.EncoderIdentities("v", "t", ["c"])
    record = ids.to_record()
    assert prepare.EncoderIdentities.from_record(record) == ids
    assert prepare.EncoderIdentities.from_record({**record, "control_text": None}).control_text is None
    # negative controls: a field missing, an unknown one, a value of another type, not an object
    refused = [{k: v for k, v in record.items() if k != "text"}, {**record, "audio": "a"}, {**record, "vae": 3},
               {**record, "control_text": "c"}, {**record, "control_text": [1]}, None, ["v", "t", None]]
    assert all(prepare.EncoderIdentities.from_record(r) is None for r in refused)


def test_the_cache_keeps_a_noted_record_as_given(tmp_path):
    cache = EmbeddingCache(tmp_path)
    cache.remember_identities("k", {"anything": "at all"})
    assert cache.identities("k") == {"anything": "at all"} and cache.identities("other") is None
    assert cache.identities(None) is None
    (tmp_path / IDENTITIES_FILE).write_text('{"k": ["not", "an", "object"]}')
    assert cache.identities("k") is None


def test_a_note_of_another_shape_loads_the_encoders_and_is_noted_again(tmp_path, opened):
    """A record missing a field (a damaged note, another version's) is as none: the encoders load, no entry is made
    anew, and the note is written whole again, so the next run loads nothing."""
    pipeline = write_tiny_flux_pipeline(tmp_path / "flux")
    slab = slab_of(pipeline, tmp_path / "flux.slab")
    assert cache_command(slab, tmp_path).exit_code == 0
    made, note = entries(tmp_path), tmp_path / "cache" / IDENTITIES_FILE
    noted = json.loads(note.read_text())
    note.write_text(json.dumps({k: {f: v for f, v in r.items() if f != "text"} for k, r in noted.items()}))
    again = cache_command(slab, tmp_path)
    assert again.exit_code == 0, again.output
    assert len(opened) == 2 and "were not loaded" not in again.output and entries(tmp_path) == made
    assert json.loads(note.read_text()) == noted
    assert "were not loaded" in cache_command(slab, tmp_path).output and len(opened) == 2
