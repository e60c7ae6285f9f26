"""The output correction (compiler/correction.py): its fold into the stored scales, its fit, its per-layer guard and
the slab-level gate (each with a negative control), its dependency groups, and whole compiles of text and image
models run through the runtime."""
import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from squareq import quant, runtime
from squareq.cli import main
from squareq.compiler import CompileOptions, compile_slab, slab_output
from squareq.compiler import correction as oc
from squareq.compiler.budget import BudgetError
from squareq.slab import open_slab
from squareq.slab.summary import summarize
from squareq.slab.writer import block_linears
from squareq.sources import open_source

from ..sources.test_base_prefix import _bert, _llama
from ..text_models import save_text_model

# the torch reference dequantizer (conftest.py), for the module fixtures too
pytestmark = pytest.mark.usefixtures("torch_kernels")


@pytest.mark.parametrize("spec", [
    quant.QuantSpec(bits=4, group_size=32, symmetric=False),
    quant.QuantSpec(bits=4, group_size=32, symmetric=False, rotate=True),
    quant.QuantSpec(bits=6, group_size=32, symmetric=True, clip_ratio=0.9),
    quant.QuantSpec(bits=8, group_size=32, format="fp8_e4m3", symmetric=True),
    quant.QuantSpec(bits=4, group_size=32, format="nf4", symmetric=True),
    quant.QuantSpec(bits=16),
], ids=["w4", "w4-rotated", "w6-clipped", "fp8", "nf4", "bf16"])
def test_a_row_scale_folds_into_the_stored_weight_of_every_format(spec):
    torch.manual_seed(0)
    w = torch.randn(24, 64)
    qw = quant.quantize(w, spec)
    a = 0.95 + 0.1 * torch.rand(24)
    got = quant.dequantize(quant.scale_rows(qw, a)).float()
    want = a[:, None] * quant.dequantize(qw).float()
    # bf16 effective weights, and scales rounded to their stored dtype: a few parts in a thousand at most
    assert torch.allclose(got, want, rtol=8e-3, atol=1e-6)
    assert not torch.allclose(got, quant.dequantize(qw).float(), rtol=1e-3)  # the scale is there
    if not spec.is_passthrough:
        assert torch.equal(quant.scale_rows(qw, a).tensors["qweight"], qw.tensors["qweight"])  # codes untouched
    with pytest.raises(ValueError, match="needs 24 finite values"):
        quant.scale_rows(qw, torch.ones(23))


def _moments(y: torch.Tensor) -> torch.Tensor:
    y = y.double()
    return torch.stack([torch.full_like(y[0], y.shape[0]), y.sum(0), y.square().sum(0)])


def test_the_fit_gives_the_quantized_outputs_the_sources_mean_and_spread():
    torch.manual_seed(0)
    z = torch.randn(500, 6)  # the quantized layer's outputs before its bias
    bias = torch.randn(6)
    target = 1.03 * z + 0.2 + bias  # a source whose outputs spread 3% wider and sit 0.2 higher
    a, b = oc._fit(_moments(target), _moments(z + bias), bias)
    fixed = a.float() * z + b
    assert torch.allclose(fixed.mean(0), target.mean(0), atol=1e-2)
    assert torch.allclose(fixed.std(0), target.std(0), rtol=1e-4)
    a_none, b_none = oc._fit(_moments(1.03 * z), _moments(z), None)  # no bias: the ratio of root mean squares
    assert b_none is None and torch.allclose(a_none.float(), torch.full((6,), 1.03), rtol=1e-4)
    # a channel the fit rows never move keeps its scale
    flat = torch.cat([z[:, :5], torch.zeros(500, 1)], dim=1)
    a_flat, _ = oc._fit(_moments(flat + bias), _moments(flat + bias), bias)
    assert float(a_flat[5]) == 1.0


