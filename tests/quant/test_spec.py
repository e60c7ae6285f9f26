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
