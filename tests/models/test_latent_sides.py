"""A cached latent's height and width (models/cache_entry.py's ``model_problem``, from each recipe's
``latent_multiple``): accepted exactly when the family's denoiser takes the latent and gives back a prediction of its
shape. Issue 63: a resealed latent of an odd side passed every check and ended in a traceback in FLUX's 2x2 packing."""
import pytest
import torch
from diffusers.configuration_utils import FrozenDict

from squareq.models import BUILTIN_MODELS, load_builtin
from squareq.models.cache_entry import model_problem
from squareq.models.recipe import stack_captions
from squareq.sources.encoders import open_encoders

BUCKET = (64, 128)  # width, height: not square, so a height and a width that are swapped differ
CHANGES = ((0, 0), (1, 0), (0, 1), (2, 2), (4, 0), (4, 4))  # added to the bucket's latent's (height, width)


def _denoiser_takes(model, recipe, config, entry, text) -> bool:
    """Whether one training forward of ``entry`` runs and predicts a tensor of the latent's shape."""
    latents = entry["latents"][None]
    extra = {k: v[None] for k, v in entry.items() if k != "latents"}  # Würstchen's decoder: its image embedding
    t = torch.full((1,), 500 if recipe.objective == "epsilon" else 0.5)
    try:
        with torch.no_grad():
            output = model(**recipe.forward(config, latents, t, {**extra, **stack_captions([text])}, 1.0))
            return recipe.prediction(output, latents).shape == latents.shape
    except (ValueError, RuntimeError):  # the packing's refusal, a reshape or a concatenation of other sizes
        return False


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_a_latent_side_is_accepted_exactly_when_the_denoiser_takes_it(name):
    """Negative control first: the entry the family's encoders make of an image of the bucket's size is accepted and
    trains. Then sides the bucket does not give: refused where (and only where) the denoiser cannot take them."""
    model, adapter = load_builtin(name)
    model = model.float()
    recipe, config = adapter.recipe, FrozenDict(dict(model.config))
    with open_encoders(name, torch.device("cpu"), adapter.family, config, dtype=torch.float32) as encoders:
        encoded = encoders.encode_image(torch.zeros(3, BUCKET[1], BUCKET[0]))
        text = encoders.encode_prompts(["a square"], 16)[0]
    entry = encoded if isinstance(encoded, dict) else {"latents": encoded}
    shape = entry["latents"].shape
    assert shape[-2:] == (BUCKET[1] // 8, BUCKET[0] // 8)  # the toy VAE's 8x
    g = torch.Generator().manual_seed(0)
    refused = 0
    for dh, dw in CHANGES:
        edited = {**entry, "latents": torch.randn(*shape[:-2], shape[-2] + dh, shape[-1] + dw, generator=g)}
        problem = model_problem("latents", edited, recipe, config)
        assert (problem is None) == _denoiser_takes(model, recipe, config, edited, text), (dh, dw, problem)
        if problem is not None:
            refused += 1
            assert f"{shape[-2] + dh}x{shape[-1] + dw}" in problem and "multiples of" in problem
    assert (refused > 0) == (recipe.latent_multiple(config) > 1)
