"""Training checkpoints: exact resume, RNG restore, atomic writes, listing, pruning, refusals."""
import json
import math
import os
import random

import numpy as np
import pytest
import torch
from torch import nn

import squareq.train.checkpoint as ckpt
from squareq.slab.digest import file_sha256
from squareq.train.checkpoint import (
    check_resume_folder,
    checkpoint_dir,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from squareq.train.checkpoint_state import CheckpointError


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _names(model):
    return [n for n, _ in model.named_parameters()]


def _lora(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _schedule(warmup=3, total=10):
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))
    return f


def _train(model, opt, sched, steps):
    for _ in range(steps):
        x = torch.randn(4, 6)  # global RNG on purpose: resume must restore it
        y = torch.randn(4, 3)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()


def _reseal(path):
    """Rewrite checksums.json over the files as they are now: a damage the checksums cannot see."""
    sums = {f: file_sha256(path / f) for f in ckpt.HASHED_FILES}
    (path / ckpt.CHECKSUMS_FILE).write_text(json.dumps({"format": ckpt.FORMAT, "sha256": sums}))


def _assert_optimizer_equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        assert sa["state"][i].keys() == sb["state"][i].keys()
        for k, va in sa["state"][i].items():
            vb = sb["state"][i][k]
            if isinstance(va, torch.Tensor):
                assert va.dtype == vb.dtype and va.shape == vb.shape
                assert torch.equal(va, vb), (i, k)
            else:
                assert va == vb


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1),
    lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True),
])
def test_optimizer_state_round_trips_exactly(tmp_path, make_opt):
    model = _model()
    opt = make_opt(model.parameters())
    _train(model, opt, None, 3)
    path = save_checkpoint(tmp_path, 3, _lora(model), opt, _names(model), None, {"epoch": 0}, {"rank": 4})
    assert path == checkpoint_dir(tmp_path, 3) and path.name == "step-00000003"
    assert sorted(os.listdir(path)) == sorted(ckpt.REQUIRED_FILES)

    fresh = _model(seed=1)
    opt2 = make_opt(fresh.parameters())
    loaded = load_checkpoint(path, opt2, _names(fresh))
    _assert_optimizer_equal(opt, opt2)
    assert isinstance(opt2.state_dict()["param_groups"][0].get("betas", ()), tuple)
    assert loaded.step == 3 and loaded.data_state == {"epoch": 0} and loaded.config == {"rank": 4}
    for name, p in model.named_parameters():
        assert torch.equal(loaded.lora[name], p.detach())


def test_adamw_step_tensor_is_saved(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt, None, 2)
    path = save_checkpoint(tmp_path, 2, _lora(model), opt, _names(model), None, {}, {})
    from safetensors.torch import load_file
    tensors = load_file(str(path / ckpt.OPTIMIZER_FILE))
    assert torch.equal(tensors["state.0.weight.step"], torch.tensor(2.0))
    assert {"state.0.weight.exp_avg", "state.0.weight.exp_avg_sq", "state.2.bias.exp_avg"} <= tensors.keys()


