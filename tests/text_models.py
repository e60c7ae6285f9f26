"""Tiny transformers text models saved the way real ones ship: weights, config and tokenizer files in one folder
(the compiler calibrates a text model on real text through its own tokenizer)."""
import string
from pathlib import Path

SPECIALS = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]
CHARACTERS = string.ascii_lowercase + string.digits + " .,;:!?'\"()-*/=_"  # 4 + 52 = 56 entries


def char_tokenizer(model_max_length: int = 512):
    """A lower-casing character-level tokenizer of ``len(SPECIALS) + len(CHARACTERS)`` ids (56), built offline."""
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(CHARACTERS))}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]",
                                   eos_token="[EOS]", model_max_length=model_max_length)


def save_text_model(model, folder: Path) -> Path:
    """``model`` (vocabulary of at least 56) saved with :func:`char_tokenizer` beside it."""
    tokenizer = char_tokenizer()
    assert model.config.vocab_size >= len(tokenizer), "the model's vocabulary must cover the tokenizer's ids"
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder
