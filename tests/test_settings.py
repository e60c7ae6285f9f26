"""squareq.settings reads TRITON_INTERPRET as Triton does, so the backend choice and the kernels' rounding path
agree with whether Triton interprets."""
import pytest

from squareq import settings
from squareq.kernels.triton_fp8 import _hardware_conversion


@pytest.mark.parametrize("value", ["1", "true", "ON", " yes "])
def test_triton_interpret_takes_tritons_true_words(monkeypatch, value):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert settings.triton_interpret() and not _hardware_conversion()


@pytest.mark.parametrize("value", ["0", "", "false", "no"])
def test_anything_else_is_the_gpu(monkeypatch, value):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert not settings.triton_interpret() and _hardware_conversion()
