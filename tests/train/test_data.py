"""Training data: scanning a folder, skipping bad files with reasons, buckets, images, captions, resumable batches."""
import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from squareq.train.buckets import BucketBatches, bucket_for, make_buckets
from squareq.train.data import DataError, Dataset, Item, caption_for, load_image, scan_dataset


def _image(path: Path, size=(96, 80), color=(200, 30, 30), noise=False):
    path.parent.mkdir(parents=True, exist_ok=True)
    if noise:  # incompressible, so a chopped file really lacks pixel data
        pixels = np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
        img = Image.fromarray(pixels)
    else:
        img = Image.new("RGB", size, color)
    img.save(path)
    return path


def _captioned(root: Path, rel: str, caption: str, **kw):
    image = _image(root / rel, **kw)
    image.with_suffix(".txt").write_text(caption, encoding="utf-8")
    return image


def _reasons(data: Dataset) -> dict[str, str]:
    return {s.path.name: s.reason for s in data.skipped}


# ---------------------------------------------------------------------------------------------- scanning

def test_folder_with_captions_gives_sorted_items(tmp_path):
    _captioned(tmp_path, "b.png", "  a red square \n", size=(96, 80))
    _captioned(tmp_path, "a.JPG", "a photo", size=(70, 120))
    _captioned(tmp_path, "sub/c.webp", "in a subfolder")
    _captioned(tmp_path, ".cache/d.png", "hidden, ignored")
    (tmp_path / "notes.txt").write_text("not a caption of anything")
    data = scan_dataset(tmp_path)
    assert [it.path.relative_to(tmp_path).as_posix() for it in data.items] == ["a.JPG", "b.png", "sub/c.webp"]
    assert len(data) == 3 and data.skipped == []
    b = data.items[1]
    assert (b.caption, b.width, b.height) == ("a red square", 96, 80)
    assert (data.items[0].width, data.items[0].height) == (70, 120)


