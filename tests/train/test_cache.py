"""The training cache: content-addressed entries, recomputed only where the content changed."""
import pytest
import torch

from squareq.slab.digest import content_key
from squareq.sources.encoder_identity import module_identity
from squareq.train.cache import CacheError, EmbeddingCache


def _encode_all(cache, captions, calls):
    keys = [content_key("text", c, "enc-1") for c in captions]

    def compute(indices):
        calls.extend(captions[i] for i in indices)
        return [{"prompt_embeds": torch.full((2, 3), float(len(captions[i])))} for i in indices]

    made = cache.fill("text", keys, compute, batch_size=2)
    return keys, made


def test_only_changed_entries_are_recomputed(tmp_path):
    cache = EmbeddingCache(tmp_path / "cache")
    calls = []
    captions = ["a cat", "a dog", "a fox", "a cat"]
    keys, made = _encode_all(cache, captions, calls)
    assert calls == ["a cat", "a dog", "a fox"] and made == 3  # the repeated caption is encoded once
    calls.clear()
    captions[1] = "a red dog"
    _, made = _encode_all(EmbeddingCache(tmp_path / "cache"), captions, calls)
    # one entry is new; its fixed batch ("a cat", "a red dog") is computed whole so its bits do not depend on
    # which entries happened to be missing, and the unchanged neighbour is not rewritten
    assert made == 1 and calls == ["a cat", "a red dog"]
    assert _encode_all(EmbeddingCache(tmp_path / "cache"), captions, calls)[1] == 0
    assert torch.equal(cache.load("text", keys[2])["prompt_embeds"], torch.full((2, 3), 5.0))


def test_keys_depend_on_every_part():
    assert content_key("x", 1) != content_key("x", 2)
    assert content_key(b"ab", "c") != content_key(b"a", "bc")  # parts are length-prefixed
    assert content_key("x", {"a": 1, "b": 2}) == content_key("x", {"b": 2, "a": 1})


def test_module_identity_changes_with_the_weights():
    lin = torch.nn.Linear(4, 4)
    before = module_identity(lin, "enc")
    assert module_identity(lin, "enc") == before
    with torch.no_grad():
        lin.weight[0, 0] += 1.0
    assert module_identity(lin, "enc") != before


def test_a_damaged_entry_is_reported_with_its_path(tmp_path):
    cache = EmbeddingCache(tmp_path)
    cache.store("latents", "k", {"x": torch.ones(2)})
    cache.path("latents", "k").write_bytes(b"\x80garbage")
    with pytest.raises(CacheError, match="k.safetensors is unreadable"):
        cache.load("latents", "k")


def test_no_partial_files_are_left_after_a_failed_compute(tmp_path):
    cache = EmbeddingCache(tmp_path)

    def compute(indices):
        raise RuntimeError("encoder crashed")

    with pytest.raises(RuntimeError):
        cache.fill("latents", ["a", "b"], compute)
    assert list((tmp_path / "latents").iterdir()) == []


def test_module_identity_sums_a_large_tensor_a_chunk_at_a_time(monkeypatch):
    """Chunked (no float64 copy of a whole embedding table) and still sensitive to a change in the last chunk."""
    from squareq.sources import encoder_identity as cache

    emb = torch.nn.Embedding(50, 8)
    whole = module_identity(emb, "enc")
    monkeypatch.setattr(cache, "IDENTITY_CHUNK", 64)  # 400 elements: 7 chunks
    total, squares = cache._sums(emb.weight.detach())
    values = emb.weight.detach().double()
    assert abs(total - float(values.sum())) < 1e-9 and abs(squares - float(values.square().sum())) < 1e-9
    chunked = module_identity(emb, "enc")
    assert chunked == module_identity(emb, "enc")
    with torch.no_grad():
        emb.weight[-1, -1] += 0.5
    assert module_identity(emb, "enc") not in (chunked, whole)


