"""A run's record in its output folder (train/run_record.py): run.json says running while the run goes on and then
how it ended, config.toml reads back as the run's configuration, train.log holds every line the run said; a run that
failed before writing anything else leaves nothing, so the CLI can remove the folder it made."""
import json
import os

import pytest

from squareq.train.config import load_config
from squareq.train.errors import TrainError, TrainInterrupted
from squareq.train.run_record import read_run_record, recorded


def _cfg(out):
    return load_config(None, {"slab": "tiny.slab", "data": "data", "output": str(out), "steps": 7})


def test_a_run_is_recorded_as_running_then_finished_with_its_log_and_config(tmp_path):
    said = []
    with recorded(tmp_path, _cfg(tmp_path), True, said.append) as (record, echo):
        state = read_run_record(tmp_path)
        assert state["status"] == "running" and state["pid"] == os.getpid() and state["cwd"] == os.getcwd()
        record.update(total=7, first_step=0)
        echo("step 1/7: loss 1.0")
        (tmp_path / "metrics.jsonl").write_text("{}\n")
    state = read_run_record(tmp_path)
    assert state["status"] == "finished" and state["total"] == 7 and state["ended"] >= state["started"]
    assert said == ["step 1/7: loss 1.0"]  # the caller's echo still gets each line
    log = (tmp_path / "train.log").read_text().splitlines()
    assert log[1] == "step 1/7: loss 1.0" and log[-1].endswith(": finished"), log
    assert load_config(tmp_path / "config.toml", {}) == _cfg(tmp_path)  # reads back as the same configuration


@pytest.mark.parametrize("error, status", [(TrainInterrupted("Ctrl-C: stopped after step 3 of 7"), "stopped"),
                                           (KeyboardInterrupt(), "stopped"),
                                           (TrainError("the slab is damaged; compile it again."), "failed")])
def test_how_a_run_ended_is_recorded_with_its_sentence(tmp_path, error, status):
    with pytest.raises(type(error)):
        with recorded(tmp_path, _cfg(tmp_path), True, lambda line: None):
            (tmp_path / "checkpoints").mkdir()  # something of the run's own was written
            raise error
    state = read_run_record(tmp_path)
    assert state["status"] == status and state["message"] == (str(error) or "Ctrl-C: stopped at once"), state
    assert (tmp_path / "train.log").read_text().splitlines()[-1].endswith(f"{status}: {state['message']}")


def test_a_run_that_failed_before_writing_anything_leaves_no_record(tmp_path):
    with pytest.raises(TrainError):
        with recorded(tmp_path, _cfg(tmp_path), True, lambda line: None):
            raise TrainError("no slab at tiny.slab.")
    assert list(tmp_path.iterdir()) == []


def test_other_ranks_write_no_record_and_an_unreadable_one_reads_as_none(tmp_path):
    with recorded(tmp_path, _cfg(tmp_path), False, print) as (record, echo):
        assert record is None and echo is print
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "run.json").write_text(json.dumps({"status": "dancing"}))
    assert read_run_record(tmp_path) is None
    (tmp_path / "run.json").write_text("{not json")
    assert read_run_record(tmp_path) is None