def test_rng_states_round_trip(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    torch.manual_seed(11), random.seed(12), np.random.seed(13)
    torch.randn(3), random.random(), np.random.normal()  # leave a cached gaussian in numpy
    path = save_checkpoint(tmp_path, 1, _lora(model), opt, _names(model), None, {}, {})
    expected = (torch.randn(5), [random.random() for _ in range(5)], np.random.normal(size=5))

    torch.manual_seed(0), random.seed(0), np.random.seed(0)  # scramble
    load_checkpoint(path, torch.optim.AdamW(_model().parameters()), _names(model))
    got = (torch.randn(5), [random.random() for _ in range(5)], np.random.normal(size=5))
    assert torch.equal(expected[0], got[0])
    assert expected[1] == got[1]
    assert np.array_equal(expected[2], got[2])


def test_extra_generator_state_round_trips(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    gen = torch.Generator().manual_seed(5)
    torch.rand(3, generator=gen)
    path = save_checkpoint(tmp_path, 1, _lora(model), opt, _names(model), None, {}, {},
                           extra={"timestep_generator": gen.get_state(), "note": ("a", 1)})
    expected = torch.rand(4, generator=gen)
    loaded = load_checkpoint(path, torch.optim.AdamW(model.parameters()), _names(model))
    gen2 = torch.Generator()
    gen2.set_state(loaded.extra["timestep_generator"])
    assert torch.equal(torch.rand(4, generator=gen2), expected)
    assert loaded.extra["note"] == ("a", 1)


def _fresh_run(seed):
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule())
    return model, opt, sched


def test_interrupted_training_resumes_bitwise(tmp_path):
    torch.manual_seed(100)
    model_a, opt_a, sched_a = _fresh_run(0)
    torch.manual_seed(100)
    _train(model_a, opt_a, sched_a, 10)

    torch.manual_seed(100)
    model_b, opt_b, sched_b = _fresh_run(0)
    torch.manual_seed(100)
    _train(model_b, opt_b, sched_b, 5)
    path = save_checkpoint(tmp_path, 5, _lora(model_b), opt_b, _names(model_b), sched_b, {"seen": 5}, {"lr": 1e-2})
    del model_b, opt_b, sched_b

    model_c, opt_c, sched_c = _fresh_run(seed=7)  # different init, fresh lr schedule: all must be overwritten
    loaded = load_checkpoint(path, opt_c, _names(model_c), sched_c)
    with torch.no_grad():
        for name, p in model_c.named_parameters():
            p.copy_(loaded.lora[name])
    assert loaded.step == 5 and loaded.data_state == {"seen": 5}
    assert sched_c.last_epoch == 5
    _train(model_c, opt_c, sched_c, 5)

    for (na, pa), (nc, pc) in zip(model_a.named_parameters(), model_c.named_parameters()):
        assert na == nc and torch.equal(pa, pc), na
    _assert_optimizer_equal(opt_a, opt_c)
    assert sched_a.state_dict() == sched_c.state_dict()


def test_failure_while_writing_leaves_previous_checkpoint(tmp_path, monkeypatch):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt, None, 1)
    first = save_checkpoint(tmp_path, 1, _lora(model), opt, _names(model), None, {}, {})
    before = {f: (first / f).read_bytes() for f in os.listdir(first)}

    def boom(path, obj):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "_write_json", boom)
    _train(model, opt, None, 1)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, _lora(model), opt, _names(model), None, {}, {})
    root = tmp_path / "checkpoints"
    assert sorted(os.listdir(root)) == ["step-00000001"]  # no step-2, no temporary left behind
    assert {f: (first / f).read_bytes() for f in os.listdir(first)} == before
    assert latest_checkpoint(tmp_path) == first


def test_latest_ignores_temporary_and_incomplete(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    assert latest_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path, 2, _lora(model), opt, _names(model), None, {}, {})
    root = tmp_path / "checkpoints"
    (root / ".step-00000009.tmp-deadbeef").mkdir()
    (root / "step-00000007").mkdir()  # incomplete: no files
    (root / "notes").mkdir()
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 2)


