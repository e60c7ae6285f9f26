"""`squareq train` on clips (issue 62) with the tiny video models: a folder mixing images and clips (a GIF, an animated
WebP, a folder of frames) is cut into windows by the frame keys, each window's latents carry its frames, a batch never
mixes buckets over time, the cache is reused and a changed clip alone is encoded again; negative controls: a clip too
short for any count is skipped and named, clips beside an image family are refused, and shuffled frames change the
latents and the loss."""
import numpy as np
import pytest
import torch
from PIL import Image

from squareq.train.cache import EmbeddingCache
from squareq.train.config import load_config
from squareq.train.data import DataError
from squareq.train.loop import train

from .tiny_run import w8_tiny_slab

pytestmark = pytest.mark.usefixtures("torch_kernels")

try:
    import av  # noqa: F401 - the extra [video]
    HAVE_AV = True
except ImportError:
    HAVE_AV = False


def _slab(name, folder):
    return w8_tiny_slab(folder / f"{name}.slab", name)


def _frames(n: int, seed: int, size=64) -> list[Image.Image]:
    """``n`` frames of a square moving across a seeded background."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, (size, size, 3), dtype=np.uint8)
    frames = []
    for i in range(n):
        a = base.copy()
        a[8:24, 4 + 3 * i:20 + 3 * i] = (250, 40, 40)
        frames.append(Image.fromarray(a))
    return frames


def _write(folder, n_gif=9, n_webp=13, n_folder=9, short=3):
    folder.mkdir(parents=True, exist_ok=True)
    for name, color in (("still-a", (200, 30, 30)), ("still-b", (30, 30, 200))):
        Image.new("RGB", (64, 64), color).save(folder / f"{name}.png")
        (folder / f"{name}.txt").write_text(f"a {name} square")
    gif = _frames(n_gif, 1)
    gif[0].save(folder / "walk.gif", save_all=True, append_images=gif[1:], duration=62)
    (folder / "walk.txt").write_text("a red square walks")
    webp = _frames(n_webp, 2)
    webp[0].save(folder / "run.webp", save_all=True, append_images=webp[1:], duration=62, lossless=True)
    (folder / "run.txt").write_text("a red square runs")
    (folder / "jump").mkdir(exist_ok=True)
    for i, frame in enumerate(_frames(n_folder, 3)):
        frame.save(folder / "jump" / f"{i:03d}.png")
    (folder / "jump.txt").write_text("a red square jumps")
    tiny = _frames(short, 4)
    tiny[0].save(folder / "blink.gif", save_all=True, append_images=tiny[1:], duration=62)
    (folder / "blink.txt").write_text("too short")
    if HAVE_AV:  # the extra [video]: an MP4 of 13 frames
        _write_mp4(folder / "spin.mp4", _frames(13, 5))
        (folder / "spin.txt").write_text("a red square spins")
    return folder


def _write_mp4(path, frames):
    import av

    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=16)
        stream.width, stream.height, stream.pix_fmt = frames[0].size[0], frames[0].size[1], "yuv420p"
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_image(frame)))
        out.mux(stream.encode())


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    root = tmp_path_factory.mktemp("clips")
    return _slab("tiny-wan", root), _write(root / "data")


def _config(slab, data, out, **kw):
    values = {"slab": str(slab), "data": str(data), "output": str(out), "resolution": 64, "max_sequence_length": 16,
              "steps": 3, "lr": 1e-2, "rank": 4, "save_every": 0, "batch_size": 2, "cache_dir": str(out / "cache"),
              "target_frames": [5], "frame_extraction": "chunk"}
    return load_config(None, {**values, **kw})


def test_a_folder_of_images_and_clips_trains_in_buckets_over_time(wan, tmp_path, caplog):
    slab, data = wan
    said = []
    result = train(_config(slab, data, tmp_path / "run"), echo=said.append)
    assert result.steps == 3 and all(np.isfinite(result.losses))
    cache = EmbeddingCache(tmp_path / "run" / "cache")
    shapes = sorted(tuple(cache.load("latents", p.stem)["latents"].shape)
                    for p in (tmp_path / "run" / "cache" / "latents").iterdir())
    # two images (one frame each), walk.gif's 9 frames -> one window of 5 (chunk leaves the last 4 out),
    # run.webp's 13 -> two, jump/'s 9 -> one, spin.mp4's 13 -> two; blink.gif's 3 frames hold no window of 5
    frames = [s[1] for s in shapes]
    clips = 4 + (2 if HAVE_AV else 0)
    assert frames.count(1) == 2 and frames.count(5) == clips and len(frames) == 2 + clips
    assert any("blink.gif has 3 frames, fewer than any of target_frames [5]" in r.getMessage()
               for r in caplog.records)
    # the run's summary counts the clips' windows and buckets them over time
    n_clips = 3 + HAVE_AV  # walk.gif, run.webp, jump/ (and spin.mp4); blink.gif is left out
    assert any(line.startswith(f"data: 2 images and {clips} windows of {n_clips} clips from ") for line in said)
    assert any(line.startswith("buckets: ") and f"64x64 x 5 frames: {clips} entries" in line for line in said)
    # a batch holds one bucket over time: the trainer's batch order groups by (bucket, frames)
    from squareq.train.buckets import BucketBatches, make_buckets
    from squareq.train.clip_items import cut_clips
    from squareq.train.data import scan_dataset

    dataset = cut_clips(scan_dataset(data, clips=True), _config(slab, data, tmp_path / "x").frame_settings, "wan",
                        echo=lambda s: None)
    order = BucketBatches(dataset, make_buckets(64), batch_size=2, seed=0)
    lengths = [len(it.frames or (0,)) for it in dataset.training_items]
    for batch in order.epoch_batches(0):
        assert len({lengths[i] for i in batch}) == 1, batch
    # the cache is reused on a second run, and only a changed clip is encoded again
    said.clear()
    train(_config(slab, data, tmp_path / "again", cache_dir=str(tmp_path / "run" / "cache")), echo=said.append)
    assert any(s.startswith(f"cache {tmp_path / 'run' / 'cache'}: 0 new entries") for s in said), said


def test_shuffled_frames_change_the_latents_and_the_loss(tmp_path):
    """The negative control: the same frames in another order are another clip to the VAE and the trainer."""
    slab = _slab("tiny-wan", tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    frames = _frames(9, 7)
    frames[0].save(data / "walk.gif", save_all=True, append_images=frames[1:], duration=62)
    (data / "walk.txt").write_text("a red square walks")
    first = train(_config(slab, data, tmp_path / "a", batch_size=1, steps=1, target_frames=[9]), echo=lambda s: None)
    order = [0, 5, 2, 7, 4, 1, 8, 3, 6]
    shuffled = [frames[i] for i in order]
    shuffled[0].save(data / "walk.gif", save_all=True, append_images=shuffled[1:], duration=62)
    said = []
    second = train(_config(slab, data, tmp_path / "b", batch_size=1, steps=1, target_frames=[9],
                           cache_dir=str(tmp_path / "a" / "cache")), echo=said.append)
    assert any(": 1 new entries" in s for s in said)  # the clip's one window, encoded again; its caption reused
    a, b = (EmbeddingCache(tmp_path / "a" / "cache"), sorted((tmp_path / "a" / "cache" / "latents").iterdir()))
    assert len(b) == 2
    x, y = (a.load("latents", p.stem)["latents"] for p in b)
    assert x.shape == y.shape and not torch.equal(x, y)
    assert first.losses[0] != second.losses[0]


def test_an_image_family_reads_the_folder_as_it_always_has(tmp_path):
    """Clips are for the video families: beside an image family's slab the folder reads as before (GIFs and video
    files are no images, an animated WebP is its first frame, a frame folder's frames are uncaptioned images), and
    the library's cut refuses clips for it in one sentence naming one."""
    from squareq.train.clip_items import cut_clips
    from squareq.train.clips import FrameSettings
    from squareq.train.data import scan_dataset

    slab = w8_tiny_slab(tmp_path / "sd3.slab", "tiny-sd3")
    data = _write(tmp_path / "data")
    result = train(_config(slab, data, tmp_path / "out"), echo=lambda s: None)
    latents = list((tmp_path / "out" / "cache" / "latents").iterdir())
    assert result.steps == 3 and len(latents) == 3  # still-a, still-b and run.webp's first frame
    with pytest.raises(DataError, match=r"holds \d clips \(e\.g\. blink\.gif\); SquareQ trains on clips for Wan, "
                                        r"HunyuanVideo and LTX-Video, and this slab holds a sd3 model"):
        cut_clips(scan_dataset(data, clips=True), FrameSettings(), "sd3")


