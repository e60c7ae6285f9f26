"""host="auto": page-locked RAM when the blobs fit in the memory available with room to spare, else the slab file."""
import logging

import pytest

from squareq import runtime
from squareq.runtime.host import budget as host_choice
from squareq.runtime.host.budget import RESERVE_MIN_BYTES, choose_host

from .harness import assert_same, inputs, step, with_lora

GB = 10**9


def test_the_blobs_are_pinned_when_they_fit_with_room_to_spare_and_read_from_disk_otherwise():
    host, why = choose_host(6 * GB, memory=(64 * GB, 128 * GB))
    assert host == "pinned" and "fit in the 64.0 GB" in why
    # 12.8 GB kept for the rest (10% of 128 GB): 60 + 12.8 > 64
    host, why = choose_host(60 * GB, memory=(64 * GB, 128 * GB))
    assert host == "disk" and "do not fit" in why and "--host pinned" in why
    # a small host keeps at least RESERVE_MIN_BYTES
    assert choose_host(10 * GB, memory=(10 * GB + RESERVE_MIN_BYTES, 16 * GB))[0] == "pinned"
    assert choose_host(10 * GB, memory=(10 * GB + RESERVE_MIN_BYTES - 1, 16 * GB))[0] == "disk"
    assert choose_host(10 * GB, memory=None)[0] == "pinned"  # nothing reported: the fast way
    available, total = host_choice.host_memory()
    assert 0 < available <= total


@pytest.fixture
def reference(tiny_slab, monkeypatch):
    monkeypatch.setenv("SQUAREQ_KERNELS", "torch")
    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(stream=False))
    with_lora(model)
    return step(model, inputs("cpu"), checkpointing=False)


@pytest.mark.parametrize("available, chosen", [(1 << 40, "pinned"), (1 << 20, "disk")])
def test_load_with_host_auto_says_what_it_chose_and_streams_the_same(tiny_slab, reference, monkeypatch, caplog,
                                                                     available, chosen):
    monkeypatch.setattr(host_choice, "host_memory", lambda: (available, 1 << 41))
    caplog.set_level(logging.INFO, logger="squareq.runtime")
    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=2, host="auto"))
    rt = runtime.runtime_of(model)
    try:
        assert rt.host == chosen and rt.host_reason
        (record,) = [r for r in caplog.records if r.getMessage().startswith("host auto: ")]
        assert record.getMessage().startswith(f"host auto: {chosen}: ")
        assert record.levelno == (logging.WARNING if chosen == "disk" else logging.INFO)
        with_lora(model)
        assert_same(step(model, inputs("cpu"), checkpointing=True), reference)
    finally:
        rt.close()
