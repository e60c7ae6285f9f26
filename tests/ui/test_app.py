"""squareq ui's application without a browser (squareq/ui/app.py, start.py, runs.py): the token, actions only as JSON
from the page's origin, a start from an example config queued with the page's dataset and output, the starts it
refuses before queuing anything, and what a run folder says when its process is gone."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from squareq.train.tiny_dataset import write_tiny_dataset
from squareq.ui.app import create_app
from squareq.ui.paths import Roots
from squareq.ui.start import EXAMPLES

from .serving import request, served


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("app")
    write_tiny_dataset(root / "data" / "squares", count=2)
    (root / "fake.slab").mkdir()  # a start checks that the slab is there; nothing reads it here
    (root / "runs").mkdir()
    return root


@pytest.fixture(scope="module")
def port(ws):
    with served(create_app(Roots(ws / "runs", (ws / "data",)), schedule=False, lanes=[None])) as port:
        yield port


def _start(port, ws, **body):
    values = {"slab": str(ws / "fake.slab"), "data_root": 0, "data": "squares", "output": "run1",
              "config_text": "steps = 5\n", "config_name": "mine.toml", **body}
    return request(port, "/api/start", values)


def _job_folders(ws):
    """The folders that hold the queued jobs' copies of their configs."""
    return sorted(p.name for p in (ws / "runs" / ".squareq-ui" / "jobs").glob("*"))


def _jobs(ws):
    path = ws / "runs" / ".squareq-ui" / "queue.json"
    return json.loads(path.read_text())["jobs"] if path.is_file() else []


def test_a_start_from_an_example_config_is_queued_with_the_pages_data_and_output(port, ws):
    status, body = _start(port, ws, example="flux1-dev-16gb.toml", output="example")
    assert status == 200, body
    job = body["job"]
    config = job["argv"][job["argv"].index("--config") + 1]
    assert job["state"] == "queued" and job["run"] == "example" and job["argv"][0] == str(ws / "fake.slab")
    assert open(config).read() == (EXAMPLES / "flux1-dev-16gb.toml").read_text()
    assert job["argv"][-4:] == ["--data", str(ws / "data" / "squares"), "-o", str(ws / "runs" / "example")]
    status, body = request(port, "/api/runs")
    assert [(r["name"], r["status"]) for r in body["runs"]] == [("example", "queued")]
    assert request(port, "/api/runs/example/stop", {})[1] == {"done": "taken out of the queue"}


@pytest.mark.parametrize("body, refusal", [
    ({"output": "../up"}, "the output name '../up' must be one folder name"),
    ({"config_text": "steps = 5\ncache_dir = '/tmp/elsewhere'\n"}, "cache_dir = '/tmp/elsewhere' is outside the runs"),
    ({"config_text": "validation_data = '/etc'\n"}, "validation_data = '/etc' is outside the dataset roots"),
    ({"data": "../.."}, "the dataset folder '../..' leads outside"),
    ({"slab": "nowhere.slab"}, "the slab nowhere.slab does not exist"),
    ({"config_text": "rnak = 4\n"}, "mine.toml: unknown key rnak (did you mean rank?)"),
    ({"config_text": "lr = -1\n"}, "mine.toml"),
    ({"example": "../../etc/passwd"}, "'../../etc/passwd' is not one of the example configs"),
])
def test_a_start_that_cannot_run_is_refused_in_one_sentence_and_queues_nothing(port, ws, body, refusal):
    before, configs = _jobs(ws), _job_folders(ws)
    status, answer = _start(port, ws, **body)
    assert status in (400, 403) and answer["error"].startswith(refusal), answer
    assert _jobs(ws) == before and _job_folders(ws) == configs and not (ws / "runs" / "run1").exists()
    assert _start(port, ws, output="run1")[0] == 200  # the control: the form as given is fine, and is queued
    request(port, "/api/runs/run1/stop", {})


def test_actions_are_json_from_the_pages_own_origin(port, ws):
    form = request(port, "/api/start", method="POST", headers={"content-type": "text/plain"})
    other = request(port, "/api/runs/x/stop", {}, headers={"origin": "http://evil.example"})
    assert form[0] == 403 and other[0] == 403 and "JSON requests from the page" in other[1]["error"]
    same = request(port, "/api/runs/x/stop", {}, headers={"origin": f"http://127.0.0.1:{port}"})
    assert same[0] == 400 and "x is not running" in same[1]["error"]  # the control: the page's own origin is heard
    assert request(port, "/api/runs", headers={"host": "attacker.example"})[0] == 400  # a rebound DNS name


