"""host="shared": one host copy of a slab's blobs for every process of a host, created once, removed by the last user."""
from __future__ import annotations

import os

import pytest
import torch

from squareq import runtime
from squareq.runtime.host import pinned as host_memory
from squareq.runtime.loader import runtime_of

from .harness import inputs


@pytest.fixture(autouse=True)
def shm(tmp_path, monkeypatch):
    monkeypatch.setenv("SQUAREQ_KERNELS", "torch")
    folder = tmp_path / "shm"
    folder.mkdir()
    monkeypatch.setenv("SQUAREQ_SHM_DIR", str(folder))
    return folder


def _arena(model):
    return runtime_of(model).streamer.host


def _forward(model):
    with torch.no_grad():
        return model(**inputs("cpu"), return_dict=False)[0]


def test_two_loads_map_one_copy_and_the_last_user_removes_it(tiny_slab, shm):
    a = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(host="shared"))
    b = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(host="shared"))
    arena_a, arena_b = _arena(a), _arena(b)
    assert (arena_a.memory.created, arena_b.memory.created) == (True, False)
    path = arena_a.memory.path
    assert path == arena_b.memory.path and path.parent == shm and path.stat().st_size == arena_a.host_bytes
    # the same pages, not two copies: a byte written through one mapping is read through the other
    before = int(arena_b.buffer[7])
    arena_a.buffer[7] = (before + 1) % 256
    assert int(arena_b.buffer[7]) == (before + 1) % 256
    arena_a.buffer[7] = before

    pinned = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(host="pinned"))
    assert torch.equal(_forward(b), _forward(pinned))
    assert _arena(pinned).memory.path is None

    runtime_of(a).close()
    assert path.exists(), "removed while another process still maps it"
    runtime_of(b).close()
    assert not path.exists()
    assert [p.name for p in shm.iterdir() if not p.name.endswith(".lock")] == []


def test_a_copy_left_by_a_killed_job_is_reused_and_a_half_written_one_is_not(tiny_slab, shm):
    first = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(host="shared"))
    path = _arena(first).memory.path
    left = path.read_bytes()
    runtime_of(first).close()
    part = path.with_name(path.name.replace(".blobs", "") + ".999999.part")
    part.write_bytes(left[: len(left) // 2])  # a creator killed mid-fill: never trusted
    refilled = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(host="shared"))
    assert _arena(refilled).memory.created is True and not part.exists()
    runtime_of(refilled).close()

    path.write_bytes(left)  # as a SIGKILLed job leaves a finished copy (its locks die with it)
    again = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(host="shared"))
    assert _arena(again).memory.created is False
    assert torch.equal(_forward(again), _forward(runtime.load(tiny_slab, "cpu")))
    runtime_of(again).close()
    assert not path.exists()


def test_too_little_room_for_the_shared_copy_names_the_remedies(tiny_slab, monkeypatch):
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(host_memory.shutil, "disk_usage", lambda p: usage(100, 90, 10))
    with pytest.raises(host_memory.HostMemoryError, match="--shm-size.*SQUAREQ_SHM_DIR.*--host disk"):
        runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(host="shared"))


def _load_in_child(slab: str, shm: str, results, release) -> None:
    os.environ.update(SQUAREQ_SHM_DIR=shm, SQUAREQ_KERNELS="torch")
    torch.set_num_threads(1)
    model = runtime.load(slab, "cpu", options=runtime.LoadOptions(host="shared"))
    arena = _arena(model)
    results.put((arena.memory.created, os.stat(arena.memory.path).st_ino, float(_forward(model).float().sum())))
    release.get()  # hold the mapping until the parent has heard from both children
    runtime_of(model).close()


def test_processes_share_one_copy_filled_once(tiny_slab, shm):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results, release = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_load_in_child, args=(str(tiny_slab), str(shm), results, release)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [results.get(timeout=300) for _ in procs]
    for _ in procs:
        release.put(None)
    for p in procs:
        p.join(timeout=120)
    assert sorted(created for created, _, _ in got) == [False, True]
    assert got[0][1] == got[1][1] and got[0][2] == got[1][2]
    assert [p.name for p in shm.iterdir() if p.name.endswith(".blobs")] == []


def test_copies_of_other_slabs_that_no_job_holds_are_removed(tiny_slab, shm):
    import fcntl

    uid = os.getuid()
    dead, live = (shm / f"squareq-{uid}-{name}" for name in ("deadbeef", "cafef00d"))
    for base in (dead, live):
        base.with_name(base.name + ".blobs").write_bytes(b"x" * 1000)
        base.with_name(base.name + ".users.lock").touch()
    holder = os.open(live.with_name(live.name + ".users.lock"), os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_SH)  # a running job still maps this one
    try:
        model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(host="shared"))
        assert not dead.with_name(dead.name + ".blobs").exists()
        assert live.with_name(live.name + ".blobs").exists()
        runtime_of(model).close()
    finally:
        os.close(holder)
