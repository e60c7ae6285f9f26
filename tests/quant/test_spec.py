import pytest

from squareq.quant import QuantSpec, SpecError


def test_spec_round_trips_through_dict():
    spec = QuantSpec(bits=6, group_size=128, symmetric=True, scale_dtype="bfloat16", clip_ratio=0.85, smooth=True)
    assert QuantSpec.from_dict(spec.to_dict()) == spec
    assert spec.to_dict()["packing"] == "u6x4"


@pytest.mark.parametrize(
    "kwargs",
    [dict(bits=5), dict(group_size=48), dict(group_size=4), dict(scale_dtype="float64"), dict(clip_ratio=0.0),
     dict(clip_ratio=1.5)],
)
def test_invalid_specs_are_refused(kwargs):
    with pytest.raises(SpecError):
        QuantSpec(**kwargs)


def test_from_dict_refuses_unknown_fields_and_wrong_packing():
    with pytest.raises(SpecError, match="unknown"):
        QuantSpec.from_dict({"bits": 4, "colour": "red"})
    with pytest.raises(SpecError, match="packing"):
        QuantSpec.from_dict({"bits": 4, "packing": "u6x4"})


def test_specs_are_frozen():
    with pytest.raises(Exception):
        QuantSpec().bits = 8


def test_rotation_is_recorded_only_when_set_and_shown_in_the_label():
    rotated = QuantSpec(bits=4, group_size=64, rotate=True)
    d = rotated.to_dict()
    assert d["rotate"] is True and QuantSpec.from_dict(d) == rotated
    assert rotated.label() == "W4 g64 asym H" and rotated.short_label == "W4"  # the rung's name is unchanged
    plain = QuantSpec(bits=4, group_size=64)
    assert "rotate" not in plain.to_dict() and plain.label() == "W4 g64 asym"
    # a manifest written before rotation existed (no key) reads as unrotated
    old = {"bits": 4, "group_size": 64, "symmetric": False, "scale_dtype": "float16", "clip_ratio": 1.0,
           "smooth": False, "packing": "u4x2"}
    assert QuantSpec.from_dict(old) == plain and not QuantSpec.from_dict(old).rotate


@pytest.mark.parametrize("kwargs,message", [
    (dict(bits=16, rotate=True), "passthrough.*cannot be rotated"),
    (dict(bits=4, symmetric=True, format="nf4", rotate=True), "format 'nf4' cannot be rotated"),
    (dict(bits=8, symmetric=True, format="fp8_e4m3", rotate=True), "format 'fp8_e4m3' cannot be rotated"),
    (dict(rotate=1), "rotate=1 must be true or false"),
])
def test_specs_that_cannot_rotate_are_refused_in_a_sentence(kwargs, message):
    with pytest.raises(SpecError, match=message):
        QuantSpec(**kwargs)
    assert QuantSpec(**{**kwargs, "rotate": False})  # the same spec unrotated is fine