def test_a_run_whose_process_is_gone_without_a_word_shows_as_failed(port, ws):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    folder = ws / "runs" / "killed"
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({"status": "running", "pid": gone.pid, "host": socket.gethostname(),
                                                 "total": 10}))
    status, run = request(port, "/api/runs/killed")
    assert status == 200 and run["status"] == "failed" and "killed?" in run["message"] and not run["resumable"]
    refused = request(port, "/api/runs/killed/resume", {})
    assert refused[0] == 400 and "killed has no config.toml" in refused[1]["error"]
    (folder / "config.toml").write_text(f'output = "{folder}"\n')
    assert request(port, "/api/runs/killed")[1]["resumable"]
    status, queued = request(port, "/api/runs/killed/resume", {})
    assert status == 200 and queued["job"]["argv"][-2:] == ["--resume", "latest"], queued
    assert request(port, "/api/runs/killed/resume", {})[0] == 400  # queued already
    request(port, "/api/runs/killed/stop", {})


def test_a_record_whose_process_number_went_to_a_later_process_is_not_running(port, ws):
    """A killed run's process number given to a newer process (this one, started after the record said): not that
    run, so neither running nor a process a Stop may reach; the control: a record written after it started."""
    folder = ws / "runs" / "reused"
    folder.mkdir()
    record = {"status": "running", "pid": os.getpid(), "host": socket.gethostname(), "started": 1_000_000_000.0}
    (folder / "run.json").write_text(json.dumps(record))
    assert request(port, "/api/runs/reused")[1]["status"] == "failed"
    assert "not running on this machine" in request(port, "/api/runs/reused/stop", {})[1]["error"]
    (folder / "run.json").write_text(json.dumps({**record, "started": time.time()}))
    assert request(port, "/api/runs/reused")[1]["status"] == "running"


def test_a_finished_or_running_run_does_not_resume(port, ws):
    folder = ws / "runs" / "live"
    folder.mkdir()
    (folder / "config.toml").write_text("")
    (folder / "run.json").write_text(json.dumps({"status": "running", "pid": os.getpid(),
                                                 "host": socket.gethostname()}))
    assert request(port, "/api/runs/live/resume", {})[1]["error"] == "live is running; only a stopped or failed run " \
                                                                     "resumes."
    (folder / "run.json").write_text(json.dumps({"status": "finished", "pid": 1, "host": socket.gethostname()}))
    assert request(port, "/api/runs/live/resume", {})[1]["error"].startswith("live is finished")


def test_a_run_folders_files_are_served_as_images_text_or_downloads(port, ws):
    folder = ws / "runs" / "files"
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "page.html").write_text("<script>alert(1)</script>")
    (folder / "loss.png").write_bytes(b"\x89PNG")
    html, png = (http_head(port, f"/files/files/{name}") for name in ("page.html", "loss.png"))
    assert html["content-type"] == "application/octet-stream" and "attachment" in html["content-disposition"]
    assert png["content-type"] == "image/png" and "content-disposition" not in png
    assert html["x-content-type-options"] == "nosniff" and "frame-ancestors 'none'" in html["content-security-policy"]


def http_head(port, path):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    conn.request("GET", path)
    answer = conn.getresponse()
    answer.read()
    conn.close()
    assert answer.status == 200, answer.status
    return {k.lower(): v for k, v in answer.getheaders()}


def test_the_token_is_asked_for_then_carried_by_a_cookie(ws):
    with served(create_app(Roots(ws / "runs", (ws / "data",)), token="s3cret", schedule=False, lanes=[None])) as p:
        assert request(p, "/api/runs")[0] == 401
        assert request(p, "/api/runs", headers={"authorization": "Bearer wrong"})[0] == 401
        assert request(p, "/api/runs", headers={"authorization": "Bearer s3cret"})[0] == 200
        assert request(p, "/?token=s3cret")[0] == 303  # to the page without the token, which a cookie now holds
        assert request(p, "/api/runs", headers={"cookie": "squareq_ui_token=s3cret"})[0] == 200
