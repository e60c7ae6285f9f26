"""Hostile user files, mutated by hypothesis with a fixed seed (as tests/test_fuzz.py does for slabs, checkpoints and
cache entries): a cached Hub snapshot (its refs, configs, pipeline index and links), ComfyUI's single encoder files,
loss masks, clips, and regularisation folders. Each mutation ends in success or in one sentence of a user error,
never another exception."""
from __future__ import annotations

import io
import json
import os
import shutil
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from .test_fuzz import FUZZ, _one_sentence, mutated, raises_other_than_a_user_error
from .user_files import STAND_IN_REPO, stand_in_pipeline, write_comfyui_files, write_hub_cache

pytestmark = pytest.mark.usefixtures("torch_kernels")


def _outcome(run) -> None:
    """``run()`` succeeds or raises one sentence of a user error."""
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - what it raises is under test
        _one_sentence(exc)


# --------------------------------------------------------------------------------------------- Hub snapshot


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    cache = tmp_path_factory.mktemp("hub") / "cache"
    return cache, write_hub_cache(cache, stand_in_pipeline())


def _json_file(data, path):
    path.write_text(json.dumps(data.draw(mutated(json.loads(path.read_text())))))


def _damage_snapshot(data, snap):
    """One hostile change to a snapshot: a mutated config or pipeline index, odd bytes in refs/main, or a file
    replaced by a link to another file of the snapshot (or to nothing)."""
    kind = data.draw(st.sampled_from(["index", "config", "config", "refs", "link"]))
    if kind == "index":
        _json_file(data, snap / "model_index.json")
    elif kind == "config":
        _json_file(data, snap / data.draw(st.sampled_from(["text_encoder", "text_encoder_2", "vae", "transformer"]))
                   / "config.json")
    elif kind == "refs":
        (snap.parents[1] / "refs" / "main").write_bytes(data.draw(st.binary(max_size=48)))
    else:
        files = sorted(p for p in snap.rglob("*") if p.is_file() and not p.is_symlink())
        victim, target = data.draw(st.sampled_from(files)), data.draw(st.sampled_from(files + [snap / "nothing"]))
        victim.unlink()
        victim.symlink_to(target)


@settings(FUZZ, max_examples=40)
@given(data=st.data())
def test_a_damaged_hub_snapshot_opens_or_is_refused_in_one_sentence(snapshot, tmp_path_factory, data):
    from squareq.sources import hub, open_source
    from squareq.sources.encoders import open_encoders

    cache = tmp_path_factory.mktemp("hub-fuzz", numbered=True) / "cache"
    shutil.copytree(snapshot[0], cache, symlinks=True)
    _damage_snapshot(data, cache / snapshot[1].relative_to(snapshot[0]))
    before = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_HUB_CACHE")}
    os.environ.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache))
    hub._fetch.cache_clear()

    def use():
        open_source(STAND_IN_REPO)
        with open_encoders(STAND_IN_REPO, torch.device("cpu"), "flux", dtype=torch.float32) as encoders:
            encoders.encode_prompts(["a cat"], 16)

    try:
        _outcome(use)
    finally:
        hub._fetch.cache_clear()
        for k, v in before.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def test_negative_control_without_the_loading_boundary_the_fuzzer_finds_a_crash(snapshot, tmp_path_factory,
                                                                                monkeypatch):
    """With the boundary's catch-all switched off (sources/boundary.py's ``reading`` letting every error through),
    mutated configs must find a traceback."""
    import contextlib

    from hypothesis import find

    from squareq.sources import encoders, hub, pipeline_encoders, skeletons
    from squareq.sources.encoders import open_encoders

    for module in (encoders, hub, pipeline_encoders, skeletons):
        monkeypatch.setattr(module, "reading", lambda *a, **kw: contextlib.nullcontext())
    cache = tmp_path_factory.mktemp("hub-control") / "cache"
    shutil.copytree(snapshot[0], cache, symlinks=True)
    config = cache / snapshot[1].relative_to(snapshot[0]) / "vae" / "config.json"
    original = json.loads(config.read_text())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))

    def opens():
        with open_encoders(STAND_IN_REPO, torch.device("cpu"), "flux", dtype=torch.float32):
            pass

    def crashes(tree) -> bool:
        config.write_text(json.dumps(tree))
        hub._fetch.cache_clear()
        return raises_other_than_a_user_error(opens)

    find(mutated(original), crashes, settings=settings(FUZZ, max_examples=500))


# --------------------------------------------------------------------------------------------- ComfyUI single files


@pytest.fixture(scope="module")
def comfyui(tmp_path_factory):
    pipe = stand_in_pipeline()
    folder = tmp_path_factory.mktemp("pipeline") / "flux"
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder, write_comfyui_files(pipe, tmp_path_factory.mktemp("comfyui"))


def _mutated_header(data, raw: bytes) -> bytes:
    (n,) = struct.unpack("<Q", raw[:8])
    text = json.dumps(data.draw(mutated(json.loads(raw[8:8 + n])))).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text + raw[8 + n:]


@settings(FUZZ, max_examples=60)
@given(data=st.data())
def test_a_damaged_comfyui_encoder_file_loads_or_is_refused_in_one_sentence(comfyui, tmp_path_factory, data):
    from squareq.sources.encoder_source import EncoderSource
    from squareq.sources.hub import read_index
    from squareq.sources.single_files import load_single_files

    folder, files = comfyui
    flag = data.draw(st.sampled_from(["clip_l", "t5", "vae"]))
    raw = files[flag].read_bytes()
    if data.draw(st.booleans()):
        damaged = _mutated_header(data, raw)
    else:  # cut anywhere, or one byte flipped in the header
        damaged = bytearray(raw[:data.draw(st.integers(0, len(raw)))])
        if damaged and data.draw(st.booleans()):
            damaged[data.draw(st.integers(0, min(len(damaged), 400) - 1))] ^= data.draw(st.integers(1, 255))
    path = tmp_path_factory.mktemp("comfy-fuzz", numbered=True) / files[flag].name
    path.write_bytes(bytes(damaged))
    source = EncoderSource(str(folder), ((flag, str(path)),))
    _outcome(lambda: load_single_files(source, folder, read_index(folder), torch.float32))