def _sign_flipped(path):
    """The entry with every value's sign flipped and written back as a plain safetensors file (what the audit did)."""
    from safetensors.torch import load_file, save_file

    save_file({k: -v for k, v in load_file(str(path)).items()}, str(path))


def _without_a_key(path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    tensors.pop("prompt_embeds")
    save_file({**tensors, "other": torch.zeros(1)}, str(path))


def _bytes_changed(path):
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # the last value's last byte: the header still parses
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", [_sign_flipped, _without_a_key, _bytes_changed, None])
def test_a_damaged_entry_is_encoded_again_with_a_line_saying_so(tmp_path, damage):
    """Issue 40, item 2: entries are hashed when written and checked when read; a damaged one is deleted and encoded
    again by the next fill (one line each), and an intact cache is used as it is (the positive control)."""
    captions = ["a cat", "a dog", "a fox"]
    keys, _ = _encode_all(EmbeddingCache(tmp_path / "cache"), captions, [])
    lines, calls = [], []
    cache = EmbeddingCache(tmp_path / "cache", echo=lines.append)
    if damage is not None:
        damage(cache.path("text", keys[1]))
        with pytest.raises(CacheError, match=f"{keys[1]}.safetensors"):
            cache.load("text", keys[1])
    _, made = _encode_all(cache, captions, calls)
    if damage is None:
        assert made == 0 and calls == [] and lines == []
    else:
        assert made == 1 and len(lines) == 1 and keys[1] in lines[0] and "encoding it again" in lines[0]
    assert torch.equal(cache.load("text", keys[1])["prompt_embeds"], torch.full((2, 3), 5.0))


def test_a_killed_fills_temporary_files_are_removed_by_the_next_run(tmp_path):
    """The third audit: a killed `squareq cache` left hidden .tmp files that no rerun removed. The next cache object
    removes those older than a minute; a fresh one (a live writer's, the negative control) and the entries stay."""
    import os
    import time

    cache = EmbeddingCache(tmp_path)
    cache.store("text", "k", {"prompt_embeds": torch.ones(2, 3)})
    old = [tmp_path / "text" / ".k2.safetensors.0badc0de.tmp", tmp_path / ".pairs.json.12345678.tmp"]
    fresh = tmp_path / "latents" / ".k3.safetensors.feedbeef.tmp"
    for path in (*old, fresh):
        path.write_bytes(b"half an entry")
    stale = time.time() - 3600
    for path in old:
        os.utime(path, (stale, stale))
    again = EmbeddingCache(tmp_path)
    assert again.removed == 2 and not any(p.exists() for p in old)
    assert fresh.exists() and torch.equal(again.load("text", "k")["prompt_embeds"], torch.ones(2, 3))


def _resealed(cache, kind, key, tensors):
    """An entry edited and re-hashed, as a user or a script could: its hash holds."""
    from squareq.slab.atomic import atomic_write_bytes
    from squareq.slab.digest import hashed_safetensors

    atomic_write_bytes(cache.path(kind, key), hashed_safetensors(tensors))


GOOD_TEXT = {"prompt_embeds": torch.ones(4, 3), "pooled_prompt_embeds": torch.ones(5),
             "prompt_mask": torch.tensor([1.0, 1.0, 0.0, 0.0])}
GOOD_LATENTS = {"latents": torch.ones(4, 8, 8), "loss_mask": torch.ones(1, 8, 8)}
BAD = {  # kind, the entry, words of the line that says why it is encoded again
    "no prompt_embeds": ("text", {"embeds": torch.ones(4, 3)}, "has no prompt_embeds tensor (it holds embeds)"),
    "integer latents": ("latents", {"latents": torch.ones(4, 8, 8, dtype=torch.int64)},
                        "holds latents as int64"),
    "flat latents": ("latents", {"latents": torch.ones(256)}, "holds latents with 1 axes"),
    "NaN embeddings": ("text", {**GOOD_TEXT, "prompt_embeds": torch.full((4, 3), float("nan"))}, "NaN or Inf"),
    "mask of other length": ("text", {**GOOD_TEXT, "prompt_mask": torch.ones(3)}, "prompt_mask of 3 tokens"),
    "mask of other values": ("text", {**GOOD_TEXT, "prompt_mask": torch.full((4,), 0.5)}, "other than 0 and 1"),
    "loss_mask of another size": ("latents", {**GOOD_LATENTS, "loss_mask": torch.ones(1, 4, 4)},
                                  "loss_mask of (1, 4, 4)"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_resealed_entry_that_does_not_fit_its_kind_is_refused_and_encoded_again(tmp_path, case):
    """Issue 63, item 4: the hash of an edited, re-hashed entry holds, so its kind's rules are checked too."""
    kind, tensors, words = BAD[case]
    good = GOOD_TEXT if kind == "text" else GOOD_LATENTS
    lines = []
    cache = EmbeddingCache(tmp_path, echo=lines.append)
    assert cache.fill(kind, ["k"], lambda idx: [good for _ in idx]) == 1
    assert cache.fill(kind, ["k"], lambda idx: [good for _ in idx]) == 0 and lines == []  # positive control
    _resealed(cache, kind, "k", tensors)
    with pytest.raises(CacheError) as refused:
        cache.load(kind, "k")
    assert words in str(refused.value) and "k.safetensors" in str(refused.value)
    assert cache.fill(kind, ["k"], lambda idx: [good for _ in idx]) == 1  # encoded again
    assert len(lines) == 1 and words in lines[0] and lines[0].endswith("encoding it again.")
    assert set(cache.load(kind, "k")) == set(good)


def test_an_entry_of_the_right_form_made_for_another_model_is_encoded_again(tmp_path):
    """The fourth audit: resealed entries of another width (latent channels, text width, no pooled embedding) passed
    the kind's rules and crashed the step; the run's model now checks them too (models/cache_entry.py)."""
    from diffusers.configuration_utils import FrozenDict

    from squareq.models import ADAPTERS, load_builtin
    from squareq.models.cache_entry import model_problem

    model, _ = load_builtin("tiny-flux")
    recipe, config = ADAPTERS["flux"].recipe, FrozenDict(dict(model.config))
    fields = recipe.text_fields(config)
    good = {"latents": {"latents": torch.ones(recipe.latent_channels(config), 8, 8)},
            "text": {"prompt_embeds": torch.ones(4, fields.width), "pooled_prompt_embeds": torch.ones(fields.pooled)}}
    other = {"latents": {"latents": torch.ones(recipe.latent_channels(config) + 4, 8, 8)},
             "text": {"prompt_embeds": torch.ones(4, fields.width + 1), "pooled_prompt_embeds": torch.ones(fields.pooled)}}
    lines = []
    cache = EmbeddingCache(tmp_path, echo=lines.append, fits=lambda k, t: model_problem(k, t, recipe, config))
    for kind in ("latents", "text"):
        assert cache.fill(kind, ["k"], lambda idx, kind=kind: [good[kind] for _ in idx]) == 1
        assert cache.fill(kind, ["k"], lambda idx, kind=kind: [good[kind] for _ in idx]) == 0  # positive control
        _resealed(cache, kind, "k", other[kind])
        with pytest.raises(CacheError, match="so it was not made by this run's encoders"):
            cache.load(kind, "k")
        assert cache.fill(kind, ["k"], lambda idx, kind=kind: [good[kind] for _ in idx]) == 1
    assert len(lines) == 2 and "where this model takes" in lines[0] and "where this model takes" in lines[1]


def _flux_fits():
    from diffusers.configuration_utils import FrozenDict

    from squareq.models import ADAPTERS, load_builtin
    from squareq.models.cache_entry import model_problem

    model, _ = load_builtin("tiny-flux")
    recipe, config = ADAPTERS["flux"].recipe, FrozenDict(dict(model.config))
    return recipe.latent_channels(config), lambda k, t: model_problem(k, t, recipe, config)


@pytest.mark.parametrize("side", [(17, 16), (16, 17), (0, 16)])
def test_a_resealed_latent_of_a_side_flux_cannot_pack_is_refused_and_encoded_again(tmp_path, side):
    """Issue 63: a latent entry resealed at an odd height or width (FLUX packs 2x2 patches) passed every check and
    ended in a traceback in the step's packing; the run's model checks its sides now. Negative control: an entry of
    the bucket's shape (a 128x128 bucket through the 8x VAE: 16x16) is kept without a line."""
    channels, fits = _flux_fits()
    good = {"latents": torch.ones(channels, 16, 16)}
    lines = []
    cache = EmbeddingCache(tmp_path, echo=lines.append, fits=fits)
    assert cache.fill("latents", ["k"], lambda idx: [good for _ in idx]) == 1
    assert cache.fill("latents", ["k"], lambda idx: [good for _ in idx]) == 0 and lines == []  # negative control
    assert cache.load("latents", "k")["latents"].shape == (channels, 16, 16)
    _resealed(cache, "latents", "k", {"latents": torch.ones(channels, *side)})
    with pytest.raises(CacheError) as refused:
        cache.load("latents", "k")
    message = str(refused.value)
    assert "\n" not in message and "k.safetensors" in message and message.endswith("the next run recomputes it.")
    assert f"holds latents {side[0]}x{side[1]} in size" in message and "multiples of 2" in message
    assert cache.fill("latents", ["k"], lambda idx: [good for _ in idx]) == 1  # encoded again, with one line
    assert len(lines) == 1 and f"{side[0]}x{side[1]}" in lines[0] and lines[0].endswith("encoding it again.")
    assert cache.load("latents", "k")["latents"].shape == (channels, 16, 16)


@pytest.mark.usefixtures("torch_kernels")
def test_training_on_a_cache_with_resealed_odd_latents_re_encodes_them_and_trains(tmp_path):
    """The audit's run end to end: `squareq train` on a cache whose latents were resealed at 9x8 said so in a line per
    entry, encoded them again and trained (it ended in a ValueError traceback from the 2x2 packing)."""
    from click.testing import CliRunner
    from PIL import Image

    from squareq.cli import main
    from squareq.slab.atomic import atomic_write_bytes
    from squareq.slab.digest import hashed_safetensors, read_hashed

    from .tiny_run import w8_tiny_slab

    w8_tiny_slab(tmp_path / "tiny.slab")
    data = tmp_path / "data"
    data.mkdir()
    for i, color in enumerate([(220, 30, 30), (30, 30, 220)]):
        Image.new("RGB", (64, 64), color).save(data / f"img{i}.png")
        (data / f"img{i}.txt").write_text(f"square {i}")
    args = ["train", str(tmp_path / "tiny.slab"), "--data", str(data), "--resolution", "64", "--max-sequence-length",
            "16", "--steps", "1", "--rank", "2", "--cache-dir", str(tmp_path / "cache")]
    runner = CliRunner()
    first = runner.invoke(main, args + ["-o", str(tmp_path / "first")])
    assert first.exit_code == 0, first.output
    entries = sorted((tmp_path / "cache" / "latents").iterdir())
    for path in entries:
        kept = read_hashed(path)["latents"]
        assert kept.shape[-2:] == (8, 8)  # negative control: the 64x64 bucket's latents
        atomic_write_bytes(path, hashed_safetensors({"latents": torch.ones(kept.shape[0], 9, 8)}))  # resealed
    second = runner.invoke(main, args + ["-o", str(tmp_path / "second")])
    assert second.exit_code == 0 and "Traceback" not in second.output, second.output
    assert second.output.count("holds latents 9x8 in size") == len(entries) == 2
    assert "done: 1 step" in second.output
    assert all(read_hashed(p)["latents"].shape[-2:] == (8, 8) for p in entries)
