"""The folders a slab's commands read encoders from (issue 40, item 4): pickled weights are refused in one sentence
and never unpickled, and the source a slab records is checked against the identity its compile recorded before a
command picks it by default."""
import json
import logging
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from squareq.acceptance.image_drift import DriftError, check_clip_folder
from squareq.cli import main
from squareq.compiler import CompileOptions, compile_slab
from squareq.compiler.plain import PlainOptions, write_rtn_slab
from squareq.models import ModelError, load_builtin, write_tiny_flux_pipeline
from squareq.quant import QuantSpec
from squareq.slab import open_slab
from squareq.sources import open_source
from squareq.sources.local_files import refuse_pickled, source_identity
from squareq.sources.encoder_source import EncoderError, encoder_source_for, recorded_encoders
from squareq.train.tiny_dataset import write_tiny_dataset

from .test_lora_files import one_sentence_naming

pytestmark = pytest.mark.usefixtures("torch_kernels")

FAST = dict(rounding="nearest", calib_samples=4, max_rows=128, effect_probes=4)


@pytest.fixture
def no_torch_load(monkeypatch):
    """torch.load raises: nothing may unpickle a user's file, and a call would show here as an error."""
    def refuse(*args, **kwargs):
        raise AssertionError("torch.load was called")

    monkeypatch.setattr(torch, "load", refuse)


def pickle_weights(folder, name="model.safetensors", pickled="pytorch_model.bin"):
    """Replace a component's safetensors weights by the same tensors pickled (what torch.save writes)."""
    torch.save(load_file(str(folder / name)), folder / pickled)
    (folder / name).unlink()


def slab_of(pipeline, out, identity=True):
    """A tiny-flux slab that records ``pipeline``'s transformer as its source (and, unless not asked, its identity
    as the folder is now), as squareq compile writes one."""
    model, adapter = load_builtin("tiny-flux")
    source = str(pipeline / "transformer")
    write_rtn_slab(model, adapter.blocks(model), {}, out, PlainOptions(
        default_spec=QuantSpec(bits=8), clip_search=False, family="flux", source=source,
        source_identity={source: source_identity(source)} if identity else None))
    return out


def cache_command(slab, root, *extra):
    return CliRunner().invoke(main, ["cache", str(slab), "--data", str(write_tiny_dataset(root / "data", count=2)),
                                     "--cache-dir", str(root / "cache"), "--resolution", "64",
                                     "--max-sequence-length", "16", *extra])


def test_a_pickled_encoder_is_refused_in_one_sentence_and_never_unpickled(tmp_path, no_torch_load):
    good = write_tiny_flux_pipeline(tmp_path / "good")
    pickled = write_tiny_flux_pipeline(tmp_path / "pickled")
    pickle_weights(pickled / "text_encoder")
    result = cache_command(slab_of(pickled, tmp_path / "pickled.slab"), tmp_path / "a")  # the recorded folder
    bad = pickled / "text_encoder" / "pytorch_model.bin"
    assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
    assert result.output.startswith(f"error: {bad} holds pickled weights") and "Traceback" not in result.output
    assert f"torch.load({str(bad)!r}, weights_only=True)" in result.output  # the conversion, ready to paste
    assert str(pickled / "text_encoder" / "model.safetensors") in result.output
    # control: the same pipeline in safetensors is read, with torch.load still refusing
    result = cache_command(slab_of(good, tmp_path / "good.slab"), tmp_path / "b")
    assert result.exit_code == 0 and "2 images cached" in result.output, result.output


def test_every_reader_of_model_folders_refuses_pickles_the_same_way(tmp_path, no_torch_load):
    vae = tmp_path / "vae"
    write_tiny_flux_pipeline(tmp_path / "flux")
    shutil.copytree(tmp_path / "flux" / "vae", vae)
    refuse_pickled(vae)  # control: safetensors weights pass
    pickle_weights(vae, "diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin")
    with pytest.raises(ModelError) as err:
        refuse_pickled(tmp_path / "missing", vae)
    one_sentence_naming(err, f"{vae / 'diffusion_pytorch_model.bin'} holds pickled weights")
    assert str(vae / "diffusion_pytorch_model.safetensors") in str(err.value)  # diffusers' name for the converted file
    # the compiler's source folders
    with pytest.raises(ModelError) as err:
        open_source(str(vae))
    one_sentence_naming(err, "diffusion_pytorch_model.bin holds pickled weights")
    # the acceptance gate's CLIP folder
    clip = tmp_path / "clip"
    for name in ("config.json", "preprocessor_config.json", "tokenizer_config.json"):
        (clip / name).parent.mkdir(exist_ok=True)
        (clip / name).write_text("{}")
    torch.save({"w": torch.zeros(2)}, clip / "pytorch_model.bin")
    with pytest.raises(DriftError) as err:
        check_clip_folder(clip)
    one_sentence_naming(err, f"--clip-model {clip / 'pytorch_model.bin'} holds pickled weights")