def test_metadata_jsonl_wins_over_txt_captions(tmp_path):
    _image(tmp_path / "img/one.png")
    _image(tmp_path / "two.png", size=(128, 64))
    _captioned(tmp_path, "three.png", "only listed in a .txt, so ignored")
    lines = [{"file_name": "two.png", "text": "second"}, {"file_name": "img/one.png", "caption": "first"}]
    (tmp_path / "metadata.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    data = scan_dataset(tmp_path)
    assert [(it.path.name, it.caption) for it in data.items] == [("one.png", "first"), ("two.png", "second")]
    assert (data.items[1].width, data.items[1].height) == (128, 64)
    # an image the metadata does not list is left out with a word, not silently
    assert list(_reasons(data)) == ["three.png"]
    assert "three.png is not listed in metadata.jsonl" in _reasons(data)["three.png"]


def test_each_bad_file_is_skipped_with_a_reason_naming_it(tmp_path, caplog):
    _captioned(tmp_path, "good.png", "fine")
    truncated = _captioned(tmp_path, "truncated.png", "cut short", size=(128, 128), noise=True)
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    cut_jpeg = _captioned(tmp_path, "cut.jpg", "cut short too", size=(128, 128), noise=True)
    cut_jpeg.write_bytes(cut_jpeg.read_bytes()[: cut_jpeg.stat().st_size // 2])
    (tmp_path / "fake.png").write_text("I am text, not an image")
    (tmp_path / "fake.txt").write_text("caption of a fake image")
    _captioned(tmp_path, "small.png", "tiny", size=(200, 40))
    _image(tmp_path / "photos/nocap.png")
    _captioned(tmp_path, "empty.png", "  \n ")
    with caplog.at_level(logging.WARNING, logger="squareq.train"):
        data = scan_dataset(tmp_path, min_side=64)
    assert [it.path.name for it in data.items] == ["good.png"]
    reasons = _reasons(data)
    assert set(reasons) == {"truncated.png", "cut.jpg", "fake.png", "small.png", "nocap.png", "empty.png"}
    assert reasons["truncated.png"].startswith("truncated.png could not be decoded")
    assert reasons["cut.jpg"].startswith("cut.jpg could not be decoded")
    assert reasons["fake.png"].startswith("fake.png could not be decoded")
    assert "200x40" in reasons["small.png"] and "64-pixel" in reasons["small.png"]
    assert reasons["nocap.png"] == ("photos/nocap.png has no caption: add photos/nocap.txt "
                                    "or a metadata.jsonl line for it.")
    assert reasons["empty.png"].startswith("empty.txt is empty") and "empty.png" in reasons["empty.png"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 7  # one per skipped file plus the summary
    assert all(any(name in w for w in warnings) for name in reasons)
    assert "6 of 7 images" in warnings[-1]


def test_kohya_repeat_folders_count_their_repeats_and_caption_by_folder_name(tmp_path):
    """``10_sks dog/`` trains each image 10 times an epoch and captions an image without a caption file
    "sks dog"; a caption file still wins; a 0-repeat folder is skipped with a reason; a plain subfolder gives no
    caption (negative control)."""
    _image(tmp_path / "10_sks dog/a.png")
    _captioned(tmp_path, "3_cat/b.png", "a cat on a mat")
    _image(tmp_path / "0_never/c.png")
    _captioned(tmp_path, "d.png", "at the top")
    _image(tmp_path / "plain/e.png")
    data = scan_dataset(tmp_path)
    got = {it.path.name: (it.caption, it.repeats) for it in data.items}
    assert got == {"a.png": ("sks dog", 10), "b.png": ("a cat on a mat", 3), "d.png": ("at the top", 1)}
    assert len(data.training_items) == 14
    assert [it.path.name for it in data.training_items].count("a.png") == 10
    reasons = _reasons(data)
    assert set(reasons) == {"c.png", "e.png"}
    assert "repeat count is 0" in reasons["c.png"] and "has no caption" in reasons["e.png"]


def test_a_folder_named_like_a_huge_repeat_count_is_reported(tmp_path, caplog):
    _captioned(tmp_path, "2024_trip/a.png", "a beach")
    with caplog.at_level(logging.WARNING, logger="squareq.train"):
        data = scan_dataset(tmp_path)
    assert data.items[0].repeats == 2024
    assert any("2024_trip/: 1 images, each 2024 times" in r.getMessage() and "rename the folder" in r.getMessage()
               for r in caplog.records)


def test_caption_ext_reads_kohya_caption_files(tmp_path):
    _image(tmp_path / "a.png")
    (tmp_path / "a.caption").write_text("from a .caption file")
    assert [it.caption for it in scan_dataset(tmp_path, caption_ext=".caption").items] == ["from a .caption file"]
    with pytest.raises(DataError):  # the default .txt finds no caption for it
        scan_dataset(tmp_path)


def test_bad_jsonl_lines_and_missing_files_are_skipped(tmp_path):
    _image(tmp_path / "ok.png")
    _image(tmp_path / "blank.png")
    (tmp_path / "metadata.jsonl").write_text("\n".join([
        json.dumps({"file_name": "ok.png", "caption": "fine"}),
        "{not json",
        json.dumps({"caption": "no file name"}),
        json.dumps({"file_name": "gone.png", "caption": "missing"}),
        json.dumps({"file_name": "blank.png", "caption": " "}),
    ]))
    data = scan_dataset(tmp_path)
    assert [it.caption for it in data.items] == ["fine"]
    reasons = [s.reason for s in data.skipped]
    assert len(reasons) == 4
    assert reasons[0].startswith("metadata.jsonl line 2 is not valid JSON")
    assert reasons[1].startswith("metadata.jsonl line 3 has no file_name")
    assert reasons[2].startswith("metadata.jsonl line 4 names gone.png") and "fix the file_name" in reasons[2]
    assert reasons[3].startswith("blank.png has an empty caption in metadata.jsonl line 5")


@pytest.mark.parametrize("file_name", ["../outside.png", "{outside}", "sub/../../outside.png"])
def test_a_jsonl_file_name_outside_the_folder_is_refused(tmp_path, file_name):
    """The audit's case: a metadata.jsonl file_name pointing outside the data folder was read."""
    outside = _image(tmp_path / "outside.png")
    data = tmp_path / "data"
    _image(data / "inside.png")
    lines = [{"file_name": "inside.png", "caption": "fine"},
             {"file_name": file_name.format(outside=outside), "caption": "not yours"}]
    (data / "metadata.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    with pytest.raises(DataError) as err:
        scan_dataset(data)
    message = str(err.value)
    assert "metadata.jsonl line 2" in message and f"leads to {outside}, outside the data folder {data}" in message
    (data / "metadata.jsonl").write_text(json.dumps(lines[0]))  # negative control: the inside line alone is fine
    assert [it.path.name for it in scan_dataset(data).items] == ["inside.png"]


@pytest.mark.parametrize("bad_line, why", [
    ("[" * 200_000 + "]" * 200_000, "metadata.jsonl line 2 is not valid JSON (it nests too deeply to read)"),
    (json.dumps({"file_name": "ok.png\0.png", "caption": "nul"}), "metadata.jsonl line 2 has a NUL character in its "
                                                                    "file_name"),
    (json.dumps({"file_name": "nul.png", "caption": "\0\0\0"}), "nul.png has a caption with the control character "
                                                                  "U+0000 in metadata.jsonl line 2"),
])
def test_a_jsonl_line_too_deep_or_with_control_characters_is_one_sentence_naming_the_line(tmp_path, bad_line, why):
    """Issue 40, item 9: a line nested 200,000 deep was a RecursionError and a NUL in file_name a ValueError, both
    tracebacks; a caption of NUL bytes was cached. Each line is skipped like any malformed line, so a folder with
    nothing else stops the run in one sentence; the control: the good line alone trains."""
    _image(tmp_path / "ok.png")
    _image(tmp_path / "nul.png")
    good = json.dumps({"file_name": "ok.png", "caption": "fine"})
    (tmp_path / "metadata.jsonl").write_text(good + "\n" + bad_line + "\n")
    data = scan_dataset(tmp_path)
    reasons = [s.reason for s in data.skipped]  # the line's own, then nul.png's where the line does not list it
    assert [it.caption for it in data.items] == ["fine"] and reasons[0].startswith(why), reasons
    assert "\n" not in reasons[0]
    (tmp_path / "metadata.jsonl").write_text(bad_line + "\n")
    (tmp_path / "ok.png").unlink()
    with pytest.raises(DataError, match="No training images"):
        scan_dataset(tmp_path)


def test_a_caption_file_of_control_characters_is_skipped_naming_it(tmp_path):
    """Issue 40, item 9: a caption file of NUL bytes (a binary file, or UTF-16 read as UTF-8) was cached as a caption.
    Control characters but tab, line feed and carriage return are refused; the control: those three are kept."""
    _captioned(tmp_path, "nul.png", "\0" * 8)
    _captioned(tmp_path, "bell.png", "a dog\x07")
    _captioned(tmp_path, "fine.png", "a dog,\tsitting\r\non grass")
    data = scan_dataset(tmp_path)
    assert [it.path.name for it in data.items] == ["fine.png"]
    reasons = _reasons(data)
    assert reasons["nul.png"].startswith("nul.txt holds the control character U+0000, so it is not a plain-text "
                                         "caption")
    assert "U+0007" in reasons["bell.png"]


@pytest.mark.parametrize("linked", ["image", "caption"])
def test_a_linked_file_outside_the_folder_is_refused(tmp_path, linked):
    elsewhere = tmp_path / "elsewhere"
    _captioned(elsewhere, "secret.png", "a secret")
    data = tmp_path / "data"
    _captioned(data, "own.png", "my own")
    if linked == "image":
        (data / "x.png").symlink_to(elsewhere / "secret.png")
        (data / "x.txt").write_text("caption")
    else:
        _image(data / "x.png")
        (data / "x.txt").symlink_to(elsewhere / "secret.txt")
    with pytest.raises(DataError, match=f"leads to {elsewhere}.*outside the data folder"):
        scan_dataset(data)
    inner = data / "y.png"  # negative control: a link that stays inside the folder is fine
    (data / "x.png").unlink()
    (data / "x.txt").unlink()
    inner.symlink_to(data / "own.png")
    inner.with_suffix(".txt").write_text("the same picture")
    assert sorted(it.path.name for it in scan_dataset(data).items) == ["own.png", "y.png"]


def test_nothing_usable_raises_naming_the_folder(tmp_path):
    _image(tmp_path / "nocap.png")
    with pytest.raises(DataError, match="No training images in .*none of the 1 files"):
        scan_dataset(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match=f"{empty.name}: it holds no images"):
        scan_dataset(empty)
    with pytest.raises(DataError, match="does not exist"):
        scan_dataset(tmp_path / "missing")
    with pytest.raises(DataError, match="is not a folder"):
        scan_dataset(tmp_path / "nocap.png")


# ---------------------------------------------------------------------------------------------- buckets

@pytest.mark.parametrize("resolution,step", [(1024, 64), (512, 64), (1024, 16), (100, 32)])
def test_buckets_respect_step_area_and_ratio(resolution, step):
    buckets = make_buckets(resolution, step=step, max_ratio=2.0)
    side = resolution // step * step
    assert (side, side) in buckets
    assert buckets == sorted(set(buckets))
    for w, h in buckets:
        assert w % step == 0 and h % step == 0
        assert w * h <= resolution * resolution
        assert max(w, h) / min(w, h) <= 2.0
        assert (h, w) in buckets
    if resolution >= 1024:  # enough 64-pixel steps to come near the ratio limit in both orientations
        assert max(w / h for w, h in buckets) > 1.8 and min(w / h for w, h in buckets) < 1 / 1.8


def test_tiny_resolutions_get_the_square_bucket():
    assert make_buckets(64) == [(64, 64)]
    assert make_buckets(128) == [(128, 128)]
    assert (128, 128) in make_buckets(128, step=16, min_side=256)  # min_side capped at the square side
    with pytest.raises(ValueError, match="smaller than the bucket step"):
        make_buckets(32, step=64)


def test_bucket_for_picks_the_closest_aspect_ratio():
    buckets = make_buckets(1024)
    assert bucket_for(500, 500, buckets) == (1024, 1024)
    assert bucket_for(1920, 1080, buckets) == (1344, 768)
    assert bucket_for(1080, 1920, buckets) == (768, 1344)
    assert bucket_for(5000, 1000, buckets) == (1408, 704)  # beyond the widest: the widest
    for w, h in [(640, 480), (333, 999), (1200, 1100)]:
        chosen = bucket_for(w, h, buckets)
        best = min(abs(math.log(b[0] / b[1]) - math.log(w / h)) for b in buckets)
        assert abs(math.log(chosen[0] / chosen[1]) - math.log(w / h)) == best
    # equal ratios: the larger area wins, whatever the list order
    assert bucket_for(100, 100, [(64, 64), (128, 128)]) == bucket_for(100, 100, [(128, 128), (64, 64)]) == (128, 128)


# ---------------------------------------------------------------------------------------------- images

def test_load_image_covers_the_bucket_and_center_crops(tmp_path):
    # 200x100: black outer quarters, white middle; a square bucket keeps only the middle half.
    pixels = np.zeros((100, 200, 3), dtype=np.uint8)
    pixels[:, 50:150] = 255
    Image.fromarray(pixels).save(tmp_path / "wide.png")
    x = load_image(tmp_path / "wide.png", (64, 64))
    assert x.shape == (3, 64, 64) and x.dtype == torch.float32
    assert x.min() >= -1 and x.max() <= 1
    assert x[:, :, 2:-2].mean() > 0.95  # white only: the black sides were cropped away
    assert torch.equal(x, load_image(tmp_path / "wide.png", (64, 64)))
    y = load_image(tmp_path / "wide.png", (128, 64))
    assert y.shape == (3, 64, 128) and y.min() < -0.9 and y.max() > 0.9  # same ratio: nothing cropped


def test_load_image_handles_grey_alpha_and_exif_rotation(tmp_path):
    Image.new("L", (80, 80), 0).save(tmp_path / "grey.png")
    assert torch.allclose(load_image(tmp_path / "grey.png", (64, 64)), torch.full((3, 64, 64), -1.0))
    Image.new("RGBA", (80, 80), (0, 0, 0, 0)).save(tmp_path / "clear.png")
    assert torch.allclose(load_image(tmp_path / "clear.png", (64, 64)), torch.ones(3, 64, 64))
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90° clockwise to display"
    Image.new("RGB", (160, 96), (10, 20, 30)).save(tmp_path / "rotated.png", exif=exif)
    (tmp_path / "rotated.txt").write_text("a portrait photo")
    item = scan_dataset(tmp_path).items[-1]
    assert (item.path.name, item.width, item.height) == ("rotated.png", 96, 160)
    assert load_image(item.path, (64, 128)).shape == (3, 128, 64)


# ---------------------------------------------------------------------------------------------- captions

def test_caption_trigger_is_prepended_once():
    assert caption_for("a dog on grass") == "a dog on grass"
    assert caption_for("a dog on grass", trigger="sks") == "sks, a dog on grass"
    assert caption_for("sks, a dog on grass", trigger="sks") == "sks, a dog on grass"
    assert caption_for("sks dog", trigger="sks") == "sks dog"
    assert caption_for("sksdog runs", trigger="sks") == "sks, sksdog runs"  # only a whole word counts
    assert caption_for("", trigger="sks") == "sks"


def test_trigger_placeholder_is_replaced_in_place():
    assert caption_for("a photo of [trigger] on a beach", "sks") == "a photo of sks on a beach"
    assert caption_for("[trigger], [trigger] again", "sks") == "sks, sks again"
    assert caption_for("no placeholder", "sks") == "sks, no placeholder"


def test_no_upscale_keeps_a_small_image_at_its_own_size():
    """A 200x136 image at resolution 512 would be enlarged to cover its bucket; with no_upscale it trains at
    192x128 (its size in steps of 64); a large image gets the usual bucket either way."""
    buckets = make_buckets(512)
    usual = bucket_for(200, 136, buckets)
    assert usual[0] > 200 and usual[1] > 136
    assert bucket_for(200, 136, buckets, no_upscale=True) == (192, 128)
    assert bucket_for(1200, 800, buckets, no_upscale=True) == bucket_for(1200, 800, buckets)
    # more pixels than the bucket but one side shorter (3000x600 at 1024): the bucket, never its own 2944x576
    wide = bucket_for(3000, 600, make_buckets(1024), no_upscale=True)
    assert wide == bucket_for(3000, 600, make_buckets(1024)) and wide[0] * wide[1] <= 1024 * 1024
    data = Dataset(Path("."), [Item(Path("small.png"), "s", 200, 136), Item(Path("big.png"), "b", 1200, 800)])
    assert sorted(BucketBatches(data, buckets, 1, 0, no_upscale=True).item_buckets) == sorted(
        [(192, 128), bucket_for(1200, 800, buckets)])


def test_an_epoch_goes_through_repeated_images_as_often_as_their_repeats():
    data = Dataset(Path("."), [Item(Path("a.png"), "a", 64, 64, repeats=3), Item(Path("b.png"), "b", 64, 64)])
    batches = BucketBatches(data, make_buckets(64), 1, 0)
    seen = [data.training_items[i].path.name for batch in batches.epoch_batches(0) for i in batch]
    assert sorted(seen) == ["a.png", "a.png", "a.png", "b.png"]


def test_caption_dropout_rate_and_determinism():
    def run(seed, trigger=None):
        g = torch.Generator().manual_seed(seed)
        return [caption_for("a cat", trigger, dropout=0.3, generator=g) for _ in range(4000)]

    out = run(0)
    assert set(out) == {"", "a cat"}
    assert abs(out.count("") / len(out) - 0.3) < 0.03
    assert run(0) == out and run(1) != out
    with_trigger = run(0, trigger="sks")
    assert [c == "sks" for c in with_trigger] == [c == "" for c in out]  # dropout keeps the trigger
    assert set(with_trigger) == {"sks", "sks, a cat"}
    g = torch.Generator().manual_seed(0)
    assert all(caption_for("a cat", dropout=1.0, generator=g) == "" for _ in range(10))
    with pytest.raises(ValueError, match="between 0 and 1"):
        caption_for("a cat", dropout=1.5)


# ---------------------------------------------------------------------------------------------- batches

def _dataset(n=23):
    shapes = [(512, 512), (800, 400), (400, 800), (600, 500)]
    items = [Item(Path(f"{i:03d}.png"), f"c{i}", *shapes[i % len(shapes)]) for i in range(n)]
    return Dataset(Path("."), items)


def _take(batches, n):
    """The next n batches, crossing epoch boundaries."""
    out, epochs = [], 0
    while len(out) < n:
        epochs += 1
        assert epochs <= n + 1, "an epoch yielded no batch"  # stall instead of looping forever
        for b in batches:
            out.append(b)
            if len(out) == n:
                break
    return out


def test_batches_hold_one_bucket_and_cover_each_epoch():
    data, buckets = _dataset(), make_buckets(512)
    bb = BucketBatches(data, buckets, batch_size=4, seed=7)
    epoch0 = list(bb)
    assert bb.state_dict()["epoch"] == 1 and bb.state_dict()["position"] == 0
    assert len(epoch0) == len(bb) == 8  # buckets of 6, 6, 6, 5 images: 2 batches each
    assert sorted(i for b in epoch0 for i in b) == list(range(len(data)))
    for b in epoch0:
        assert len({bb.item_buckets[i] for i in b}) == 1 and 1 <= len(b) <= 4
    epoch1 = list(bb)
    assert epoch1 != epoch0 and sorted(map(sorted, epoch1)) != sorted(map(sorted, epoch0))
    assert list(BucketBatches(data, buckets, batch_size=4, seed=7)) == epoch0  # same seed, same order
    dropped = BucketBatches(data, buckets, batch_size=4, seed=7, drop_last=True)
    assert all(len(b) == 4 for b in dropped) and len(dropped) == 4


@pytest.mark.parametrize("k", [0, 3, 7, 8, 13])
def test_resumed_batches_continue_exactly(k):
    data, buckets = _dataset(), make_buckets(512)
    reference = _take(BucketBatches(data, buckets, batch_size=4, seed=3), 24)  # three epochs
    first = BucketBatches(data, buckets, batch_size=4, seed=3)
    assert _take(first, k) == reference[:k]
    state = first.state_dict()
    resumed = BucketBatches(data, buckets, batch_size=4, seed=3)
    resumed.load_state_dict(state)
    assert _take(resumed, 24 - k) == reference[k:]


def test_resume_refuses_other_settings():
    data, buckets = _dataset(), make_buckets(512)
    state = BucketBatches(data, buckets, batch_size=4, seed=3).state_dict()
    with pytest.raises(ValueError, match="other data, buckets, batch size or seed"):
        BucketBatches(data, buckets, batch_size=2, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="drop_last leaves no batch"):
        BucketBatches(data, buckets, batch_size=7, seed=3, drop_last=True)


def test_peek_shows_the_next_batch_across_epochs_without_advancing():
    data, buckets = _dataset(), make_buckets(512)
    reference = _take(BucketBatches(data, buckets, batch_size=4, seed=5), 20)
    bb = BucketBatches(data, buckets, batch_size=4, seed=5)
    seen = []
    it = iter(bb)
    while len(seen) < 20:
        ahead = bb.peek()
        assert bb.peek() == ahead  # peeking twice changes nothing
        batch = next(it, None)
        if batch is None:
            it = iter(bb)
            continue
        assert batch == ahead
        seen.append(batch)
    assert seen == reference


def test_several_resolutions_train_every_image_at_each():
    """resolution = [64, 128]: each image is an entry at 64² and one at 128², in buckets of each size; one
    resolution's bucket list works as before (negative control: one entry per image)."""
    data = Dataset(Path("."), [Item(Path("a.png"), "a", 200, 200), Item(Path("b.png"), "b", 300, 150, repeats=2)])
    both = BucketBatches(data, [make_buckets(64), make_buckets(128)], 1, 0)
    assert len(both.item_buckets) == 2 * 3
    assert {b[0] * b[1] <= 64 * 64 for b in both.item_buckets[:3]} == {True}
    assert {64 * 64 < b[0] * b[1] <= 128 * 128 for b in both.item_buckets[3:]} == {True}
    assert len(BucketBatches(data, make_buckets(64), 1, 0).item_buckets) == 3


def test_caption_orders_shuffle_tags_behind_the_kept_ones_and_the_trigger():
    from squareq.train.data import caption_orders

    caption = "a dog, red collar, grass, sunny, park"
    orders = caption_orders(caption, "sks", keep_tokens=1, count=8, seed=3)
    assert len(orders) == 8 and len(set(orders)) == 8
    assert all(o.startswith("sks, a dog, ") for o in orders)
    assert {frozenset(o.split(", ")) for o in orders} == {frozenset(["sks", *caption.split(", ")])}
    assert caption_orders(caption, "sks", 1, 8, seed=3) == orders  # the cache finds them again
    assert caption_orders(caption, "sks", 1, 8, seed=4) != orders
    # a kohya caption with the trigger as its first tag: it stays first whatever keep_tokens says
    assert all(o.startswith("sks, ") for o in caption_orders("sks, " + caption, "sks", 0, 8, seed=3))
    assert sorted(caption_orders("a, b", None, 0, 8, seed=0)) == ["a, b", "b, a"]  # only two orders exist
    assert caption_orders("one tag only", "sks", 0, 8, seed=0) == ["sks, one tag only"]
    assert caption_orders(caption, None, 0, 0, seed=0) == [caption]  # shuffle off
    # negative control: without keep_tokens the first tag moves too
    assert not all(o.startswith("a dog") for o in caption_orders(caption, None, 0, 8, seed=3))


def test_keep_tokens_without_shuffle_is_refused(tmp_path):
    from squareq.train.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="keep_tokens = 2 only applies with shuffle_caption"):
        load_config(None, {"slab": "s", "data": "d", "output": "o", "keep_tokens": 2})
    assert load_config(None, {"slab": "s", "data": "d", "output": "o", "keep_tokens": 2,
                              "shuffle_caption": True}).keep_tokens == 2


def test_a_caption_starting_with_the_trigger_keeps_it_in_front_when_shuffled():
    from squareq.train.data import caption_orders

    tags = "red collar, grass, sunny, park, dusk"
    for caption, trigger, first in (("sks person, " + tags, "sks", "sks person, "),
                                    ("[trigger] person, " + tags, "sks", "sks person, "),
                                    (tags, "sks, woman", "sks, woman, ")):
        orders = caption_orders(caption, trigger, 0, 8, seed=1)
        assert len(orders) == 8 and all(o.startswith(first) for o in orders), (caption, orders[:2])
