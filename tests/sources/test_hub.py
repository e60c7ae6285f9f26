"""Hub IDs: what is taken for one, which files are fetched, the cache offline, and one sentence for every refusal."""
import json

import pytest
from huggingface_hub import constants
from huggingface_hub import errors as hf
from huggingface_hub.utils import filter_repo_objects

from squareq.models import ModelError
from squareq.sources import hub
from squareq.sources.hub import HubRef, hub_ref, pipeline_components, pipeline_patterns

# black-forest-labs/FLUX.1-dev's files (its repository listing): the pipeline folders, and beside them the single
# files BFL also publishes, which a SquareQ download must leave alone (24 GB and 335 MB).
FLUX1_DEV_FILES = [
    ".gitattributes", "LICENSE.md", "README.md", "ae.safetensors", "dev_grid.jpg", "flux1-dev.safetensors",
    "model_index.json", "scheduler/scheduler_config.json", "text_encoder/config.json",
    "text_encoder/model.safetensors", "text_encoder_2/config.json", "text_encoder_2/model-00001-of-00002.safetensors",
    "text_encoder_2/model-00002-of-00002.safetensors", "text_encoder_2/model.safetensors.index.json",
    "tokenizer/merges.txt", "tokenizer/special_tokens_map.json", "tokenizer/tokenizer_config.json",
    "tokenizer/vocab.json", "tokenizer_2/special_tokens_map.json", "tokenizer_2/spiece.model",
    "tokenizer_2/tokenizer.json", "tokenizer_2/tokenizer_config.json", "transformer/config.json",
    "transformer/diffusion_pytorch_model-00001-of-00003.safetensors",
    "transformer/diffusion_pytorch_model-00002-of-00003.safetensors",
    "transformer/diffusion_pytorch_model-00003-of-00003.safetensors",
    "transformer/diffusion_pytorch_model.safetensors.index.json", "vae/config.json",
    "vae/diffusion_pytorch_model.safetensors",
]
FLUX1_INDEX = {"_class_name": "FluxPipeline", "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
               "text_encoder": ["transformers", "CLIPTextModel"], "text_encoder_2": ["transformers", "T5EncoderModel"],
               "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "T5TokenizerFast"],
               "transformer": ["diffusers", "FluxTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"]}
COMMIT = "a" * 40


def fetched(allow, ignore=hub.NOT_READ, files=FLUX1_DEV_FILES):
    return set(filter_repo_objects(files, allow_patterns=list(allow), ignore_patterns=list(ignore)))


def test_what_is_taken_for_a_hub_id(tmp_path, monkeypatch):
    assert hub_ref("black-forest-labs/FLUX.1-dev") == HubRef("black-forest-labs/FLUX.1-dev")
    assert hub_ref("org/name@v1.0") == HubRef("org/name", "v1.0")
    assert hub_ref("org/name@v1.0", revision="main") == HubRef("org/name", "main")
    assert str(HubRef("org/name", "abc")) == "org/name@abc" and HubRef("o/n").page == "https://huggingface.co/o/n"
    # a path that exists, a missing file, a deeper path, a built-in name: not Hub IDs
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "flux").mkdir(parents=True)
    for text in ("models/flux", "models/flux1-dev.safetensors", "a/b/c", "tiny-flux", "../up", "org/..", "/abs/x",
                 "org/a--b", "org/name."):  # the last two break the Hub's own naming rules
        assert hub_ref(text) is None, text


def test_a_pipeline_fetches_only_what_the_command_reads():
    assert pipeline_components(FLUX1_INDEX, ("transformer",)) == ["transformer"]
    encoders = pipeline_components(FLUX1_INDEX, ("vae", "scheduler", "text_encoder", "tokenizer"))
    assert encoders == ["scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "vae"]
    compile_files = fetched(pipeline_patterns(["transformer"]))
    assert compile_files == {"model_index.json"} | {f for f in FLUX1_DEV_FILES if f.startswith("transformer/")}
    train_files = fetched(pipeline_patterns(encoders))
    assert "flux1-dev.safetensors" not in train_files and "ae.safetensors" not in train_files
    assert not any(f.startswith("transformer/") for f in train_files)
    assert {"vae/diffusion_pytorch_model.safetensors", "tokenizer_2/spiece.model",
            "text_encoder_2/model-00002-of-00002.safetensors"} <= train_files
    # encoders given as single files: only their configs come from the repository
    configs = fetched(pipeline_patterns(["scheduler", "tokenizer", "tokenizer_2"],
                                       ["text_encoder", "text_encoder_2", "vae"]))
    assert not any(f.endswith(".safetensors") for f in configs)
    assert {"text_encoder_2/config.json", "vae/config.json", "tokenizer/vocab.json"} <= configs


def test_pickles_variants_and_exports_are_never_fetched():
    files = ["config.json", "model.safetensors", "pytorch_model.bin", "model.fp16.safetensors", "onnx/model.onnx",
             "tokenizer.json", "vocab.txt", "spiece.model", "tf_model.h5", "flax_model.msgpack",
             "model-00001-of-00002.fp16.safetensors"]
    assert fetched(hub.MODEL_FILES, files=files) == {"config.json", "model.safetensors", "tokenizer.json",
                                                     "vocab.txt", "spiece.model"}


def write_cached_repo(cache, repo, files: dict, commit=COMMIT):
    storage = cache / f"models--{repo.replace('/', '--')}"
    for name, text in files.items():
        path = storage / "snapshots" / commit / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / "main").write_text(commit)
    return storage / "snapshots" / commit


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache with downloads off, as HF_HUB_OFFLINE=1 and HF_HUB_CACHE set it."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    hub._fetch.cache_clear()
    yield cache
    hub._fetch.cache_clear()


