"""Several datasets in one run (issue 62): kohya's and musubi-tuner's ``[[datasets]]`` tables, in the ``--config``
file or a ``dataset_config`` file, each with its own folder, resolution, batch size, repeats, caption extension and
frame keys; a batch never mixes datasets, each dataset's batches have its size, and a resumed order continues.
Negative controls: a key SquareQ does not take is refused by name, as are a bad value (naming the table), a folder
given twice, tables that disagree on a run-wide key, and ``enable_bucket = false``."""
import numpy as np
import pytest
from PIL import Image

from squareq.train.buckets import BucketBatches, make_buckets
from squareq.train.config import ConfigError, load_config
from squareq.train.data import Dataset
from squareq.train.loop import train
from squareq.train.prepare import _training_data

from .test_clip_training import _frames
from .tiny_run import w8_tiny_slab

pytestmark = pytest.mark.usefixtures("torch_kernels")


def _images(folder, n, size, ext=".txt", seed=0):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(folder / f"{i}.png")
        (folder / f"{i}{ext}").write_text(f"picture {i} of {folder.name}")
    return folder


def _toml(path, text):
    path.write_text(text)
    return path


MUSUBI = """
[general]
caption_extension = ".caption"
batch_size = 2
enable_bucket = true
bucket_no_upscale = false

[[datasets]]
image_directory = "{a}"
cache_directory = "{cache}"
resolution = [64, 64]
num_repeats = 3

[[datasets]]
video_directory = "{b}"
cache_directory = "{cache}"
resolution = [128, 128]
batch_size = 1
caption_extension = ".txt"
target_frames = [1, 5]
frame_extraction = "uniform"
frame_sample = 2
"""


def test_a_musubi_dataset_config_gives_each_dataset_its_keys(tmp_path):
    path = _toml(tmp_path / "data.toml", MUSUBI.format(a=tmp_path / "a", b=tmp_path / "b", cache=tmp_path / "c"))
    cfg = load_config(None, {"dataset_config": str(path), "slab": "s", "output": "o"})
    a, b = cfg.dataset_views()
    assert (a.data, a.resolution, a.batch_size, a.num_repeats, a.caption_ext) == (str(tmp_path / "a"), [64], 2, 3,
                                                                                  ".caption")
    assert (b.resolution, b.batch_size, b.num_repeats, b.caption_ext) == ([128], 1, 1, ".txt")
    assert (b.target_frames, b.frame_extraction, b.frame_sample) == ([1, 5], "uniform", 2)
    assert (a.target_frames, a.frame_extraction) == ([1], "head")  # the run's defaults where a table gives none
    assert cfg.cache_dir == str(tmp_path / "c") and cfg.no_upscale is False
    assert cfg.largest_resolution == 128 and cfg.largest_batch() == (128, 1, 1)
    assert cfg.largest_batch(4) == (128, 1, 5)  # b's longest window, 5 frames, is what the memory plan is made for
    # --print-config writes the tables, and --config reads them back as they were
    again = load_config(_toml(tmp_path / "printed.toml", cfg.to_toml()))
    assert again == cfg


def test_kohya_subsets_and_a_run_config_with_tables(tmp_path):
    path = _toml(tmp_path / "train.toml", f"""
[train]
steps = 7
resolution = 512

[[datasets]]
batch_size = 4
resolution = [768, 768]

  [[datasets.subsets]]
  image_dir = "{tmp_path / 'x'}"
  num_repeats = 10

  [[datasets.subsets]]
  image_dir = "{tmp_path / 'y'}"

[[datasets]]
image_dir = "{tmp_path / 'z'}"
""")
    views = load_config(path).dataset_views()
    assert [(v.data[-1], v.resolution, v.batch_size, v.num_repeats) for v in views] == [
        ("x", [768], 4, 10), ("y", [768], 4, 1), ("z", [512], 1, 1)]  # z: the run's resolution and batch size


