"""`squareq ui` in a real browser: Debian's headless Chromium (/usr/bin/chromium, which `make test` installs with
apt-get) driven by Playwright, against the page served from this process and real `squareq train` processes on the
built-in tiny model. A run started from a terminal shows in the list, and a run started from the page (an uploaded
TOML, a dataset folder and an output name) queues behind it on this machine's one lane; the page run's loss curve
gains points and its first sample image appears; Stop leaves a checkpoint that Resume (`--resume latest`) continues to
the LoRA and losses of the terminal's unbroken run, bit for bit. The negative controls: a config with an unknown key
is refused by name and starts nothing; paths outside the runs folder are refused.

A tiny run's steps take a fraction of a second, so where the page must be looked at mid-run the test holds the run's
process (SIGSTOP) and lets it go (SIGCONT); a Stop sent while it is held is delivered when it goes on, as a Ctrl-C
pressed during a step is. The screenshot of the finished run goes to a temporary folder, or over docs/ui.png and
docs/ui-runs.png with SQUAREQ_UI_SCREENSHOT=1."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from playwright.sync_api import expect

from squareq.train.checkpoint import latest_checkpoint
from squareq.train.lora_reader import load_lora
from squareq.train.run_record import read_run_record
from squareq.train.tiny_dataset import write_tiny_dataset
from squareq.ui.app import create_app
from squareq.ui.paths import Roots

from ..train.tiny_run import w8_tiny_slab
from .serving import request, served

pytestmark = pytest.mark.usefixtures("torch_kernels")

CHROMIUM = Path(os.environ.get("SQUAREQ_CHROMIUM", "/usr/bin/chromium"))
# without the background-networking flags, Chromium's own connections are refused many at a time on CI's machine
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
DOCS = Path(__file__).resolve().parents[2] / "docs"
STEPS, SAMPLE_EVERY = 8, 4
CONFIG = f"""# the built-in tiny model at 64 px: a step is a fraction of a second on a CPU
resolution = 64
max_sequence_length = 16
steps = {STEPS}
lr = 3e-3
rank = 4
batch_size = 2
save_every = 0
sample_every = {SAMPLE_EVERY}
sample_prompts = ["a red square", "a blue circle"]
sample_steps = 2
"""
WAIT_MS = 60_000
SECRET = "a file beside the runs folder, not in it"


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("ui")
    w8_tiny_slab(root / "tiny.slab")
    write_tiny_dataset(root / "datasets" / "squares", count=4)
    (root / "runs").mkdir()
    (root / "secret.txt").write_text(SECRET)
    (root / "runs" / "escape").symlink_to(root, target_is_directory=True)  # a link that leads out
    (root / "tiny.toml").write_text(f'slab = "{root / "tiny.slab"}"\n' + CONFIG)
    (root / "bogus.toml").write_text(f'slab = "{root / "tiny.slab"}"\nbogus_key = 3\n' + CONFIG)
    return root


@pytest.fixture(scope="module")
def server(ws, torch_kernels):  # the jobs it starts take the environment as it is then
    app = create_app(Roots(ws / "runs", (ws / "datasets",)), lanes=[None], every=0.25)
    try:
        with served(app) as port:
            yield port, app.state.queue
    finally:
        for job in app.state.queue.jobs():  # the runs this test started, should it fail halfway
            if job["state"] == "running" and job["pid"]:
                _signal(job["pid"], signal.SIGKILL)


@pytest.fixture(scope="module")
def page(server):
    from playwright.sync_api import sync_playwright

    assert CHROMIUM.is_file(), f"{CHROMIUM} is missing; `make test` installs it (apt-get install chromium)"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(WAIT_MS)
        expect.set_options(timeout=WAIT_MS)
        page.goto(f"http://127.0.0.1:{server[0]}/?poll=150")  # the page asks every 0.15 s rather than 0.7
        yield page
        browser.close()


@pytest.fixture(scope="module")
def terminal(ws, torch_kernels):
    """`squareq train` as a person types it, into the runs folder the page watches."""
    log = open(ws / "terminal.log", "wb")
    process = subprocess.Popen([sys.executable, "-m", "squareq", "train", "--config", str(ws / "tiny.toml"),
                                "--data", str(ws / "datasets" / "squares"), "-o", str(ws / "runs" / "terminal")],
                               stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    yield process
    if process.poll() is None:
        process.kill()
    process.wait()
    log.close()


def _signal(pid, sig):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _until(check, what, timeout=60.0, every=0.01):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)
    return found


def _running_pid(folder: Path):
    record = read_run_record(folder)
    return record["pid"] if record and record["status"] == "running" else None


def _steps(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def _points(page) -> int:
    return int(page.get_attribute("#chart-loss svg", "data-points") or 0)


def test_a_terminal_run_shows_and_a_page_run_queues_behind_it(ws, terminal, server, page):
    pid = _until(lambda: _running_pid(ws / "runs" / "terminal"), "the terminal run's record")
    os.kill(pid, signal.SIGSTOP)  # held, so that it still holds the lane when the page's run is queued
    try:
        page.wait_for_selector('tr[data-run="terminal"][data-status="running"]')
        page.set_input_files("#upload", str(ws / "tiny.toml"))
        page.select_option("#data-root", "0")
        page.fill("#data", "squares")
        page.fill("#output", "page")
        page.click("#start")
        page.wait_for_selector('tr[data-run="page"][data-status="queued"]')
        time.sleep(0.6)  # a few of the queue's ticks: the lane is the terminal run's
        assert [j["state"] for j in server[1].jobs()] == ["queued"]
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_config_with_an_unknown_key_is_refused_by_name_and_starts_nothing(ws, server, page):
    page.set_input_files("#upload", str(ws / "bogus.toml"))
    page.fill("#output", "bogus")
    page.click("#start")
    expect(page.locator("#start-message")).to_contain_text("unknown key")
    message = page.text_content("#start-message")
    assert message.startswith("bogus.toml: unknown key bogus_key") and str(ws) not in message, message
    assert [j["run"] for j in server[1].jobs()] == ["page"]  # no job for it
    assert not (ws / "runs" / "bogus").exists() and not list((ws / "runs" / ".squareq-ui" / "jobs").glob("*/bogus*"))
    assert page.query_selector('tr[data-run="bogus"]') is None


def test_the_page_run_shows_its_loss_curve_growing_and_its_first_sample(ws, page, terminal):
    assert terminal.wait(timeout=120) == 0, (ws / "terminal.log").read_text()
    folder = ws / "runs" / "page"
    pid = _until(lambda: _running_pid(folder) if _steps(folder) else None, "the page run's first step")
    os.kill(pid, signal.SIGSTOP)
    page.goto(page.url.split("#")[0] + "#run/page")
    page.wait_for_function("() => Number(document.querySelector('#chart-loss svg')?.dataset.points) >= 1")
    before = _points(page)
    page.wait_for_function("() => [...document.querySelectorAll('#samples img')].some(i => i.naturalWidth > 0)")
    assert page.get_attribute("#samples tbody tr", "data-step") == "0"  # the base model's, drawn before step 1
    os.kill(pid, signal.SIGCONT)
    _until(lambda: len(_steps(folder)) > before, "a step more", every=0.002)
    os.kill(pid, signal.SIGSTOP)
    page.wait_for_function(f"() => Number(document.querySelector('#chart-loss svg').dataset.points) > {before}")
    assert len(_steps(folder)) < STEPS


def test_stop_leaves_a_checkpoint_that_resume_continues_bit_for_bit(ws, page, tmp_path):
    folder, pid = ws / "runs" / "page", _running_pid(ws / "runs" / "page")
    page.click("#stop")
    expect(page.locator("#action-message")).to_contain_text("SIGINT")
    os.kill(pid, signal.SIGCONT)  # the Ctrl-C arrives now, during a step
    expect(page.locator("#run-status")).to_have_text("stopped")
    stopped = _steps(folder)[-1]["step"]
    assert 0 < stopped < STEPS and latest_checkpoint(folder).name == f"step-{stopped:08d}"
    page.click("#resume")
    expect(page.locator("#action-message")).to_contain_text("resume queued")
    expect(page.locator("#run-status")).to_have_text("finished", timeout=120_000)
    rows = STEPS // SAMPLE_EVERY + 1  # the grid grew by a row each sample step, steps 0 to 8
    page.wait_for_function(f"() => document.querySelectorAll('#samples tbody tr').length === {rows}")
    for chart in ("loss", "lr", "host", "slots"):  # every step's figures, the resumed run's too
        expect(page.locator(f"#chart-{chart} svg")).to_have_attribute("data-points", str(STEPS))
    straight, resumed = _steps(ws / "runs" / "terminal"), _steps(folder)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    a, _ = load_lora(ws / "runs" / "terminal")
    b, _ = load_lora(folder)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    _screenshot(page, "ui.png", tmp_path)
    page.goto(page.url.split("#")[0] + "#")
    page.wait_for_selector('tr[data-run="terminal"][data-status="finished"]')
    page.wait_for_selector('tr[data-run="page"][data-status="finished"]')
    _screenshot(page, "ui-runs.png", tmp_path)


def _screenshot(page, name: str, tmp_path: Path) -> None:
    """docs/NAME with SQUAREQ_UI_SCREENSHOT=1, else a temporary file: the committed one changes only when asked."""
    shot = DOCS / name if os.environ.get("SQUAREQ_UI_SCREENSHOT") == "1" else tmp_path / name
    page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("path", ["/files/../secret.txt", "/files/%2e%2e/secret.txt", "/files/escape/secret.txt",
                                  "/files//etc/passwd", "/api/runs/../metrics", "/files/terminal/../../secret.txt"])
def test_a_path_outside_the_runs_folder_is_refused(server, path):
    status, body = request(server[0], path)
    assert status == 403 and SECRET not in str(body), (status, body)


def test_a_file_inside_the_runs_folder_is_served(server, ws, terminal):
    """The control of the refusals above: the same route serves a run's own file."""
    _until(lambda: (ws / "runs" / "terminal" / "config.toml").is_file(), "the terminal run's config.toml")
    status, body = request(server[0], "/files/terminal/config.toml")
    assert status == 200 and f'data = "{ws / "datasets" / "squares"}"' in body
