"""Generic mode on checkpoints saved from the base model under a config naming a head class (sentence-transformers
models), and the reverse: the class and names AutoModel/from_pretrained would use; a true mismatch is refused by
name; --model-class picks the class."""
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from squareq import runtime
from squareq.cli import main
from squareq.compiler import CompileOptions, compile_slab
from squareq.models import ModelError
from squareq.sources import open_source

from ..text_models import save_text_model

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


pytestmark = pytest.mark.usefixtures("torch_kernels")  # the torch reference dequantizer (conftest.py)


def _bert():
    from transformers import BertConfig, BertForMaskedLM, BertModel

    return BertConfig(**SMALL, max_position_embeddings=32), BertModel, BertForMaskedLM, "encoder.layer"


def _mpnet():
    from transformers import MPNetConfig, MPNetForMaskedLM, MPNetModel

    return MPNetConfig(**SMALL, max_position_embeddings=40), MPNetModel, MPNetForMaskedLM, "encoder.layer"


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

    return LlamaConfig(**SMALL, num_key_value_heads=2), LlamaModel, LlamaForCausalLM, "layers"


def _t5():
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)
    return config, T5EncoderModel, T5EncoderModel, "encoder.block"


def _save(cls, config, folder, architectures):
    """``cls`` saved with a config.json that names ``architectures`` (as sentence-transformers repositories do)."""
    torch.manual_seed(0)
    save_text_model(cls(config).eval(), folder)
    meta = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**meta, "architectures": architectures}))
    return folder


