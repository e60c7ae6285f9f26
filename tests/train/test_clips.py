"""Clips as data (train/clips.py): musubi-tuner's frame keys pick the frames its documentation says they pick, each
count rounded down to one the family's VAE takes; GIFs, animated WebPs, folders of frames and (with PyAV) MP4s read
back frame by frame, in order."""
import numpy as np
import pytest
from PIL import Image

from squareq.extras import MissingExtra
from squareq.train import clips
from squareq.train.clips import ClipError, FrameSettings, frame_count, read_frames, resampled, round_down, windows

FORTY = 40  # the clip of musubi-tuner's diagrams (docs/dataset_config.md, "frame_extraction Options")


def test_head_takes_the_first_n_frames():
    assert windows(FORTY, FrameSettings((1, 13, 25), "head")) == [(0, 1), (0, 13), (0, 25)]


def test_chunk_cuts_consecutive_windows_and_leaves_out_a_short_last_piece():
    assert windows(FORTY, FrameSettings((13, 25), "chunk")) == [(0, 13), (13, 13), (26, 13), (0, 25)]


def test_slide_starts_a_window_every_frame_stride_frames_while_it_fits():
    got = windows(FORTY, FrameSettings((1, 13, 25), "slide", frame_stride=10))
    assert got == [(0, 1), (10, 1), (20, 1), (30, 1), (0, 13), (10, 13), (20, 13), (0, 25), (10, 25)]


def test_uniform_spreads_frame_sample_windows_from_the_first_frame_to_the_last_start():
    got = windows(FORTY, FrameSettings((1, 13, 25), "uniform", frame_sample=4))
    # the diagram draws the third one-frame window at frame 25; the rule it illustrates (starts spread evenly from 0
    # to 39, rounded down, as musubi-tuner computes them) puts it at 26, and the other eleven where the diagram does
    assert got == [(0, 1), (13, 1), (26, 1), (39, 1), (0, 13), (9, 13), (18, 13), (27, 13),
                   (0, 25), (5, 25), (10, 25), (15, 25)]
    assert windows(FORTY, FrameSettings((13,), "uniform", frame_sample=1)) == [(0, 13)]  # one sample: head


def test_full_takes_the_whole_clip_up_to_max_frames_rounded_to_the_vae():
    settings = FrameSettings(frame_extraction="full", max_frames=31)
    # the diagram's three clips of 20, 25 and 35 frames; "trimmed to N*4+1" makes 31 frames 29 (it draws 31)
    assert [windows(n, settings, stride=4) for n in (20, 25, 35)] == [[(0, 17)], [(0, 25)], [(0, 29)]]


def test_counts_round_down_per_family_and_say_so():
    settings, said = FrameSettings((17, 18, 30)).for_family("wan")
    assert settings.target_frames == (17, 29) and "rounded down to [17, 29]" in said and "1 + 4·k" in said
    assert FrameSettings((17, 30)).for_family("ltx-video")[0].target_frames == (17, 25)
    assert FrameSettings((17, 29)).for_family("wan")[1] is None  # nothing changed: nothing said
    assert [round_down(n, 8) for n in (1, 8, 9, 16, 17)] == [1, 1, 9, 9, 17]


def test_a_clip_too_short_for_any_count_gets_no_window():
    assert windows(12, FrameSettings((13, 25), "chunk")) == []
    assert windows(12, FrameSettings((13,), "slide")) == []
    assert windows(12, FrameSettings((1, 13))) == [(0, 1)]


def test_source_fps_thins_a_clip_to_the_family_s_rate():
    # each source frame moves the output on by 16/30 of a frame, summed as musubi-tuner sums it (in floating point:
    # fifteen steps come to just under 8, so frame 15 lands on output frame 7 and is dropped, frame 16 on 8)
    assert resampled(30, 30.0, 16.0) == [0, 2, 4, 6, 8, 10, 12, 14, 16, 17, 19, 21, 23, 25, 27, 29]
    assert resampled(10, 24.0, 16.0) == [0, 2, 3, 5, 7, 8, 9]
    assert resampled(10, 16.0, 16.0) == list(range(10))  # the family's own rate: every frame