@pytest.mark.parametrize("table, said", [
    ('image_directory = "A"\nimage_jsonl_file = "x.jsonl"', "unknown key image_jsonl_file"),
    ('image_directory = "A"\nflip_aug = true', "unknown key flip_aug"),
    ('image_directory = "A"\nnum_repeat = 2', "unknown key num_repeat (did you mean num_repeats?)"),
    ('image_directory = "A"\nenable_bucket = false', "enable_bucket = false: SquareQ always buckets"),
    ('image_directory = "A"\nimage_dir = "B"', "image_dir gives data a second time"),
    ('num_repeats = 2', "[[datasets]] table 1 names no folder"),
    ('image_directory = "A"\nbatch_size = 0', "[[datasets]] table 1 ('A'): batch_size = 0"),
    ('image_directory = "A"\nresolution = [512, 768, 1024]', "a [[datasets]] table's resolution is one side or"),
    ('image_directory = "A"\nframe_extraction = "middle"', "[[datasets]] table 1 ('A'): frame_extraction"),
])
def test_a_table_key_that_cannot_work_is_refused_by_name(tmp_path, table, said):
    path = _toml(tmp_path / "c.toml", f"[[datasets]]\n{table}\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert said in str(exc.value) and str(path) in str(exc.value)


def test_folders_or_run_keys_in_two_places_are_refused(tmp_path):
    both = _toml(tmp_path / "both.toml", 'data = "D"\n[[datasets]]\nimage_directory = "A"\n')
    with pytest.raises(ConfigError, match="put every folder in a"):
        load_config(both)
    caches = _toml(tmp_path / "caches.toml", '[[datasets]]\nimage_directory = "A"\ncache_directory = "c1"\n'
                   '[[datasets]]\nimage_directory = "B"\ncache_directory = "c2"\n')
    with pytest.raises(ConfigError, match="sets cache_dir = 'c2' and"):
        load_config(caches)
    tables = _toml(tmp_path / "t.toml", '[[datasets]]\nimage_directory = "A"\n')
    other = _toml(tmp_path / "d.toml", '[[datasets]]\nimage_directory = "B"\n')
    with pytest.raises(ConfigError, match="keep one of them"):
        load_config(tables, {"dataset_config": str(other)})
    with pytest.raises(ConfigError, match="holds train beside"):
        load_config(None, {"dataset_config": str(_toml(tmp_path / "e.toml", "[train]\nsteps = 1\n"))})


def test_batches_hold_one_dataset_each_at_its_size_and_resume(tmp_path):
    """Two image datasets and a clip dataset: each batch holds one dataset's entries, as many as its batch size
    (a last short one aside), each at its own resolution; a saved order continues exactly."""
    _images(tmp_path / "a", 5, (64, 64))
    _images(tmp_path / "b", 3, (128, 96), ext=".caption")
    clips = tmp_path / "c"
    clips.mkdir()
    frames = _frames(9, 1)
    frames[0].save(clips / "walk.gif", save_all=True, append_images=frames[1:], duration=62)
    (clips / "walk.txt").write_text("a red square walks")
    path = _toml(tmp_path / "c.toml", f"""
[[datasets]]
image_directory = "{tmp_path / 'a'}"
batch_size = 2
resolution = 64
num_repeats = 2
[[datasets]]
image_directory = "{tmp_path / 'b'}"
caption_extension = ".caption"
batch_size = 3
resolution = 128
[[datasets]]
video_directory = "{clips}"
resolution = 64
target_frames = [5]
frame_extraction = "slide"
frame_stride = 4
""")
    cfg = load_config(path)
    dataset = _training_data(cfg, "wan", echo=lambda s: None)
    assert [g.batch_size for g in dataset.groups] == [2, 3, 1]
    order = BucketBatches(dataset, make_buckets(1024), [g.batch_size for g in dataset.groups], seed=3)
    entries = [it for it in dataset.training_items]
    assert len(entries) == 5 * 2 + 3 + 2  # a's images twice, b's once, the clip's two windows (frames 0-4, 4-8)
    sizes = {0: 2, 1: 3, 2: 1}
    for batch in order.epoch_batches(0):
        groups = {entries[i].group for i in batch}
        assert len(groups) == 1, batch
        assert len(batch) <= sizes[groups.pop()]
    buckets = dict(zip(range(len(entries)), order.item_buckets))
    assert {buckets[i] for i, it in enumerate(entries) if it.group == 0} == {(64, 64)}
    assert {buckets[i] for i, it in enumerate(entries) if it.group == 1} == {(128, 128)}  # not 1024²'s
    # the negative control of the grouping: the same entries as one dataset at 64 px mix a's and b's in batches
    mixed = BucketBatches(Dataset(dataset.root, dataset.items), make_buckets(64), 4, seed=3)
    assert any(len({entries[i].group for i in b}) > 1 for b in mixed.epoch_batches(0))
    first = BucketBatches(dataset, make_buckets(1024), [2, 3, 1], seed=3)
    taken = [b for _, b in zip(range(4), first)]
    resumed = BucketBatches(dataset, make_buckets(1024), [2, 3, 1], seed=3)
    resumed.load_state_dict(first.state_dict())
    reference = BucketBatches(dataset, make_buckets(1024), [2, 3, 1], seed=3)
    assert [b for _, b in zip(range(10), reference)] == taken + [b for _, b in zip(range(6), resumed)]


def test_a_run_trains_two_datasets_and_says_each(tmp_path):
    slab = w8_tiny_slab(tmp_path / "flux.slab", "tiny-flux")
    _images(tmp_path / "a", 3, (64, 64))
    _images(tmp_path / "b", 2, (96, 64), seed=1)
    path = _toml(tmp_path / "c.toml", f"""
steps = 3
lr = 1e-2
rank = 4
save_every = 0
max_sequence_length = 16
[[datasets]]
image_directory = "{tmp_path / 'a'}"
resolution = 64
batch_size = 3
[[datasets]]
image_directory = "{tmp_path / 'b'}"
resolution = 128
""")
    said = []
    result = train(load_config(path, {"slab": str(slab), "output": str(tmp_path / "out")}), echo=said.append)
    assert result.steps == 3 and all(np.isfinite(result.losses))
    assert any(s.startswith("dataset 1 (batch size 3): data: 3 images from ") for s in said), said
    assert any(s.startswith("dataset 2 (batch size 1): buckets: 128x128: 2 entries") for s in said), said
    assert any(s.startswith("steps: 3 (3/1 images a batch by dataset;") for s in said), said