def _judged(held_mean: float):
    """One layer at plain W4 rounding, whose error shifts the mean of its outputs on inputs of nonzero mean: the
    correction fitted on inputs of mean +1 is judged on held-out inputs of mean ``held_mean``."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(64, 16))
    w = block[0].weight.detach().clone()
    spec = quant.QuantSpec(bits=4, group_size=32, symmetric=False)
    qw = quant.quantize(w, spec)
    fit_x = torch.randn(400, 64) + 1.0
    target = _moments(block(fit_x).detach())
    quantized = nn.Linear(64, 16)
    quantized.weight.data.copy_(quant.dequantize(qw).float())
    quantized.bias.data.copy_(block[0].bias.detach())
    proposal = oc._fit(target, _moments(quantized(fit_x).detach()), block[0].bias.detach())
    judge = oc._Judge("b", block, {"b.0": (qw, proposal)}, torch.ones(200))
    with judge:
        judge.window(0, 200)
        block(torch.randn(200, 64) + held_mean)
    return judge.verdicts()["b.0"], judge.sums["b.0"]


def test_the_guard_keeps_a_correction_that_lowers_the_held_out_error():
    fix, (power, plan, corrected, plain) = _judged(held_mean=1.0)
    assert plan == pytest.approx(plain)  # the plan is plain rounding here
    assert fix is not None and corrected < 0.8 * plain
    assert fix.metrics["heldout_rel_mse"] == pytest.approx(corrected / power)
    assert fix.metrics["heldout_rtn_rel_mse"] == pytest.approx(plain / power)


def test_the_guard_refuses_a_correction_that_errs_more_than_plain_rounding_on_held_out_inputs():
    """Negative control: the held-out inputs' mean is the opposite of the fit's, so the fitted bias doubles the
    error there."""
    fix, (_, plan, corrected, plain) = _judged(held_mean=-1.0)
    assert corrected > plain and corrected > plan
    assert fix is None


@pytest.mark.parametrize("family, want", [
    (_bert, [["attention.self.query", "attention.self.key", "attention.self.value"], ["attention.output.dense"],
             ["intermediate.dense"], ["output.dense"]]),
    (_llama, [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
              ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]),
], ids=["bert", "llama"])
def test_layers_are_grouped_by_what_they_read(family, want, tmp_path):
    config, base, _, blocks = family()
    folder = save_text_model(base(config).eval(), tmp_path / "m")
    source = open_source(folder, [blocks])
    path = source.block_paths[0]
    block = source.load_block(path)
    seen = {}

    def grab(index, p, args, kw):
        if index == 0:
            seen["call"] = (args, kw)
        return source.load_block(p)(*args, **kw)

    with torch.no_grad():
        source.shell(grab)(input_ids=torch.randint(4, 60, (1, 9)))
    names = [n for n, _ in block_linears(path, block)]
    groups = oc._groups(path, block, names, seen["call"])
    assert [[n[len(path) + 1:] for n in g] for g in groups] == want


class _Toy(nn.Module):
    """first; second reads first's output through a detach (the graph cannot tell); third reads the block's input
    only in place-modified form; never is not called."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.third, self.never = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        y = self.first(x)
        z = self.second(y.detach() * 2)
        x.add_(1.0)  # in place on the block's input
        return z + self.third(x)


def test_the_grouping_is_cautious_where_the_graph_cannot_tell():
    block = _Toy()
    names = [f"b.{n}" for n in ("first", "second", "third", "never")]
    groups = oc._groups("b", block, names, ((torch.randn(2, 8),), {}))
    # third reads only the input, but second's input has no graph: second comes after first, third after both
    # would be wrong only in being late; never comes last, alone
    assert groups[0] == ["b.first", "b.third"] and groups[1] == ["b.second"] and groups[-1] == ["b.never"]


def _text_model(tmp_path, family=_bert):
    config, base, _, blocks = family()
    torch.manual_seed(0)
    return save_text_model(base(config).eval(), tmp_path / "model"), blocks


def _compile(folder, blocks, out, **opts):
    base = dict(budget=1_000_000, calib_samples=32, calib_tokens=24, effect_probes=2, overwrite=True)
    return compile_slab(open_source(folder, [blocks]), out, CompileOptions(**{**base, **opts}))


@pytest.fixture(scope="module")
def bert_slabs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("oc")
    folder, blocks = _text_model(tmp)
    on = _compile(folder, blocks, tmp / "on.slab")
    off = _compile(folder, blocks, tmp / "off.slab", output_correction="off")
    return folder, blocks, tmp, on, off


