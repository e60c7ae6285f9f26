import torch

from squareq.models import FLUX, ModelError, adapter_for, build_tiny_flux, load_builtin, tiny_flux_inputs
from squareq.models.tiny import OUTLIER_ACT_GAIN, TINY_FLUX_CONFIG, outlier_channels

import pytest


def test_tiny_flux_is_deterministic_and_runs(tiny_flux):
    model, _ = tiny_flux
    again = build_tiny_flux()
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    with torch.no_grad():
        out = model(**tiny_flux_inputs()).sample
    assert out.shape == (1, 64, TINY_FLUX_CONFIG["in_channels"]) and torch.isfinite(out).all()


def test_tiny_flux_has_planted_outlier_channels(tiny_flux):
    model, _ = tiny_flux
    hidden = model.inner_dim
    idx = outlier_channels(hidden, 0)
    rows = model.x_embedder.weight.abs().amax(dim=1)
    others = torch.ones(hidden, dtype=torch.bool)
    others[idx] = False
    assert rows[idx].min() > 0.5 * OUTLIER_ACT_GAIN * rows[others].median()


def test_flux_block_discovery(tiny_flux):
    model, adapter = tiny_flux
    assert adapter is FLUX and adapter_for(model) is FLUX
    assert adapter.blocks(model) == [
        "transformer_blocks.0",
        "transformer_blocks.1",
        "single_transformer_blocks.0",
        "single_transformer_blocks.1",
    ]


def test_unknown_models_are_refused():
    with pytest.raises(ModelError, match="built-in"):
        load_builtin("huge-flux")
    with pytest.raises(ModelError, match="no SquareQ family adapter"):
        adapter_for(torch.nn.Linear(2, 2))
    with pytest.raises(ModelError, match="no block list"):
        FLUX.blocks(torch.nn.Linear(2, 2))


def test_tiny_z_image_takes_a_caption_of_hundreds_of_tokens():
    """The fourth audit: the tiny config's RoPE table held 64 caption positions, so compile's default calibration
    (32 samples) and a long caption ended in an IndexError deep in diffusers."""
    import torch

    from squareq.models.z_image import build_tiny_z_image, z_image_synthetic_inputs

    model = build_tiny_z_image()
    for tokens in (16, 300):  # a short caption (what the old table held) and a long one
        batch = z_image_synthetic_inputs(model, 1, 0, side=8, text_tokens=tokens)
        with torch.no_grad():
            out = model(**batch.kwargs)
        assert torch.isfinite(out[0][0]).all()
