"""Encoder weights with NaN or Inf are refused before they encode anything (the third audit: `squareq cache` exited 0
with every text entry NaN, from a T5 file with one NaN). The refusal is one sentence naming the component, its
tensor and where it came from; a single ComfyUI file too. The positive control: the same files, finite, encode."""
import pytest
import torch
from safetensors.torch import load_file, save_file

from squareq.sources.encoder_identity import NonFiniteWeights, module_identity
from squareq.sources.encoder_source import EncoderSource
from squareq.sources.encoders import open_encoders

from ..user_files import stand_in_pipeline, write_comfyui_files


def _poisoned(path, value=float("nan")):
    """``path`` (a safetensors file) with one element of its largest floating tensor set to ``value``."""
    tensors = load_file(path)
    name = max((k for k, t in tensors.items() if t.is_floating_point()), key=lambda k: tensors[k].numel())
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[3] = value
    save_file(tensors, path)
    return name


def test_a_non_finite_tensor_is_named_and_a_finite_one_passes():
    module = torch.nn.Linear(4, 4)
    assert module_identity(module, "t5", source="my/folder")
    for value in (float("nan"), float("inf"), float("-inf")):
        with torch.no_grad():
            module.weight[1, 2] = value
        with pytest.raises(NonFiniteWeights, match="the t5 of my/folder holds NaN or Inf values in its tensor weight"):
            module_identity(module, "t5", source="my/folder")
        with torch.no_grad():
            module.weight[1, 2] = 0.0


@pytest.mark.parametrize("part", ["text_encoder_2", "vae"])
def test_a_pipeline_folder_with_a_poisoned_encoder_is_refused_before_encoding(tmp_path, part):
    pipe = stand_in_pipeline()
    folder = tmp_path / "flux"
    pipe.save_pretrained(folder, safe_serialization=True)
    with open_encoders(str(folder), torch.device("cpu"), "flux") as enc:  # the positive control
        assert torch.isfinite(enc.encode_prompts(["a cat"], 16)[0]["prompt_embeds"]).all()
    weights = next((folder / part).glob("*.safetensors"))
    name = _poisoned(weights)
    with pytest.raises(NonFiniteWeights) as refused:
        with open_encoders(str(folder), torch.device("cpu"), "flux"):
            pass
    said = str(refused.value)
    assert name in said and str(folder) in said and said.count(". ") == 0


def test_a_comfyui_t5_file_with_inf_is_refused_naming_the_file(tmp_path):
    pipe = stand_in_pipeline()
    folder = tmp_path / "flux"
    pipe.save_pretrained(folder, safe_serialization=True)
    files = write_comfyui_files(pipe, tmp_path / "comfyui")
    _poisoned(files["t5"], float("inf"))
    given = tuple((flag, str(files[flag])) for flag in ("clip_l", "t5", "vae"))
    source = EncoderSource(str(folder), given)
    with pytest.raises(NonFiniteWeights, match="holds NaN or Inf values") as refused:
        with open_encoders(source, torch.device("cpu"), "flux"):
            pass
    # the file that holds the tensor, not the list of every file given (the fourth audit)
    assert f"the t5 of {files['t5']} holds" in str(refused.value)
    assert str(files["vae"]) not in str(refused.value) and str(files["clip_l"]) not in str(refused.value)


def _flux2_vae_pipeline():
    import diffusers

    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLFlux2(block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=4,
                                       norm_num_groups=4).eval()
    return diffusers.Flux2Pipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None,
                                   tokenizer=None, transformer=None)


def test_a_pipeline_s_identities_are_taken_when_first_asked_and_once(monkeypatch):
    """Opening a family pipeline's encoders sums no weight (sampling reads no cache, and FLUX.2's Mistral takes
    minutes to sum); the cache's first question does, once; a poisoned VAE is still refused when it is asked."""
    from squareq.sources import pipeline_encoders

    calls = []
    real = pipeline_encoders.module_identity
    monkeypatch.setattr(pipeline_encoders, "module_identity", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    encoders = pipeline_encoders.PipelineEncoders(_flux2_vae_pipeline(), "flux2", torch.device("cpu"), torch.float32)
    assert calls == []
    first = encoders.vae_identity
    assert calls == ["vae"] and encoders.vae_identity == first and calls == ["vae"]
    poisoned = _flux2_vae_pipeline()
    with torch.no_grad():
        next(poisoned.vae.parameters()).view(-1)[0] = float("nan")
    encoders = pipeline_encoders.PipelineEncoders(poisoned, "flux2", torch.device("cpu"), torch.float32)
    with pytest.raises(NonFiniteWeights, match="vae"):
        encoders.vae_identity  # noqa: B018 - the property's sum is the check