def test_a_text_model_is_corrected_where_measured_better_and_the_manifest_says_so(bert_slabs):
    folder, _, tmp, on, off = bert_slabs
    rec = on.calibration["output_correction"]
    assert rec["mode"] == "auto" and rec["fitted"] and rec["fit_samples"] == 24  # 8 of the 32 held out
    assert rec["kept"] == (rec["output_rel_mse_with"] < rec["output_rel_mse_without"])
    assert on.calibration["measured_output_rel_mse"] == min(rec["output_rel_mse_with"], rec["output_rel_mse_without"])
    assert off.calibration["output_correction"]["fitted"] is False
    assert rec["output_rel_mse_without"] == pytest.approx(off.calibration["measured_output_rel_mse"], rel=1e-6)
    assert rec["kept"] and rec["corrected"] > 0  # this model gains: 6.2e-7 against 6.8e-7 when written
    assert [x.rung for x in on.layers] == [x.rung for x in off.layers]  # the same plan; no byte added
    with open_slab(tmp / "on.slab") as s_on, open_slab(tmp / "off.slab") as s_off:
        assert summarize(s_on)["totals"]["layer_bytes"] == summarize(s_off)["totals"]["layer_bytes"]
        for layer in on.layers:
            q_on, q_off = s_on.quantized_weight(layer.name), s_off.quantized_weight(layer.name)
            assert torch.equal(q_on.tensors["qweight"], q_off.tensors["qweight"])
            if layer.metrics.get("corrected"):
                assert layer.metrics["heldout_rel_mse"] <= layer.metrics["heldout_rtn_rel_mse"]
                ratio = q_on.tensors["scales"].float() / q_off.tensors["scales"].float()
                row = ratio[:, :1]  # one factor per output row, the same for each of its groups
                assert torch.allclose(ratio, row.expand_as(ratio), rtol=2e-3)
                lo, hi = layer.metrics["correction_scale_min"], layer.metrics["correction_scale_max"]
                assert lo - 2e-3 <= float(row.min()) and float(row.max()) <= hi + 2e-3
            else:
                assert torch.equal(q_on.tensors["scales"], q_off.tensors["scales"])