def test_prune_keeps_newest(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    for step in (1, 2, 10, 100):
        save_checkpoint(tmp_path, step, _lora(model), opt, _names(model), None, {}, {})
    removed = prune_checkpoints(tmp_path, keep_last=2)
    assert [p.name for p in removed] == ["step-00000001", "step-00000002"]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-00000010", "step-00000100"]
    assert prune_checkpoints(tmp_path, keep_last=5) == []
    prune_checkpoints(tmp_path, keep_last=1)
    assert os.listdir(tmp_path / "checkpoints") == ["step-00000100"]
    with pytest.raises(ValueError):
        prune_checkpoints(tmp_path, keep_last=0)


def test_pickle_in_place_of_safetensors_is_refused(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt, None, 1)
    path = save_checkpoint(tmp_path, 1, _lora(model), opt, _names(model), None, {}, {})
    torch.save(opt.state_dict(), path / ckpt.OPTIMIZER_FILE)  # a pickle wearing the safetensors name
    with pytest.raises(CheckpointError, match=r"optimizer\.safetensors fails its sha256 check"):
        load_checkpoint(path, torch.optim.AdamW(model.parameters()), _names(model))
    _reseal(path)  # even with matching checksums, the pickle is never loaded
    refusal = r"optimizer\.safetensors is not a valid safetensors file.*without --resume"
    with pytest.raises(CheckpointError, match=refusal):
        load_checkpoint(path, torch.optim.AdamW(model.parameters()), _names(model))


def test_incomplete_or_corrupt_checkpoint_is_refused(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    path = save_checkpoint(tmp_path, 1, _lora(model), opt, _names(model), None, {}, {})
    (path / ckpt.STATE_FILE).write_text("{not json")
    _reseal(path)
    with pytest.raises(CheckpointError, match=r"state\.json is unreadable"):
        load_checkpoint(path, opt, _names(model))
    (path / ckpt.LORA_FILE).unlink()
    with pytest.raises(CheckpointError, match=r"is incomplete \(missing lora\.safetensors\)"):
        load_checkpoint(path, opt, _names(model))
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere", opt, _names(model))


def test_resume_naming_no_checkpoint_folder_says_what_it_names_and_what_resume_takes(tmp_path):
    """Issue 40, item 9: --resume with a checkpoint's file said the checkpoint "does not exist". Now the sentence
    says what was given (a file, a run's folder, nothing) and what --resume takes; the control: a checkpoint folder
    passes on to load_checkpoint."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    path = save_checkpoint(tmp_path / "run", 1, _lora(model), opt, _names(model), None, {}, {})
    check_resume_folder(path)
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "fresh" / ckpt.CHECKPOINTS_DIR).mkdir(parents=True)
    takes = "--resume takes latest or a checkpoint folder, checkpoints/step-NNNNNNNN in a run's -o folder, holding"
    for given, sentence in [
        (path / ckpt.LORA_FILE, f"is a file, not a folder; {takes} lora.safetensors, optimizer.safetensors, "
                                f"state.safetensors, state.json, checksums.json; pass the folder holding it, "
                                f"--resume {path}."),
        (tmp_path / "notes.txt", f"is a file, not a folder; {takes}"),
        (tmp_path / "nowhere", f"does not exist; {takes}"),
        (tmp_path / "run", f"holds a run's checkpoints but is not one; pass --resume {path} (the newest), or -o "
                           f"{tmp_path / 'run'} --resume latest."),
        (path.parent, f"holds a run's checkpoints but is not one; pass --resume {path} (the newest)"),
        (tmp_path / "fresh", "holds a run's checkpoints but is not one; none of them is complete yet"),
    ]:
        with pytest.raises(CheckpointError) as err:
            check_resume_folder(given)
        assert str(err.value).startswith(f"--resume {given} {sentence}"), str(err.value)


def test_resume_with_a_file_is_refused_before_the_run_makes_anything(tmp_path):
    from click.testing import CliRunner

    from squareq.cli import main

    (tmp_path / "lora.safetensors").write_bytes(b"x")
    result = CliRunner().invoke(main, ["train", str(tmp_path / "x.slab"), "--data", str(tmp_path), "-o",
                                       str(tmp_path / "out"), "--resume", str(tmp_path / "lora.safetensors")])
    lines = result.output.splitlines()
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert lines[0].startswith(f"error: --resume {tmp_path / 'lora.safetensors'} is a file, not a folder; --resume "
                               "takes latest or a checkpoint folder")
    assert not (tmp_path / "out").exists()


def test_different_lora_is_refused(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt, None, 1)
    path = save_checkpoint(tmp_path, 1, _lora(model), opt, _names(model), None, {}, {})

    wider = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))  # another "rank"
    with pytest.raises(CheckpointError, match="different LoRA"):
        load_checkpoint(path, torch.optim.AdamW(wider.parameters()), _names(wider))
    renamed = [f"x.{n}" for n in _names(model)]  # other targets
    with pytest.raises(CheckpointError, match="different LoRA"):
        load_checkpoint(path, torch.optim.AdamW(_model().parameters()), renamed)
    with pytest.raises(CheckpointError, match="SGD"):
        load_checkpoint(path, torch.optim.SGD(_model().parameters(), lr=0.1), _names(model))


def test_unsaveable_values_fail_before_writing(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="JSON-able"):
        save_checkpoint(tmp_path, 1, _lora(model), opt, _names(model), None, {"f": object()}, {})
    with pytest.raises(ValueError, match="JSON-able"):
        save_checkpoint(tmp_path, 1, _lora(model), opt, _names(model), None, {}, {"t": torch.zeros(1)})
    assert latest_checkpoint(tmp_path) is None


def _two_checkpoints(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, None, 1)
    first = save_checkpoint(tmp_path, 1, _lora(model), opt, _names(model), None, {}, {})
    _train(model, opt, None, 1)
    second = save_checkpoint(tmp_path, 2, _lora(model), opt, _names(model), None, {}, {})
    return model, first, second


def _flip_bit(path, byte_from_end=3, bit=6):
    data = bytearray(path.read_bytes())
    data[len(data) - byte_from_end] ^= 1 << bit  # inside the last float: an exponent bit
    path.write_bytes(bytes(data))


def test_a_flipped_bit_is_refused_naming_the_previous_checkpoint(tmp_path):
    model, first, second = _two_checkpoints(tmp_path)
    for name in ckpt.HASHED_FILES:
        original = (second / name).read_bytes()
        _flip_bit(second / name)
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(second, torch.optim.AdamW(model.parameters()), _names(model))
        message = str(info.value)
        assert f"{second / name} fails its sha256 check" in message
        assert f"--resume {first}" in message
        (second / name).write_bytes(original)
    load_checkpoint(second, torch.optim.AdamW(model.parameters()), _names(model))  # intact again: loads
    _flip_bit(first / ckpt.LORA_FILE)
    with pytest.raises(CheckpointError, match="no earlier checkpoint exists"):
        load_checkpoint(first, torch.optim.AdamW(model.parameters()), _names(model))
    (second / ckpt.CHECKSUMS_FILE).write_text("[]")
    with pytest.raises(CheckpointError, match=r"checksums\.json is unreadable or damaged"):
        load_checkpoint(second, torch.optim.AdamW(model.parameters()), _names(model))


@pytest.mark.parametrize("damage, refusal", [
    (lambda t: {k: v for k, v in list(t.items())[1:]}, r"has no tensor 0\.bias"),
    (lambda t: {**t, "0.weight": torch.zeros(2, 2)}, r"shape \[2, 2\]"),
    (lambda t: {**t, "0.weight": torch.full_like(t["0.weight"], float("nan"))}, "NaN or Inf in 0.weight"),
    (lambda t: {**t, "stray": torch.zeros(1)}, "does not train, e.g. stray"),
])
def test_a_lora_file_that_does_not_fit_is_refused(tmp_path, damage, refusal):
    from safetensors.torch import load_file, save_file

    model, first, second = _two_checkpoints(tmp_path)
    save_file(damage(load_file(second / ckpt.LORA_FILE)), second / ckpt.LORA_FILE)
    _reseal(second)  # consistent checksums: the content itself must be refused
    with pytest.raises(CheckpointError, match=refusal) as info:
        load_checkpoint(second, torch.optim.AdamW(model.parameters()), _names(model))
    assert f"--resume {first}" in str(info.value)


def test_a_checkpoint_without_checksums_is_refused_by_version(tmp_path):
    model, first, second = _two_checkpoints(tmp_path)
    state = json.loads((second / ckpt.STATE_FILE).read_text())
    (second / ckpt.STATE_FILE).write_text(json.dumps({**state, "format_version": 1}))
    (second / ckpt.CHECKSUMS_FILE).unlink()
    assert latest_checkpoint(tmp_path) == second  # listed, so --resume latest says why it cannot use it
    with pytest.raises(CheckpointError, match=f"format version 1.*--resume {first}"):
        load_checkpoint(second, torch.optim.AdamW(model.parameters()), _names(model))


@pytest.mark.parametrize("field, value", [("step", "x"), ("data_state", [1]), ("optimizer", 3), ("rng", {}),
                                          ("extra", {"__tensor__": "nope"}), ("config", None)])
def test_malformed_state_fields_are_refused(tmp_path, field, value):
    model, first, second = _two_checkpoints(tmp_path)
    state = json.loads((second / ckpt.STATE_FILE).read_text())
    (second / ckpt.STATE_FILE).write_text(json.dumps({**state, field: value}))
    _reseal(second)
    with pytest.raises(CheckpointError, match=f"checkpoint {second}.*--resume {first}"):
        load_checkpoint(second, torch.optim.AdamW(model.parameters()), _names(model))


def test_two_identical_saves_write_byte_identical_files(tmp_path):
    """The audit's finding: identical runs gave identical tensors but files whose headers were ordered differently."""
    from squareq.train.lora_files import adapter_metadata

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, None, 1)
    lora = {f"layer{i}.lora_A.weight": torch.randn(2, 4) for i in range(3)}
    lora.update({f"layer{i}.lora_B.weight": torch.randn(5, 2) for i in range(3)})
    meta = {**adapter_metadata(lora, 2, 1.0), "a": "1", "b": "2", "c": "3"}
    state = torch.get_rng_state()
    folders = []
    for out in ("one", "two"):
        torch.set_rng_state(state)
        folders.append(save_checkpoint(tmp_path / out, 1, _lora(model), opt, _names(model), None, {}, {},
                                       lora_metadata=meta))
    for name in ckpt.REQUIRED_FILES:
        assert (folders[0] / name).read_bytes() == (folders[1] / name).read_bytes(), name