# --------------------------------------------------------------------------------------------- masks and clips


def _image_bytes(data, fmt: str, frames: int = 1) -> bytes:
    w, h = data.draw(st.integers(1, 48)), data.draw(st.integers(1, 48))
    mode = data.draw(st.sampled_from(["L", "RGB", "RGBA", "P", "1", "LA"] if fmt == "PNG" else ["RGB", "L"]))
    value = data.draw(st.integers(0, 255))
    pictures = [Image.new(mode, (w, h), value) for _ in range(frames)]
    buf = io.BytesIO()
    pictures[0].save(buf, fmt, **({"save_all": True, "append_images": pictures[1:]} if frames > 1 else {}))
    raw = bytearray(buf.getvalue())
    how = data.draw(st.sampled_from(["whole", "cut", "flip", "junk"]))
    if how == "cut":
        raw = raw[:data.draw(st.integers(0, len(raw)))]
    elif how == "flip" and raw:
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
    elif how == "junk":
        raw = bytearray(data.draw(st.binary(max_size=64)))
    return bytes(raw)


@settings(FUZZ, max_examples=150)
@given(data=st.data())
def test_a_damaged_mask_is_read_or_refused_in_one_sentence(tmp_path_factory, data):
    from squareq.train.masks import ALPHA, check_masks, load_mask

    folder = tmp_path_factory.mktemp("masks", numbered=True)
    image = folder / "a.png"
    Image.new("RGB", (32, 32), 128).save(image)
    mask = folder / "a-mask.png"
    mask.write_bytes(_image_bytes(data, "PNG"))
    alpha = data.draw(st.booleans())
    if alpha:
        image.write_bytes(_image_bytes(data, "PNG"))
    item = type("Item", (), {"path": image})()
    source = ALPHA if alpha else mask

    def use():
        check_masks([item], [source])
        load_mask(image, source, (32, 32))

    _outcome(use)


def test_negative_control_without_the_mask_guard_the_fuzzer_finds_a_crash(tmp_path_factory, monkeypatch):
    """With train/masks.py's ``_reading`` letting every decode error through, cut PNGs must find a traceback."""
    import contextlib

    from hypothesis import find

    from squareq.train import masks

    monkeypatch.setattr(masks, "_reading", lambda path: contextlib.nullcontext())
    folder = tmp_path_factory.mktemp("masks-control")
    image, mask = folder / "a.png", folder / "a-mask.png"
    Image.new("RGB", (32, 32), 128).save(image)
    buf = io.BytesIO()
    Image.new("L", (32, 32), 200).save(buf, "PNG")
    whole = buf.getvalue()

    def crashes(cut: int) -> bool:
        mask.write_bytes(whole[:cut])
        return raises_other_than_a_user_error(lambda: masks.check_masks([type("Item", (), {"path": image})()], [mask]))

    find(st.integers(0, len(whole)), crashes, settings=settings(FUZZ, max_examples=200))


@settings(FUZZ, max_examples=150)
@given(data=st.data())
def test_a_damaged_clip_is_read_or_refused_in_one_sentence(tmp_path_factory, data):
    from squareq.train.clips import frame_count, read_frames

    fmt = data.draw(st.sampled_from(["GIF", "WEBP"]))
    path = tmp_path_factory.mktemp("clips", numbered=True) / f"c.{fmt.lower()}"
    path.write_bytes(_image_bytes(data, fmt, frames=data.draw(st.integers(1, 6))))

    def use():
        n = frame_count(path)
        read_frames(path, list(range(min(n, 3))))

    _outcome(use)


# --------------------------------------------------------------------------------------------- regularisation folders


@settings(FUZZ, max_examples=60)
@given(data=st.data())
def test_an_odd_regularisation_folder_is_read_or_refused_in_one_sentence(tmp_path_factory, data):
    from squareq.train.data import DataError, load_image, scan_dataset, with_regularisation
    from squareq.train.tiny_dataset import write_tiny_dataset

    root = tmp_path_factory.mktemp("reg", numbered=True)
    train = write_tiny_dataset(root / "data", count=2)
    reg = root / "reg"
    reg.mkdir()
    names = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="/\x00"), min_size=1,
                    max_size=12)
    for _ in range(data.draw(st.integers(0, 4))):
        stem = data.draw(names)
        if stem in (".", ".."):
            continue
        ext = data.draw(st.sampled_from([".png", ".jpg", ".txt", ".webp", ".gif", ""]))
        body = _image_bytes(data, "PNG") if ext in (".png", ".webp", ".gif", ".jpg") else \
            data.draw(st.binary(max_size=40))
        try:
            (reg / f"{stem}{ext}").write_bytes(body)
        except OSError:  # a name the file system refuses is not one a user can have
            continue

    def use():  # what a run does with the folder: scan both, mix, then read each image at its bucket
        try:
            pool = scan_dataset(reg)
        except DataError as exc:  # the trainer's own wording (train/prepare.py)
            raise DataError(f"reg_data (--reg-data): {exc}") from None
        for item in with_regularisation(scan_dataset(train), pool).items:
            load_image(item.path, (64, 64))

    _outcome(use)