def _compile_and_run(folder, blocks, tmp_path):
    """Compile ``folder`` in generic mode and run the slab against its class's own from_pretrained."""
    source = open_source(folder, [blocks])
    slab = tmp_path / f"{folder.name}.slab"
    compile_slab(source, slab, CompileOptions(budget=1_000_000, calib_samples=4, calib_tokens=16, effect_probes=2))
    ids = torch.randint(4, 60, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # hidden states, or a head's logits
        got = runtime.load(slab, "cpu", options=runtime.LoadOptions(stream=False))(input_ids=ids)[0].float()
        want = type(source.skeleton()).from_pretrained(folder).eval()(input_ids=ids)[0]
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.98
    return type(source.skeleton()).__name__


@pytest.mark.parametrize("family", [_bert, _mpnet, _llama, _t5], ids=["bert", "mpnet", "llama", "t5-encoder"])
def test_a_base_checkpoint_under_a_head_config_compiles_as_automodel_loads_it(family, tmp_path):
    config, base, head, blocks = family()
    folder = _save(base, config, tmp_path / "base", [head.__name__])  # as sentence-transformers repositories ship
    assert _compile_and_run(folder, blocks, tmp_path) == base.__name__


@pytest.mark.parametrize("family", [_bert, _mpnet, _llama], ids=["bert", "mpnet", "llama"])
def test_a_head_checkpoint_compiles_as_its_head_class(family, tmp_path):
    config, base, head, blocks = family()
    folder = _save(head, config, tmp_path / "head", [head.__name__])
    assert _compile_and_run(folder, f"{base.base_model_prefix}.{blocks}", tmp_path) == head.__name__


def test_a_head_checkpoint_under_a_base_config_loses_its_prefix_as_from_pretrained_strips_it(tmp_path):
    config, base, head, blocks = _llama()
    folder = _save(head, config, tmp_path / "head", [base.__name__])
    assert _compile_and_run(folder, blocks, tmp_path) == "LlamaModel"
    # BERT's masked-LM head builds its base without the pooler BertModel has: that part is truly missing
    config, base, head, blocks = _bert()
    folder = _save(head, config, tmp_path / "bert", [base.__name__])
    with pytest.raises(ModelError, match=r"has no tensor pooler\.dense\.\w+, which BertModel with this config "
                                         r"expects \(2 missing in all"):
        open_source(folder, [blocks])


def test_a_checkpoint_that_does_not_match_is_refused_naming_keys(tmp_path):
    config, base, head, blocks = _bert()
    folder = _save(base, config, tmp_path / "bad", [head.__name__])
    weights = load_file(str(folder / "model.safetensors"))
    save_file({k.replace("encoder.layer.", "encoder.layers."): v for k, v in weights.items()},
              str(folder / "model.safetensors"))
    with pytest.raises(ModelError, match=r"has no tensor encoder\.layer\.0\..*, which BertModel with this config "
                                         r"expects \(\d+ missing in all, e\.g\. encoder\.layer\.0\..*tensors it holds "
                                         r"that BertModel does not have: encoder\.layers\.0\..*--model-class"):
        open_source(folder, [blocks])


def test_model_class_overrides_the_config_and_an_unknown_one_is_refused(tmp_path):
    config, base, head, blocks = _bert()
    folder = _save(head, config, tmp_path / "head", [base.__name__])
    chosen = open_source(folder, ["bert.encoder.layer"], model_class="BertForMaskedLM")
    assert type(chosen.skeleton()).__name__ == "BertForMaskedLM" and not chosen.ignored
    with pytest.raises(ModelError, match=r"^--model-class BertNope names no transformers model class; .*"
                                         r"leave --model-class out"):
        open_source(folder, [blocks], model_class="BertNope")
    with pytest.raises(ModelError, match=r"^--model-class T5EncoderModel cannot be built from .*config\.json "
                                         r"\(.*\); pass a class of that config's model type"):
        open_source(folder, [blocks], model_class="T5EncoderModel")  # a class of another model type
    base_folder = _save(base, config, tmp_path / "base", [base.__name__])
    with pytest.raises(ModelError, match=r"has no tensor cls\..*which BertForMaskedLM with this config expects"):
        open_source(base_folder, ["bert.encoder.layer"], model_class="BertForMaskedLM")  # its head is not there


def test_the_cli_refuses_an_unknown_model_class_in_one_sentence(tmp_path):
    config, base, head, blocks = _bert()
    folder = _save(base, config, tmp_path / "base", [base.__name__])
    result = CliRunner().invoke(main, ["compile", str(folder), "--blocks", blocks, "--model-class", "NoSuchModel",
                                       "-o", str(tmp_path / "s.slab"), "--budget", "1MB"])
    assert result.exit_code != 0 and "--model-class NoSuchModel names no transformers model class" in result.output


def test_a_hub_repository_of_a_base_checkpoint_is_checked_as_its_base_before_its_weights(tmp_path, monkeypatch):
    from squareq.sources import hub

    config, base, head, blocks = _bert()
    folder = _save(base, config, tmp_path / "base", [head.__name__])
    snapshot = tmp_path / "hub" / "models--org--minilm" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    for f in folder.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    (tmp_path / "hub" / "models--org--minilm" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--minilm" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    hub._fetch.cache_clear()
    checked = []
    source = open_source("org/minilm", [blocks], check=lambda s: checked.append(type(s.skeleton()).__name__))
    hub._fetch.cache_clear()
    assert checked == ["BertModel"] and type(source.skeleton()).__name__ == "BertModel"


def test_accept_reopens_a_model_class_slab_as_the_class_it_was_compiled_as(tmp_path):
    """A head checkpoint under a base config, compiled with --model-class: accept's source is that class again (its
    model-signature check would refuse the base class the config names)."""
    from squareq.acceptance.runner import AcceptOptions, _open_source
    from squareq.slab import open_slab

    config, base, head, blocks = _bert()
    folder = _save(head, config, tmp_path / "head", [base.__name__])
    slab = tmp_path / "head.slab"
    compile_slab(open_source(folder, ["bert.encoder.layer"], model_class=head.__name__), slab,
                 CompileOptions(budget=1_000_000, calib_samples=4, calib_tokens=16, effect_probes=2))
    with open_slab(slab) as s:
        source = _open_source(AcceptOptions(slab=slab, model=str(folder), device="cpu"), s)[0]
    assert type(source.skeleton()).__name__ == head.__name__

