"""What the command line does around a run (issue 60's small things): compile refuses a taken -o before any work, a
failed run leaves no empty output folder it created (and never removes one that was there), and Ctrl-C's
TrainInterrupted is its message and exit status 130, without "error:"."""
import pytest
from click.testing import CliRunner

from squareq.cli import main
from squareq.cli.options import removed_if_failed


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def test_compile_refuses_a_taken_output_before_opening_the_model(tmp_path):
    out = tmp_path / "model.slab"
    out.mkdir()
    result = run("compile", "no-such-org/no-such-model", "-o", str(out), "--budget", "1GB")
    assert result.exit_code == 1
    assert "already exists; choose another output path or pass --force" in result.stderr
    assert "no-such-model" not in result.stderr  # the model was never looked up


def test_with_force_the_output_check_lets_the_compile_go_on(tmp_path):
    """The negative control: with --force the same call gets past the check and fails on the model instead."""
    out = tmp_path / "model.slab"
    out.mkdir()
    result = run("compile", str(tmp_path / "no-such-model"), "-o", str(out), "--budget", "1GB", "--force")
    assert result.exit_code == 1 and "already exists" not in result.stderr and "no-such-model" in result.stderr


@pytest.mark.parametrize("command", ["sample", "train"])
def test_a_failed_run_leaves_no_empty_output_folder_it_created(tmp_path, command):
    out = tmp_path / "new" / "out"
    args = ["--prompt", "a cat"] if command == "sample" else ["--data", str(tmp_path)]
    result = run(command, str(tmp_path / "missing.slab"), *args, "-o", str(out))
    assert result.exit_code == 1, result.output
    assert not (tmp_path / "new").exists()


def test_a_folder_that_was_there_is_kept(tmp_path):
    """The negative control: the same failed sample into an existing empty folder leaves it in place."""
    out = tmp_path / "mine"
    out.mkdir()
    result = run("sample", str(tmp_path / "missing.slab"), "--prompt", "a cat", "-o", str(out))
    assert result.exit_code == 1 and out.is_dir()


def test_a_created_folder_that_holds_a_file_is_kept(tmp_path):
    with pytest.raises(RuntimeError), removed_if_failed(tmp_path / "a" / "b"):
        (tmp_path / "a" / "b" / "c").mkdir(parents=True)
        (tmp_path / "a" / "empty").mkdir()
        (tmp_path / "a" / "b" / "c" / "file").write_text("kept")
        raise RuntimeError
    assert (tmp_path / "a" / "b" / "c" / "file").is_file() and not (tmp_path / "a" / "empty").exists()
    with removed_if_failed(tmp_path / "ok"):  # success: nothing is removed
        (tmp_path / "ok").mkdir()
    assert (tmp_path / "ok").is_dir()


def test_train_interrupted_is_its_message_and_exit_status_130(tmp_path, monkeypatch):
    from squareq.train import loop
    from squareq.train.errors import TrainError, TrainInterrupted

    message = "stopped after step 3; wrote checkpoint-3; resume with: squareq train ... --resume latest"

    def interrupted(cfg, echo):
        raise TrainInterrupted(message)

    monkeypatch.setattr(loop, "train", interrupted)
    args = ("train", str(tmp_path / "x.slab"), "--data", str(tmp_path), "-o", str(tmp_path / "lora"))
    result = run(*args)
    assert result.exit_code == 130 and result.stderr.strip() == message

    def failed(cfg, echo):  # the negative control: any other TrainError is "error: ..." and status 1
        raise TrainError("the data is gone")

    monkeypatch.setattr(loop, "train", failed)
    result = run(*args)
    assert result.exit_code == 1 and result.stderr.strip() == "error: the data is gone"
