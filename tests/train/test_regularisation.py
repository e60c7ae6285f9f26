"""Regularisation images (reg_data, kohya's reg_data_dir): mixed into each epoch as kohya does, their loss weighted
by prior_loss_weight."""
import json

import pytest
import torch
from PIL import Image

from squareq.train.config import ConfigError, load_config
from squareq.train.data import scan_dataset, with_regularisation
from squareq.train.loop import train

pytestmark = pytest.mark.usefixtures("torch_kernels")


def _folder(root, images):
    root.mkdir(parents=True)
    for name, color, caption in images:
        Image.new("RGB", (64, 64), color).save(root / f"{name}.png")
        (root / f"{name}.txt").write_text(caption)
    return root


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_slab):
    root = tmp_path_factory.mktemp("reg")
    (root / "tiny.slab").symlink_to(tiny_slab)
    _folder(root / "data", [("sks", (200, 30, 30), "a photo of sks dog")])
    _folder(root / "reg", [("dog", (30, 30, 200), "a photo of a dog")])
    _folder(root / "other-reg", [("cat", (30, 200, 30), "a photo of a cat")])
    return root


def _config(ws, out, **kw):
    values = {"slab": str(ws / "tiny.slab"), "data": str(ws / "data"), "output": str(out), "resolution": 64,
              "max_sequence_length": 16, "steps": 1, "lr": 1e-3, "rank": 4, "save_every": 0, "batch_size": 2,
              "max_grad_norm": 0.0,  # the gradients as the loss gives them, unclipped
              "cache_dir": str(ws / "cache")}
    values.update(kw)
    return load_config(None, values)


def _first_gradients(cfg) -> torch.Tensor:
    got = {}
    train(cfg, echo=lambda s: None, on_gradients=lambda step, grads: got.setdefault(step, torch.cat(
        [g.flatten() for g in grads])))
    return got[min(got)]


def test_the_regularisation_images_loss_enters_the_step_at_its_weight(workspace, tmp_path):
    """One training and one regularisation image in one batch: the step's gradient is (g_train + w · g_reg) / 2, so
    it moves linearly with prior_loss_weight w (to bf16 autocast's rounding), and at w = 0 the regularisation image
    adds nothing: another one in its place leaves the gradient as it was."""
    def gradients(w, reg="reg"):
        return _first_gradients(_config(workspace, tmp_path / f"{reg}-w{w}", reg_data=str(workspace / reg),
                                        prior_loss_weight=w))

    grads = {w: gradients(w) for w in (0.0, 1.0, 3.0)}
    reg_part = grads[1.0] - grads[0.0]
    assert reg_part.norm() > 0.1 * grads[0.0].norm()  # the regularisation image counts
    assert (grads[3.0] - grads[1.0] - 2 * reg_part).norm() < 0.05 * (2 * reg_part).norm()  # measured: 1%
    assert torch.allclose(gradients(0.0, "other-reg"), grads[0.0], rtol=1e-5, atol=1e-9)
    assert not torch.allclose(gradients(1.0, "other-reg"), grads[1.0], rtol=1e-2)  # negative control: w = 1
    from safetensors import safe_open

    with safe_open(str(tmp_path / "reg-w3.0" / "pytorch_lora_weights.safetensors"), "pt") as f:
        header = f.metadata()
    assert (header["ss_num_train_images"], header["ss_num_reg_images"], header["ss_prior_loss_weight"]) == \
        ("1", "1", "3.0")
    assert json.loads(header["ss_reg_dataset_dirs"]) == {".": {"img_count": 1, "n_repeats": 1}}


def test_regularisation_captions_keep_the_class_and_never_get_the_trigger(workspace, tmp_path, monkeypatch):
    """The trigger word marks the training images' subject; a regularisation image is the class without it, and a
    dropped caption of one stays its caption."""
    from squareq import runtime
    from squareq.train.prepare import prepare_data

    cfg = _config(workspace, tmp_path / "t", reg_data=str(workspace / "reg"), trigger="sks", caption_dropout=0.99)
    loaded = runtime.load(workspace / "tiny.slab", "cpu", options=runtime.LoadOptions(stream=False))
    model = runtime.runtime_of(loaded).manifest.model
    data = prepare_data(cfg, model, torch.device("cpu"), echo=lambda s: None, encode=False)
    by_reg = {item.reg: data.captions[i] for i, item in enumerate(data.dataset.training_items)}
    assert by_reg[False] == ["sks, a photo of sks dog"] and by_reg[True] == ["a photo of a dog"]
    from squareq.train.feed import CacheFeed

    seen, batch = [], CacheFeed.batch

    def recording(self, indices, drops, epoch=0):
        seen.extend(zip(indices, drops))
        return batch(self, indices, drops, epoch)

    monkeypatch.setattr(CacheFeed, "batch", recording)
    train(cfg, echo=lambda s: None)
    reg = {i for i, item in enumerate(data.dataset.training_items) if item.reg}
    assert {d for i, d in seen if i in reg} == {False} and {d for i, d in seen if i not in reg} == {True}


def test_an_epoch_holds_as_many_regularisation_entries_as_training_entries(tmp_path):
    train_set = scan_dataset(_folder(tmp_path / "3_sks", [(f"t{i}", (i, 0, 0), "sks") for i in range(2)]).parent)
    reg_set = scan_dataset(_folder(tmp_path / "regs" / "1_dog", [(f"r{i}", (0, i, 0), "dog") for i in range(5)])
                           .parent)
    mixed = with_regularisation(train_set, reg_set)
    entries = mixed.training_items
    assert sum(not e.reg for e in entries) == 6 and sum(e.reg for e in entries) == 6  # 2 images x 3 repeats; 5 reg
    assert sorted({e.path.name for e in entries if e.reg}) == [f"r{i}.png" for i in range(5)]  # cycled: r0 twice
    few = with_regularisation(reg_set, train_set)  # more training entries (5) than regularisation ones (6): cut
    assert sum(e.reg for e in few.training_items) == 5


@pytest.mark.parametrize("values, message", [
    ({"prior_loss_weight": 2.0}, "prior_loss_weight = 2.0 weighs regularisation images, and reg_data names none"),
    ({"prior_loss_weight": -1.0, "reg_data": "."}, "prior_loss_weight = -1.0 must be a number of at least 0"),
])
def test_regularisation_keys_that_cannot_work_are_one_sentence(workspace, tmp_path, values, message):
    with pytest.raises(ConfigError, match=message):
        _config(workspace, tmp_path, **values)


def test_kohyas_reg_data_dir(workspace, tmp_path):
    toml = tmp_path / "kohya.toml"
    toml.write_text(f'reg_data_dir = "{workspace / "reg"}"\nprior_loss_weight = 0.5\n')
    cfg = load_config(toml, {"slab": str(workspace / "tiny.slab"), "data": str(workspace / "data"),
                             "output": str(tmp_path / "out")})
    assert cfg.reg_data == str(workspace / "reg") and cfg.prior_loss_weight == 0.5