@pytest.fixture
def compiled(tmp_path, tiny_flux_images):
    """A pipeline folder and the slab squareq's compiler wrote from its transformer/."""
    pipeline = write_tiny_flux_pipeline(tmp_path / "flux")
    out = tmp_path / "flux.slab"
    compile_slab(open_source(str(pipeline / "transformer")), out,
                 CompileOptions(budget=2_000_000, calib_images=tiny_flux_images, **FAST))
    return pipeline, out


def default_pick(slab, new_process: bool = True):
    """What a command picks by default; each pick a new command's (a process checks an unchanged source once)."""
    from squareq.sources import encoder_source

    if new_process:
        encoder_source._MATCHED.clear()
    with open_slab(slab, verify="off") as s:
        record = s.manifest.model
    return encoder_source_for(recorded_encoders(record), record.family, record.config)


def test_an_unchanged_source_is_hashed_once_per_process(compiled, monkeypatch):
    from squareq.sources import encoder_source

    pipeline, slab = compiled
    calls = []
    real = encoder_source.source_identity
    monkeypatch.setattr(encoder_source, "source_identity", lambda where: calls.append(where) or real(where))
    for new_process in (True, False, False):  # a run picks its encoders several times
        assert default_pick(slab, new_process).where == str(pipeline / "transformer")
    assert calls == [str(pipeline / "transformer")]


def test_a_source_changed_since_the_compile_is_named_when_picked_by_default(compiled, tmp_path, caplog):
    pipeline, slab = compiled
    where = str(pipeline / "transformer")
    assert json.loads((slab / "manifest.json").read_text())["model"]["source_identity"] == {
        where: source_identity(where)}
    with caplog.at_level(logging.WARNING):
        assert default_pick(slab).where == where  # unchanged: used, without a word
    assert not caplog.records
    config = pipeline / "text_encoder" / "config.json"
    original = config.read_text()
    config.write_text(original.replace('"hidden_act"', '"initializer_factor": 2.0, "hidden_act"'))
    with pytest.raises(EncoderError) as err:
        default_pick(slab)
    one_sentence_naming(err, f"{where}, which the slab records as its source, changed since the slab was compiled")
    assert f"--model {where}" in str(err.value)
    result = cache_command(slab, tmp_path / "run")
    assert result.exit_code == 1 and "changed since the slab was compiled" in result.output, result.output
    assert result.output.count("\n") == 1
    with open_slab(slab, verify="off") as s:  # passed explicitly, the folder is used as it is now
        record = s.manifest.model
    assert encoder_source_for(recorded_encoders(record), "flux", record.config, model=where).where == where
    config.write_text(original)
    default_pick(slab)  # as compiled again
    # a swapped weight file of the same shapes (another seed: same size and header, other numbers)
    other = write_tiny_flux_pipeline(tmp_path / "other", seed=1)
    shutil.copy(other / "text_encoder" / "model.safetensors", pipeline / "text_encoder" / "model.safetensors")
    with pytest.raises(EncoderError, match="changed since the slab was compiled"):
        default_pick(slab)


def test_the_identity_reads_a_megabyte_of_a_large_weights_file_yet_sees_it_retrained(tmp_path, monkeypatch):
    import builtins

    from safetensors.torch import save_file

    from squareq.sources import local_files

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "t5"}')
    torch.manual_seed(0)
    save_file({"w": torch.randn(4096, 2048)}, str(model / "model.safetensors"))  # 32 MiB
    read = []

    class Counted:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def seek(self, offset):
            return self.f.seek(offset)

        def read(self, n=-1):
            data = self.f.read(n)
            read.append(len(data))
            return data

    monkeypatch.setattr(local_files, "open", lambda *a: Counted(builtins.open(*a)), raising=False)
    first = source_identity(model)
    assert sum(read) < 2 << 20  # the header and sixteen 64 KiB chunks, not 32 MiB
    assert source_identity(str(model)) == first  # reproducible
    save_file({"w": torch.randn(4096, 2048)}, str(model / "model.safetensors"))  # same size and header
    assert source_identity(model) != first


def test_a_slab_older_than_source_identities_uses_its_source_unverified_with_one_line(tmp_path, caplog):
    pipeline = write_tiny_flux_pipeline(tmp_path / "flux")
    slab = slab_of(pipeline, tmp_path / "old.slab", identity=False)
    assert "source_identity" not in json.loads((slab / "manifest.json").read_text())["model"]
    with caplog.at_level(logging.WARNING):
        assert default_pick(slab).where == str(pipeline / "transformer")
        default_pick(slab)  # a run picks its encoders more than once, and says it once
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "used unverified" in lines[0] and str(pipeline / "transformer") in lines[0], lines
