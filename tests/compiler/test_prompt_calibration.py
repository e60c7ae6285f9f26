"""Calibration through a pipeline's own text encoders, built tiny and offline (tokenizers made from scratch)."""
import json

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import CLIPTextConfig, CLIPTextModel, PreTrainedTokenizerFast, T5Config, T5EncoderModel

from squareq.compiler import CompileOptions, compile_slab, open_source
from squareq.models import FLUX
from squareq.models.prompts import CALIBRATION_PROMPTS
from squareq.models.tiny import TINY_FLUX_CONFIG


def word_tokenizer(folder, max_length):
    words = sorted({w for p in CALIBRATION_PROMPTS for w in p.lower().replace(",", " ").replace("'", " ").split()})
    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]",
                                   model_max_length=max_length)
    fast.save_pretrained(folder)
    return len(vocab)


def tiny_pipeline(root, tiny_flux):
    model, _ = tiny_flux
    model.save_pretrained(root / "transformer", safe_serialization=True)
    vocab = word_tokenizer(root / "tokenizer", 77)
    word_tokenizer(root / "tokenizer_2", 512)
    torch.manual_seed(0)
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=vocab, hidden_size=TINY_FLUX_CONFIG["pooled_projection_dim"],
                                        intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                        max_position_embeddings=77, eos_token_id=2, bos_token_id=0, pad_token_id=0))
    clip.save_pretrained(root / "text_encoder", safe_serialization=True)
    t5 = T5EncoderModel(T5Config(vocab_size=vocab, d_model=TINY_FLUX_CONFIG["joint_attention_dim"], d_kv=8, d_ff=64,
                                 num_layers=1, num_heads=2))
    t5.save_pretrained(root / "text_encoder_2", safe_serialization=True)
    (root / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    return clip.eval(), t5.eval()


def test_pipeline_text_encoders_feed_the_calibration(tmp_path, tiny_flux):
    clip, t5 = tiny_pipeline(tmp_path, tiny_flux)
    source = open_source(str(tmp_path))
    assert source.pipeline == tmp_path
    batch = FLUX.calibration_batch(source.skeleton(), 3, 0, source.pipeline)
    assert batch.description["kind"] == "text-encoders" and batch.description["prompts"] == list(CALIBRATION_PROMPTS[:3])
    # the embeddings are the encoders' outputs for those prompts, not noise
    tok = PreTrainedTokenizerFast.from_pretrained(tmp_path / "tokenizer_2")
    ids = tok(list(CALIBRATION_PROMPTS[:3]), padding="max_length", max_length=16, truncation=True,
              return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.allclose(batch.kwargs["encoder_hidden_states"], t5(ids).last_hidden_state, atol=1e-5)
    assert batch.kwargs["pooled_projections"].shape == (3, TINY_FLUX_CONFIG["pooled_projection_dim"])

    out = tmp_path / "tiny.slab"
    m = compile_slab(source, out, CompileOptions(budget=2_000_000, calib_samples=2, rounding="nearest"))
    assert m.calibration["kind"] == "text-encoders" and len(m.calibration["prompts"]) == 2


def test_without_text_encoders_the_fallback_is_recorded(tmp_path, tiny_flux):
    model, _ = tiny_flux
    model.save_pretrained(tmp_path / "transformer", safe_serialization=True)
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    source = open_source(str(tmp_path / "transformer"))
    assert source.pipeline == tmp_path
    assert FLUX.calibration_batch(source.skeleton(), 2, 0, source.pipeline).description["kind"] == "synthetic"