def test_the_cache_answers_offline(offline_cache):
    snapshot = write_cached_repo(offline_cache, "org/pipe", {
        "model_index.json": json.dumps(FLUX1_INDEX), "transformer/config.json": "{}", "vae/config.json": "{}"})
    folder, index = hub.index_of(HubRef("org/pipe"))
    assert folder == snapshot and index == FLUX1_INDEX
    assert hub.fetch(HubRef("org/pipe", COMMIT), pipeline_patterns(["transformer"])) == snapshot  # by commit too
    assert hub.resolved(HubRef("org/pipe"), folder) == HubRef("org/pipe", COMMIT)
    hub.require(folder, HubRef("org/pipe"), ["transformer", "vae"])
    with pytest.raises(ModelError, match=r"the cached copy of org/pipe has no text_encoder/; run the command"):
        hub.require(folder, HubRef("org/pipe"), ["vae", "text_encoder"])
    # a component whose configs alone were fetched before (its weights came from a single file then)
    with pytest.raises(ModelError, match=r"has no vae/\*\.safetensors; run the command once with network access"):
        hub.require(folder, HubRef("org/pipe"), ["vae"], weights=["vae"])
    (snapshot / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    hub.require(folder, HubRef("org/pipe"), ["vae"], weights=["vae"])
    (snapshot / "model_index.json").write_text("{not json")
    with pytest.raises(ModelError, match="model_index.json is not valid JSON"):
        hub.read_index(snapshot)


def one_sentence(exc_info, *words):
    msg = str(exc_info.value)
    assert "\n" not in msg and msg.endswith("."), msg
    for word in words:
        assert word in msg, (word, msg)


def test_an_uncached_repository_offline_is_one_sentence(offline_cache):
    with pytest.raises(ModelError) as err:
        hub.index_of(HubRef("org/missing"))
    one_sentence(err, "org/missing is not a local path, nor in the Hugging Face cache", str(offline_cache),
                 "HF_HUB_OFFLINE", "hf download org/missing")


def _response(status):
    try:  # the HTTP library huggingface_hub's errors carry a response of: httpx2 from huggingface_hub 2, else httpx
        import httpx2 as httpx
    except ImportError:
        import httpx
    return httpx.Response(status, request=httpx.Request("GET", "https://huggingface.co/api/models/org/name"))


@pytest.mark.parametrize("error, words", [
    (hf.GatedRepoError("gated", response=_response(403)),
     ["org/name is gated", "https://huggingface.co/org/name", "hf auth login", "HF_TOKEN"]),
    (hf.RepositoryNotFoundError("404", response=_response(404)),
     ["neither a local path nor a repository", "https://huggingface.co/org/name", "hf auth login", "HF_TOKEN"]),
    (hf.RevisionNotFoundError("404", response=_response(404)), ["org/name has no revision 'v9'", "--revision"]),
    (hf.LocalEntryNotFoundError("Got: ConnectError: no route"), ["the Hub cannot be reached", "HF_HOME"]),
    (hf.HfHubHTTPError("500 Server Error", response=_response(500)),
     ["the Hugging Face Hub refused org/name@v9 (500 Server Error)", "HF_TOKEN"]),
] + ([(hf.IncompleteSnapshotError("The cached snapshot is incomplete. More", snapshot_path="x"),
       ["the cached copy of org/name@v9 is incomplete", "network access"])]
     if hasattr(hf, "IncompleteSnapshotError") else []))
def test_hub_refusals_are_one_sentence(error, words, monkeypatch, tmp_path):
    """What the Hub answers a gated, missing or mistyped repository, or no network at all (online)."""
    import huggingface_hub

    def refuse(*args, **kwargs):
        raise error

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    hub._fetch.cache_clear()
    with pytest.raises(ModelError) as err:
        hub.fetch(HubRef("org/name", "v9"), hub.MODEL_FILES)
    one_sentence(err, *words)
    hub._fetch.cache_clear()


@pytest.mark.parametrize("revision", ["..", "../../../../pipe", ".hidden", "a..b", "main/", "x y", "v1.lock", "a:b"])
def test_a_revision_that_no_branch_can_be_is_refused_in_one_sentence(revision):
    """The third audit: a revision of ``..`` reached the cache's folders as a path. It is refused before any file is
    read, naming it; branches with slashes, tags and commits still pass (the positive control)."""
    with pytest.raises(ModelError, match="is not a branch, tag or commit name"):
        hub_ref("owner/name", revision)
    with pytest.raises(ModelError, match="is not a branch, tag or commit name"):
        hub_ref(f"owner/name@{revision}") if " " not in revision else hub_ref("owner/name", revision)
    for good in ("main", "refs/pr/3", "v1.0", "0123456789abcdef0123456789abcdef01234567"):
        assert hub_ref("owner/name", good) == HubRef("owner/name", good)