@pytest.mark.parametrize("key, value, said", [
    ("target_frames", (0, 5), "whole numbers of frames of at least 1"),
    ("target_frames", (), "whole numbers"),
    ("frame_extraction", "middle", "one of head, chunk, slide, uniform, full"),
    ("frame_stride", 0, "at least 1"),
    ("frame_sample", 2.5, "at least 1"),
    ("max_frames", True, "at least 1"),
    ("source_fps", 0, "frame rate above 0"),
])
def test_a_frame_setting_that_cannot_work_is_refused_by_name(key, value, said):
    FrameSettings().check()  # the defaults work
    with pytest.raises(ClipError, match=f"^data.toml: {key} = .* {said}"):
        FrameSettings(**{key: value}).check("data.toml")


def _frames(n: int, size=(24, 16)) -> list[Image.Image]:
    """``n`` frames, frame i filled with grey level 10·i (kept apart by lossy codecs)."""
    return [Image.new("RGB", size, (10 * i,) * 3) for i in range(n)]


def _levels(frames) -> list[int]:
    return [int(round(np.asarray(f, dtype=np.float32).mean() / 10)) for f in frames]


@pytest.fixture
def clip_files(tmp_path):
    frames = _frames(20)
    gif = tmp_path / "walk.gif"
    frames[0].save(gif, save_all=True, append_images=frames[1:], duration=62, loop=0)
    webp = tmp_path / "run.webp"
    frames[0].save(webp, save_all=True, append_images=frames[1:], duration=62, lossless=True)
    folder = tmp_path / "jump"
    folder.mkdir()
    for i, f in enumerate(frames):
        f.save(folder / f"{i:04d}.png")
    still = tmp_path / "still.webp"
    frames[3].save(still)
    return {"gif": gif, "webp": webp, "folder": folder, "still": still}


@pytest.mark.parametrize("kind", ["gif", "webp", "folder"])
def test_a_clip_reads_back_frame_by_frame_in_order(kind, clip_files):
    path = clip_files[kind]
    assert frame_count(path) == 20
    assert _levels(read_frames(path)) == list(range(20))
    assert _levels(read_frames(path, [4, 5, 6, 19])) == [4, 5, 6, 19]
    assert _levels(read_frames(path, [7, 2])) == [7, 2]  # in the order asked for


def test_which_files_are_clips(clip_files, tmp_path):
    assert clips.is_clip(clip_files["gif"]) and clips.is_clip(clip_files["webp"])
    assert not clips.is_clip(clip_files["still"])  # a WebP of one frame is an image
    assert not clips.is_clip(tmp_path / "photo.png")
    assert clips.is_clip(tmp_path / "talk.mp4")  # by its extension: read through PyAV


def test_an_mp4_reads_back_through_pyav(tmp_path):
    av = pytest.importorskip("av")
    path = tmp_path / "clip.mp4"
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=16)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        stream.options = {"crf": "0"}  # lossless, so each frame's level survives
        for frame in _frames(12, (32, 32)):
            out.mux(stream.encode(av.VideoFrame.from_image(frame)))
        out.mux(stream.encode())
    assert frame_count(path) == 12
    assert _levels(read_frames(path, [0, 5, 11])) == [0, 5, 11]


def test_a_video_without_pyav_names_the_pip_command(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "av", None)  # as if not installed
    (tmp_path / "clip.mp4").write_bytes(b"")
    with pytest.raises(MissingExtra, match=r"the video file .*clip.mp4 needs av, which is not installed; install "
                                           r"SquareQ's video extra with: pip install"):
        frame_count(tmp_path / "clip.mp4")


def test_a_damaged_clip_is_one_sentence_naming_it(tmp_path):
    bad = tmp_path / "broken.gif"
    bad.write_bytes(b"GIF89a not really")
    with pytest.raises(ClipError, match=f"^{bad} could not be read as a clip .*leave it out of the data folder"):
        read_frames(bad)
    with pytest.raises(ClipError, match="fewer frames"):
        read_frames(_write_gif(tmp_path / "short.gif", 3), [0, 5])


def _write_gif(path, n):
    frames = _frames(n)
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=62)
    return path
