"""Hostile files, mutated by the thousand: every mutation of a slab manifest, a slab's safetensors header, a training
checkpoint's state or a LoRA file's metadata ends in success or in one sentence of a user error (what the CLI
prints with exit status 1), never in another exception.

Mutations are drawn by hypothesis with a fixed seed (``derandomize``), so CI runs the same few thousand cases every
time; a failure prints the mutation that caused it. Half of the manifest and checkpoint mutations are "resealed": the
digests that would catch them (layout digests, model signature, checksums.json) are recomputed, so the checks behind
the digests are exercised too.
"""
from __future__ import annotations

import json
import math
import shutil
import struct

import pytest
import torch
from hypothesis import HealthCheck, find, given, note, settings
from hypothesis import strategies as st

from squareq.cli import USER_ERRORS

pytestmark = pytest.mark.usefixtures("torch_kernels")

FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=1000,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# what a JSON field can be turned into: types a writer never uses, boundary numbers, deep and wide values
ODD_NUMBERS = [0, -1, 1, 7, 2**31, 2**63, -(2**63), 10**30, 0.5, -0.0, 1e308, math.nan, math.inf, -math.inf]
SCALARS = st.one_of(st.none(), st.booleans(), st.sampled_from(ODD_NUMBERS), st.integers(-(2**70), 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                      max_leaves=8)


def _paths(node, prefix=()):
    """Every (path, value) in a JSON tree, the root excluded."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for key, value in items:
        yield prefix + (key,), value
        yield from _paths(value, prefix + (key,))


@st.composite
def mutated(draw, tree):
    """A deep copy of ``tree`` with one to three fields replaced, deleted, added, or given another field's value."""
    tree = json.loads(json.dumps(tree))
    for _ in range(draw(st.sampled_from([1, 1, 1, 2, 3]))):
        tree = draw(_mutated_once(tree))
    return tree


@st.composite
def _mutated_once(draw, tree):
    if not isinstance(tree, (dict, list)) or not tree:
        return tree
    paths = [p for p, _ in _paths(tree)]
    path = draw(st.sampled_from(paths))
    parent = tree
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    op = draw(st.sampled_from(["replace", "replace", "delete", "add", "copy"]))
    if op == "replace":
        parent[key] = draw(VALUES)
    elif op == "delete":
        del parent[key]
    elif op == "add":
        if isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = draw(VALUES)
        else:
            parent.insert(draw(st.integers(0, len(parent))), draw(VALUES))
    else:
        parent[key] = json.loads(json.dumps(dict(_paths(tree))[draw(st.sampled_from(paths))]))
    note(f"{op} at {list(path)}: {str(parent.get(key) if isinstance(parent, dict) else parent)[:200]}")
    return tree


def raises_other_than_a_user_error(run) -> bool:
    """Whether ``run()`` raises an exception that is not one of the CLI's user errors (a negative control's find)."""
    try:
        run()
    except USER_ERRORS:
        return False
    except Exception:  # noqa: BLE001
        return True
    return False


def _one_sentence(exc: BaseException) -> None:
    assert isinstance(exc, USER_ERRORS), f"{type(exc).__name__}: {exc}"
    message = str(exc)
    assert message and "\n" not in message, message


# --------------------------------------------------------------------------------------------- slab manifest


@pytest.fixture(scope="module")
def slab_copy(tiny_slab, tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "mutated.slab"
    shutil.copytree(tiny_slab, path)
    return path


def _reseal(manifest: dict) -> None:
    """Recompute the layout digests (blocks' and residents') and the model signature (best effort: a mutation may
    have broken their inputs)."""
    from .slab.helpers import reseal_layouts, reseal_signature

    for reseal in (reseal_layouts, reseal_signature):
        try:
            reseal(manifest)
        except Exception:  # noqa: BLE001 - the reader will refuse what could not be resealed; that is under test
            pass


def _use_slab(path, build: bool = True) -> None:
    """What the commands do with a slab: open and verify it, summarize it (inspect), build its model (train)."""
    from squareq import runtime
    from squareq.slab import open_slab
    from squareq.slab.summary import format_summary, summarize

    with open_slab(path, verify="eager") as slab:
        format_summary(summarize(slab))
        if build:
            runtime.load(slab, "cpu", options=runtime.LoadOptions(stream=False))


@FUZZ
@given(data=st.data())
def test_mutated_manifests_open_or_are_refused_in_one_sentence(slab_copy, tiny_slab, data):
    original = json.loads((tiny_slab / "manifest.json").read_text())
    manifest = data.draw(mutated(original))
    if data.draw(st.booleans()):
        _reseal(manifest)
    (slab_copy / "manifest.json").write_text(json.dumps(manifest))
    try:
        _use_slab(slab_copy)
    except Exception as exc:  # noqa: BLE001 - the assertion names anything that is not a user error
        _one_sentence(exc)


def test_negative_control_the_fuzzer_finds_the_crash_a_missing_check_lets_through(slab_copy, tiny_slab, monkeypatch):
    """With the manifest's type checks switched off, the same mutations must find a traceback."""
    import squareq.slab.manifest as manifest_module

    monkeypatch.setattr(manifest_module, "check_record_types", lambda record, where: None)
    original = json.loads((tiny_slab / "manifest.json").read_text())

    def crashes(manifest) -> bool:
        (slab_copy / "manifest.json").write_text(json.dumps(manifest))
        return raises_other_than_a_user_error(lambda: _use_slab(slab_copy, build=False))

    find(mutated(original), crashes, settings=settings(FUZZ, max_examples=2000))


# --------------------------------------------------------------------------------------------- safetensors header


@FUZZ
@given(data=st.data())
def test_mutated_safetensors_headers_are_refused_in_one_sentence(slab_copy, tiny_slab, data):
    shutil.copy(tiny_slab / "manifest.json", slab_copy / "manifest.json")
    raw = (tiny_slab / "slab.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, rest = json.loads(raw[8:8 + n]), raw[8 + n:]
    if data.draw(st.integers(0, 4)) == 0:  # the length prefix or the header's bytes themselves
        at = data.draw(st.integers(0, 8 + n - 1))
        blob = bytearray(raw)
        blob[at] = data.draw(st.integers(0, 255))
    else:
        text = json.dumps(data.draw(mutated(header))).encode()
        text += b" " * (-(8 + len(text)) % 8)
        blob = struct.pack("<Q", len(text)) + text + rest
    (slab_copy / "slab.safetensors").write_bytes(bytes(blob))
    try:
        _use_slab(slab_copy, build=False)  # the header places tensors; the model is built from the manifest
    except Exception as exc:  # noqa: BLE001
        _one_sentence(exc)


# --------------------------------------------------------------------------------------------- checkpoint state


def _lora_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from squareq.train.checkpoint import save_checkpoint

    model = _lora_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    names = [n for n, _ in model.named_parameters()]
    root = tmp_path_factory.mktemp("ckpt")
    path = save_checkpoint(root, 3, {n: p for n, p in model.named_parameters()}, opt, names, sched,
                           {"batches": {"epoch": 0, "position": 4}}, {"rank": 4}, extra={"generator": torch.zeros(3)})
    return path, names


@FUZZ
@given(data=st.data())
def test_mutated_checkpoint_state_resumes_or_is_refused_in_one_sentence(checkpoint, tmp_path_factory, data):
    import squareq.train.checkpoint as ckpt

    path, names = checkpoint
    work = path.parent / "step-00000004"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(path, work)
    target = data.draw(st.sampled_from([ckpt.STATE_FILE, ckpt.CHECKSUMS_FILE, ckpt.LORA_FILE]))
    if target.endswith(".json"):
        tree = json.loads((work / target).read_text())
        (work / target).write_text(json.dumps(data.draw(mutated(tree))))
    else:  # the safetensors header of the LoRA
        raw = (work / target).read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        text = json.dumps(data.draw(mutated(json.loads(raw[8:8 + n])))).encode()
        (work / target).write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    if target != ckpt.CHECKSUMS_FILE and data.draw(st.booleans()):
        sums = {f: ckpt.file_sha256(work / f) for f in ckpt.HASHED_FILES}
        (work / ckpt.CHECKSUMS_FILE).write_text(json.dumps({"format": ckpt.FORMAT, "sha256": sums}))
    model = _lora_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    try:
        ckpt.load_checkpoint(work, opt, names, sched)
    except Exception as exc:  # noqa: BLE001
        _one_sentence(exc)


# --------------------------------------------------------------------------------------------- LoRA metadata


@pytest.fixture(scope="module")
def lora_file(tmp_path_factory):
    from squareq.train.lora_files import save_diffusers_lora

    torch.manual_seed(0)
    lora = {}
    for layer in ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k"):
        lora[f"{layer}.lora_A.weight"] = torch.randn(4, 32)
        lora[f"{layer}.lora_B.weight"] = torch.randn(64, 4)
    return save_diffusers_lora(lora, tmp_path_factory.mktemp("lora"), 4, 2.0, ["to_q", "to_k"])


@FUZZ
@given(data=st.data())
def test_mutated_lora_metadata_loads_or_is_refused_in_one_sentence(lora_file, data):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from squareq.train.lora_reader import load_lora

    with safe_open(str(lora_file), "pt") as f:
        metadata = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    decoded = {k: json.loads(v) if v[:1] in "{[" else v for k, v in sorted(metadata.items())}
    mutated_meta = data.draw(mutated(decoded))
    if not isinstance(mutated_meta, dict):
        return
    out = lora_file.parent / "mutated" / lora_file.name
    out.parent.mkdir(exist_ok=True)
    save_file(tensors, str(out), metadata={str(k): v if isinstance(v, str) else json.dumps(v)
                                           for k, v in mutated_meta.items()})
    try:
        load_lora(out)
    except Exception as exc:  # noqa: BLE001
        _one_sentence(exc)


# --------------------------------------------------------------------------------------------- sizes and configs


@FUZZ
@given(text=st.one_of(st.text(max_size=40), st.from_regex(r"\s*-?[0-9]{0,500}(\.[0-9]{0,20})?(e[+-]?[0-9]{1,4})?\s*"
                                                         r"(k|m|g|t|p|e|kb|mb|gb|tb|kib|mib|gib|tib|b)?\s*",
                                                         fullmatch=True)))
def test_any_size_text_is_a_byte_count_or_one_sentence_naming_the_flag(text):
    from squareq.sizes import LARGEST, parse_size

    try:
        n = parse_size(text, "--budget")
    except Exception as exc:  # noqa: BLE001
        _one_sentence(exc)
        assert "--budget" in str(exc)
    else:
        assert isinstance(n, int) and 0 <= n <= LARGEST


def _toml(tree: dict) -> str:
    """``tree`` as TOML: top-level tables as tables, nested ones inline; None (which TOML lacks) left out."""
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, float):
            return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
        if isinstance(v, int):
            return str(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v if x is not None) + "]"
        return "{" + ", ".join(f"{json.dumps(k)} = {value(x)}" for k, x in v.items() if x is not None) + "}"

    lines = [f"{json.dumps(k)} = {value(v)}" for k, v in tree.items() if v is not None and not isinstance(v, dict)]
    for k, v in tree.items():
        if isinstance(v, dict):
            lines += [f"[{json.dumps(k)}]"] + [f"{json.dumps(a)} = {value(x)}" for a, x in v.items() if x is not None]
    return "\n".join(lines) + "\n"


@settings(FUZZ, max_examples=500)
@given(data=st.data())
def test_mutated_training_configs_load_or_are_refused_in_one_sentence(tmp_path_factory, data):
    import tomllib
    from pathlib import Path

    from squareq.train.config import load_config

    examples = sorted((Path(__file__).parents[1] / "examples").glob("*.toml"))
    tree = tomllib.loads(data.draw(st.sampled_from(examples)).read_text())
    if data.draw(st.booleans()):
        tree = {"train": tree}  # the [train] table form
    path = tmp_path_factory.mktemp("config", numbered=True) / "mutated.toml"
    path.write_text(_toml(data.draw(mutated(tree))))
    try:
        cfg = load_config(path)
        cfg.validate(str(path))
        cfg.to_toml(), cfg.vram_budget_bytes, cfg.lora_alpha, cfg.largest_resolution, cfg.lora_variant
    except Exception as exc:  # noqa: BLE001
        _one_sentence(exc)


# --------------------------------------------------------------------------------------------- compile state


@pytest.fixture(scope="module")
def compile_state(tmp_path_factory):
    from squareq.compiler.ladder import LayerDecision
    from squareq.compiler.layer_search import Candidate
    from squareq.compiler.state import CompileState
    from squareq.quant import QuantSpec
    from squareq.quant.rtn import quantize

    folder = tmp_path_factory.mktemp("state") / "t.slab.state"
    state = CompileState(folder, {"measurement_key": "k"}, resume=False)
    torch.manual_seed(0)
    decisions = []
    for name in ("blocks.0.a", "blocks.0.b"):
        w = torch.randn(16, 64)
        tried = [Candidate(quantize(w, QuantSpec(bits=b, group_size=32)), 0.0, {"weight_rel_mse": 0.01 * b})
                 for b in (4, 8)]
        decisions.append(LayerDecision(name, tried[0], tried, ["measured"]))
    state.save_block(0, decisions, {"fixed_bytes": 512})
    state.save_effects({"blocks.0.a": {"W4": 0.01, "W8": 0.001}}, {"probes": 2})
    state.wait()  # the block's files are written by a worker thread; the tests copy the folder
    return folder


def _reseal_state(folder, name: str, record) -> None:
    """Recompute the hashes that would catch a mutated record (best effort), so the reads behind them run."""
    from squareq.compiler.state import _record_hash
    from squareq.slab.digest import file_sha256

    if not isinstance(record, dict):
        return
    if name.startswith("block."):
        record["sha256"] = file_sha256(folder / name.replace(".json", ".safetensors"))
        record.pop("record_sha256", None)
        record["record_sha256"] = _record_hash(record)
    else:
        record.pop("record_sha256", None)
        record["record_sha256"] = _record_hash(record)


@settings(FUZZ, max_examples=500)
@given(data=st.data())
def test_mutated_compile_state_resumes_or_is_refused_in_one_sentence(compile_state, data):
    from squareq.compiler.state import CompileState

    work = compile_state.parent / "mutated.slab.state"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(compile_state, work)
    name = data.draw(st.sampled_from(["block.0.json", "effects.json", "state.json"]))
    record = data.draw(mutated(json.loads((work / name).read_text())))
    if name != "state.json" and data.draw(st.booleans()):
        _reseal_state(work, name, record)
    (work / name).write_text(json.dumps(record))
    try:
        state = CompileState(work, {"measurement_key": "k"}, resume=True)
        if state.has_block(0):
            state.load_block(0)
            state.load_block(0, tensors=False)
            state.load_weights(0, lambda layer, rung: True)
        state.load_effects()
    except Exception as exc:  # noqa: BLE001
        _one_sentence(exc)


def test_negative_control_without_the_state_record_check_the_fuzzer_finds_a_crash(compile_state, monkeypatch):
    import squareq.compiler.state as state_module

    monkeypatch.setattr(state_module, "_unreadable", lambda record, data: None)
    work = compile_state.parent / "unchecked.slab.state"

    def crashes(record) -> bool:
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(compile_state, work)
        _reseal_state(work, "block.0.json", record)
        (work / "block.0.json").write_text(json.dumps(record))
        try:
            state = state_module.CompileState(work, {"measurement_key": "k"}, resume=True)
            if state.has_block(0):
                state.load_block(0)
        except USER_ERRORS:
            return False
        except Exception:  # noqa: BLE001
            return True
        return False

    find(mutated(json.loads((compile_state / "block.0.json").read_text())), crashes,
         settings=settings(FUZZ, max_examples=2000))


# --------------------------------------------------------------------------------------------- cache entries


@settings(FUZZ, max_examples=500)
@given(data=st.data())
def test_mutated_cache_entries_are_re_encoded_or_refused_in_one_sentence(tmp_path_factory, data):
    from safetensors.torch import save

    from squareq.slab.digest import ENTRY_HASH, tensors_sha256
    from squareq.train.cache import EmbeddingCache

    cache = EmbeddingCache(tmp_path_factory.mktemp("cache", numbered=True), echo=lambda line: None)
    cache.store("latents", "k", {"latents": torch.randn(4, 8, 8), "loss_mask": torch.ones(1, 8, 8)})
    path = cache.path("latents", "k")
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    if data.draw(st.integers(0, 3)) == 0:  # a flipped byte anywhere
        blob = bytearray(raw)
        blob[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
        path.write_bytes(bytes(blob))
    else:
        header = data.draw(mutated(json.loads(raw[8:8 + n])))
        text = json.dumps(header).encode()
        text += b" " * (-(8 + len(text)) % 8)
        path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
        if data.draw(st.booleans()):  # resealed: the hash matches whatever the header now makes of the bytes
            try:
                from safetensors.torch import load_file

                from squareq.slab.digest import read_hashed  # noqa: F401 - the reader under test

                tensors = load_file(str(path))
                path.write_bytes(save(tensors, metadata={ENTRY_HASH: tensors_sha256(tensors)}))
            except Exception:  # noqa: BLE001 - unreadable: left for the cache to refuse
                pass
    try:
        if cache.intact("latents", "k"):
            cache.load("latents", "k")
        else:
            assert not path.exists()  # a damaged entry is deleted, so the fill encodes it again
    except Exception as exc:  # noqa: BLE001
        _one_sentence(exc)


# --------------------------------------------------------------------------------------------- LoRA shapes for sample


LORA_LAYERS = ("transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.attn.to_k")


@settings(FUZZ, max_examples=200)
@given(data=st.data())
def test_lora_factors_of_any_shape_attach_to_a_slab_or_are_refused_in_one_sentence(tiny_slab, tmp_path_factory,
                                                                                     data):
    """What `sample --lora` does with a file: load it, attach it to the slab's model, run the layers it changed."""
    from safetensors.torch import save_file

    from squareq import runtime
    from squareq.train.lora_attach import attach_lora
    from squareq.train.lora_files import WEIGHT_NAME
    from squareq.train.lora_reader import load_lora

    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(stream=False))
    dims = st.one_of(st.integers(0, 3), st.integers(60, 70), st.sampled_from([1, 4, 64, 128, 256]))
    tensors = {}
    for layer in data.draw(st.lists(st.sampled_from(LORA_LAYERS), min_size=1, max_size=2, unique=True)):
        linear = model.get_submodule(layer)
        rank = data.draw(st.integers(1, 8))
        a = [data.draw(st.sampled_from([rank, rank + 1]) | dims), data.draw(st.just(linear.in_features) | dims)]
        b = [data.draw(st.just(linear.out_features) | dims), data.draw(st.sampled_from([rank, rank - 1]) | dims)]
        for factor, shape in (("lora_A", a), ("lora_B", b)):
            if data.draw(st.integers(0, 9)):  # now and then a factor is missing
                shape = (shape + [1])[:data.draw(st.sampled_from([2, 2, 2, 1, 3]))]  # now and then not a matrix
                fill = data.draw(st.sampled_from([0.01, math.nan, math.inf, 1e30]))
                tensors[f"transformer.{layer}.{factor}.weight"] = torch.full(shape, fill)
    folder = tmp_path_factory.mktemp("lora", numbered=True)
    save_file(tensors, str(folder / WEIGHT_NAME), {"format": "pt"})
    try:
        attached = attach_lora(model, *load_lora(folder))
    except Exception as exc:  # noqa: BLE001
        _one_sentence(exc)
        return
    assert attached or not tensors
    for layer in LORA_LAYERS:
        linear = model.get_submodule(layer)
        out = linear(torch.randn(2, linear.in_features))
        assert out.shape == (2, linear.out_features)


@pytest.mark.parametrize("record", [{"measurement_key": "k", "\n": []}, ["measurement_key"], "k"])
def test_a_state_json_with_a_line_break_in_a_key_or_no_object_is_refused_in_one_sentence(compile_state, record):
    """The cases the fuzzer found: a key holding a line break is named as Python writes it; a state.json that holds
    no JSON object is damaged. Each is one sentence (the control: the state itself resumes, above)."""
    from squareq.compiler.state import CompileState, StateError

    work = compile_state.parent / "odd.slab.state"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(compile_state, work)
    (work / "state.json").write_text(json.dumps(record))
    with pytest.raises(StateError) as err:
        CompileState(work, {"measurement_key": "k"}, resume=True)
    _one_sentence(err.value)