def test_the_runtime_runs_the_corrected_slab_with_its_biases(bert_slabs):
    folder, _, tmp, on, _ = bert_slabs
    from transformers import BertModel

    reference = BertModel.from_pretrained(folder).eval()
    with open_slab(tmp / "on.slab") as slab:
        state = {k: v.float() for k, v in slab.dequantized_state_dict().items()}
    corrected = [x.name for x in on.layers if x.metrics.get("corrected")]
    name = corrected[0]
    assert not torch.equal(state[f"{name}.bias"], reference.get_submodule(name).bias.detach().bfloat16().float())
    reference.load_state_dict(state, strict=False)
    ids = torch.randint(4, 60, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = runtime.load(tmp / "on.slab", "cpu", options=runtime.LoadOptions(stream=False))(input_ids=ids)[0].float()
        want = reference(input_ids=ids)[0]
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.999


def test_the_slab_keeps_no_correction_that_does_not_lower_the_output_error(bert_slabs, monkeypatch):
    """Negative control of the slab-level gate: the same fit, measured (by a stand-in) to raise the held-out output
    error, is not written; the slab is the uncorrected one."""
    folder, blocks, tmp, _, off = bert_slabs
    measure = slab_output.plan_output_errors

    def worse(*args, **kwargs):
        without, corrected = measure(*args, **kwargs)
        return [without, without * 1.5]

    monkeypatch.setattr(slab_output, "plan_output_errors", worse)
    m = _compile(folder, blocks, tmp / "refused.slab")
    rec = m.calibration["output_correction"]
    assert rec["fitted"] and rec["corrected"] > 0 and not rec["kept"]
    assert m.calibration["measured_output_rel_mse"] == rec["output_rel_mse_without"]
    with open_slab(tmp / "refused.slab") as a, open_slab(tmp / "off.slab") as b:
        assert all(torch.equal(a.quantized_weight(x.name).tensors["scales"], b.quantized_weight(x.name).tensors["scales"])
                   for x in off.layers)
        assert all(torch.equal(t, b.dequantized_state_dict()[k]) for k, t in a.dequantized_state_dict().items())
        assert not any(x.metrics.get("corrected") for x in a.manifest.layers)


def test_a_rebuild_refits_the_correction(bert_slabs):
    folder, blocks, tmp, on, _ = bert_slabs
    again = _compile(folder, blocks, tmp / "again.slab", previous=str(tmp / "on.slab"), budget=1_100_000)
    rec = again.calibration["output_correction"]
    assert rec["fitted"] and rec["kept"] == (rec["output_rel_mse_with"] < rec["output_rel_mse_without"])
    # refitted on the already corrected weights, the correction hardly moves them again
    assert rec["output_rel_mse_with"] == pytest.approx(on.calibration["measured_output_rel_mse"], rel=0.05)


def test_a_rebuild_without_the_correction_keeps_a_corrected_layer_whole(bert_slabs):
    """A layer kept on its rung from a corrected slab keeps that slab's scales and its bias together, and its
    measurements; with the correction off the rebuild is the previous slab again."""
    folder, blocks, tmp, on, _ = bert_slabs
    again = _compile(folder, blocks, tmp / "again-off.slab", previous=str(tmp / "on.slab"),
                     output_correction="off")
    assert [x.rung for x in again.layers] == [x.rung for x in on.layers]
    assert again.calibration["measured_output_rel_mse"] == pytest.approx(on.calibration["measured_output_rel_mse"],
                                                                         rel=1e-9)
    with open_slab(tmp / "again-off.slab") as a, open_slab(tmp / "on.slab") as b:
        assert all(torch.equal(t, b.dequantized_state_dict()[k]) for k, t in a.dequantized_state_dict().items())
        for x in a.manifest.layers:
            assert x.metrics.get("corrected") == on.layers[[y.name for y in on.layers].index(x.name)].metrics.get(
                "corrected")


def test_a_model_without_biases_is_corrected_by_scale_only(tmp_path):
    folder, blocks = _text_model(tmp_path, _llama)
    m = _compile(folder, blocks, tmp_path / "llama.slab", output_correction="on")
    rec = m.calibration["output_correction"]
    assert rec["fitted"] and rec["layers"] == 14
    assert rec["kept"] == (rec["output_rel_mse_with"] < rec["output_rel_mse_without"])


def test_image_models_are_corrected_only_when_asked(tmp_path, tiny_flux_images):
    opts = dict(budget=2_000_000, calib_samples=8, calib_images=tiny_flux_images, rounding="nearest",
                effect_probes=1, rotation=False, learned_rounding=False)
    auto = compile_slab(open_source("tiny-flux"), tmp_path / "auto.slab", CompileOptions(**opts))
    assert auto.calibration["output_correction"]["fitted"] is False
    on = compile_slab(open_source("tiny-flux"), tmp_path / "on.slab", CompileOptions(output_correction="on", **opts))
    rec = on.calibration["output_correction"]
    assert rec["fitted"] and rec["layers"] > 0 and rec["passes"] > 0  # through the chunked calls of FLUX blocks
    assert rec["kept"] == (rec["output_rel_mse_with"] < rec["output_rel_mse_without"])
    with open_slab(tmp_path / "on.slab") as slab:
        assert json.loads(json.dumps(slab.manifest.calibration))["output_correction"] == rec


def test_a_bad_mode_is_one_sentence():
    with pytest.raises(BudgetError, match="--output-correction 'maybe' must be one of auto, on, off"):
        CompileOptions(budget=1, output_correction="maybe")
    result = CliRunner().invoke(main, ["compile", "tiny-flux", "-o", "x.slab", "--budget", "2MB",
                                       "--output-correction", "maybe"])
    assert result.exit_code != 0 and "--output-correction" in result.output


def test_a_batch_that_cannot_be_told_from_the_token_axis_is_not_split(tmp_path, bert_slabs):
    """BERT's forward does not run on the meta device, so the correction tells the batch axis by its size; with as
    many tokens as samples that would be a guess, and the compile goes on without the correction."""
    folder, blocks, _, _, _ = bert_slabs
    m = _compile(folder, blocks, tmp_path / "same.slab", calib_tokens=32)
    rec = m.calibration["output_correction"]
    assert rec["fitted"] is False and rec["mode"] == "auto"
    assert m.calibration["measured_output_rel_mse"] > 0