def test_frame_counts_round_down_to_the_vae_and_the_run_says_so(wan, tmp_path):
    slab, data = wan
    said = []
    train(_config(slab, data, tmp_path / "r", target_frames=[6, 7], frame_extraction="head", steps=1),
          echo=said.append)
    assert "target_frames [6, 7] rounded down to [5]: a wan clip has 1 + 4·k frames" in said


def test_a_clip_run_killed_and_resumed_ends_where_an_unbroken_one_does(wan, tmp_path):
    from squareq.train.lora_reader import load_lora

    slab, data = wan
    options = dict(steps=5, save_every=2, cache_dir=str(tmp_path / "cache"))
    straight = train(_config(slab, data, tmp_path / "straight", **options), echo=lambda s: None)

    def kill(step):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(_config(slab, data, tmp_path / "killed", **options), echo=lambda s: None, after_step=kill)
    resumed = train(_config(slab, data, tmp_path / "killed", resume="latest", **options), echo=lambda s: None)
    a, b = load_lora(straight.lora_file)[0], load_lora(resumed.lora_file)[0]
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("name", ["tiny-wan", "tiny-hunyuan-video", "tiny-ltx-video"])
def test_every_video_family_trains_on_a_clip(name, tmp_path):
    """A 9-frame window (1 + 4·2, and 1 + 8 for LTX-Video) of a clip trains each video family's tiny model; its
    latents keep the window's frames (the toy VAE encodes frame by frame)."""
    slab = _slab(name, tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    frames = _frames(11, 9)
    frames[0].save(data / "walk.gif", save_all=True, append_images=frames[1:], duration=62)
    (data / "walk.txt").write_text("a red square walks")
    result = train(_config(slab, data, tmp_path / "out", batch_size=1, steps=2, target_frames=[9]),
                   echo=lambda s: None)
    assert result.steps == 2 and all(np.isfinite(result.losses))
    cache = EmbeddingCache(tmp_path / "out" / "cache")
    (entry,) = (cache.load("latents", p.stem) for p in (tmp_path / "out" / "cache" / "latents").iterdir())
    assert entry["latents"].shape[1] == 9


@pytest.fixture(scope="module")
def wan_folder(tmp_path_factory):
    """tiny-wan's slab and its diffusers pipeline folder (a real AutoencoderKLWan: 4x in time), with one clip."""
    from ..models.tiny_folders import write_pipeline

    root = tmp_path_factory.mktemp("wan-folder")
    data = root / "data"
    data.mkdir()
    frames = _frames(9, 11)
    frames[0].save(data / "walk.gif", save_all=True, append_images=frames[1:], duration=62)
    (data / "walk.txt").write_text("a red square walks")
    return _slab("tiny-wan", root), write_pipeline("tiny-wan", root / "pipeline"), data


def test_a_lora_trained_on_clips_loads_into_wanpipeline_and_changes_its_output(wan_folder, tmp_path):
    """Through the pipeline's own VAE a 9-frame window is 3 latent frames (1 + 8/4); the LoRA trained on it is read by
    diffusers' WanPipeline.load_lora_weights as trained, and changes the pipeline's output."""
    from ..models.tiny_folders import lora_in_pipeline

    slab, folder, data = wan_folder
    result = train(_config(slab, data, tmp_path / "out", model=str(folder), batch_size=1, steps=4, lr=2e-2,
                           target_frames=[9]), echo=lambda s: None)
    cache = EmbeddingCache(tmp_path / "out" / "cache")
    (entry,) = (cache.load("latents", p.stem) for p in (tmp_path / "out" / "cache" / "latents").iterdir())
    assert entry["latents"].shape[1] == 3
    without, loaded = lora_in_pipeline("tiny-wan", slab, tmp_path / "out", result.lora_file)
    assert without > 1e-6 and loaded < 1e-4


def test_samples_during_training_are_clips(wan_folder, tmp_path):
    """A sample prompt's --f draws a clip through the family's pipeline, written as an animated WebP of that many
    frames; the grid shows each clip's first frame."""
    slab, folder, data = wan_folder
    train(_config(slab, data, tmp_path / "out", model=str(folder), batch_size=1, steps=2, target_frames=[9],
                  sample_every=2, sample_steps=2, sample_prompts=["a red square walks --f 5"]), echo=lambda s: None)
    clip = tmp_path / "out" / "samples" / "step-00000002-0.webp"
    with Image.open(clip) as img:
        assert img.n_frames == 5 and img.size == (64, 64)
    assert (tmp_path / "out" / "samples" / "step-00000002-grid.png").is_file()


def test_the_encoders_are_placed_for_the_longest_window():
    """A video VAE's feature maps grow with a window's frames (all, or a chunk at a time: sources/vae_memory.py), so
    the encoders are placed for the longest window's frames; images alone are one frame (the negative control)."""
    from pathlib import Path

    from squareq.train.data import Item
    from squareq.train.prepare import _encoder_run

    class Host:
        encoder_budget = None

    cfg = load_config(None, {"slab": "s", "data": "d", "output": "o", "resolution": 64})
    image = Item(Path("a.png"), "a", 64, 64)
    window = Item(Path("b.gif"), "b", 64, 64, frames=tuple(range(9)))
    run = lambda items: _encoder_run(cfg, items, Host(), "wan")  # noqa: E731
    assert (run([image]).pixels, run([image]).frames) == (64 * 64, 1)
    assert (run([image, window]).pixels, run([image, window]).frames) == (64 * 64, 9)


def test_a_metadata_jsonl_may_name_clips(tmp_path):
    from squareq.train.clip_items import cut_clips
    from squareq.train.clips import FrameSettings
    from squareq.train.data import scan_dataset

    data = tmp_path / "data"
    data.mkdir()
    frames = _frames(9, 12)
    frames[0].save(data / "walk.gif", save_all=True, append_images=frames[1:], duration=62)
    Image.new("RGB", (64, 64)).save(data / "still.png")
    (data / "metadata.jsonl").write_text('{"file_name": "walk.gif", "caption": "a walk"}\n'
                                         '{"file_name": "still.png", "caption": "a still"}\n')
    dataset = cut_clips(scan_dataset(data, clips=True), FrameSettings((5,)), "wan", echo=lambda s: None)
    assert [(it.path.name, it.caption, it.frames) for it in dataset.items] == [
        ("still.png", "a still", None), ("walk.gif", "a walk", (0, 1, 2, 3, 4))]


def test_a_clip_in_a_repeat_folder_repeats_and_a_validation_split_holds_out_whole_clips(tmp_path):
    from squareq.train.clip_items import cut_clips
    from squareq.train.clips import FrameSettings
    from squareq.train.data import hold_out, scan_dataset

    data = tmp_path / "data"
    (data / "3_walk").mkdir(parents=True)
    frames = _frames(11, 13)
    frames[0].save(data / "3_walk" / "walk.gif", save_all=True, append_images=frames[1:], duration=62)
    (data / "3_walk" / "walk.txt").write_text("a walk")
    (data / ".hidden").mkdir()
    dataset = cut_clips(scan_dataset(data, clips=True), FrameSettings((5,), "chunk"), "wan", echo=lambda s: None)
    assert [(it.frames, it.repeats) for it in dataset.items] == [((0, 1, 2, 3, 4), 3), ((5, 6, 7, 8, 9), 3)]
    assert len(dataset.training_items) == 6
    # one clip's windows cannot be split between training and validation: nothing would be left to train on
    with pytest.raises(DataError, match="holds out 1 of the 1 images and clips .* leaving none to train on"):
        hold_out(dataset, 0.1, seed=0)


def test_a_frame_folder_reads_its_frames_by_number_and_leaves_hidden_files_out(tmp_path):
    from squareq.train.clip_items import clip_digest
    from squareq.train.clips import frame_files, read_frames

    folder = tmp_path / "jump"
    folder.mkdir()
    for i, frame in enumerate(_frames(12, 14)):
        frame.save(folder / f"{i}.png")  # 0.png ... 11.png: unpadded, 10 after 9
    digest = clip_digest(folder)
    Image.new("RGB", (64, 64)).save(folder / ".thumb.png")
    assert [f.name for f in frame_files(folder)] == [f"{i}.png" for i in range(12)]
    assert clip_digest(folder) == digest  # a hidden file is no frame
    expected = [np.asarray(f) for f in _frames(12, 14)]
    got = read_frames(folder, [9, 10, 11])
    assert all(np.array_equal(np.asarray(g), expected[i]) for g, i in zip(got, [9, 10, 11], strict=True))


def test_clip_samples_decode_in_tiles():
    """A video family's pipeline decodes its clips in tiles; the negative controls: an image family's VAE, and a VAE
    that cannot tile, are left as they are."""
    from types import SimpleNamespace

    from squareq.train.sample import tile_clip_decodes

    calls = []

    def pipe_with(tiles: bool):
        vae = SimpleNamespace(enable_tiling=lambda: calls.append(1))
        if tiles:
            vae.tile_sample_min_height = 256
        return SimpleNamespace(vae=vae)

    assert not tile_clip_decodes(pipe_with(True), "qwen-image") and not calls
    assert not tile_clip_decodes(pipe_with(False), "wan") and not calls
    assert tile_clip_decodes(pipe_with(True), "wan") and calls == [1]
