"""The web application of ``squareq ui`` (Starlette): the page and its script, a JSON view of the runs folder, the run
files it may serve, and the start, stop and resume actions. Every path of a request goes through ui/paths.py; with a
token, every request must carry it (an ``Authorization: Bearer`` header, or the cookie that opening the page with
``?token=`` sets); an action must be a JSON POST from the page's own origin, so another site's form cannot start a
run in a local browser."""
from __future__ import annotations

import hmac
import socket
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from . import runs as run_files
from .paths import Roots, UiError, inside, is_local
from .queue import Queue, Scheduler, gpu_lanes
from .runs import pid_alive, run_folders, tail_lines
from .start import resume, start, start_options

STATIC = Path(__file__).resolve().parent / "static"
COOKIE = "squareq_ui_token"
# what a run folder's files are served as; anything else is a download, never a page of this origin
SERVED_TYPES = {".png": "image/png", ".webp": "image/webp", ".gif": "image/gif", ".jpg": "image/jpeg",
                ".toml": "text/plain; charset=utf-8", ".log": "text/plain; charset=utf-8",
                ".jsonl": "text/plain; charset=utf-8", ".txt": "text/plain; charset=utf-8", ".json": "application/json"}
# the page's own script and style only, and no other site may frame it (a click there must not press Stop here)
SECURITY_HEADERS = {"content-security-policy": "default-src 'self'; frame-ancestors 'none'",
                    "x-content-type-options": "nosniff", "x-frame-options": "DENY"}


class Guard(BaseHTTPMiddleware):
    """The token, when the server has one, and same-origin JSON for every action."""

    def __init__(self, app, token: str | None) -> None:
        super().__init__(app)
        self.token = token

    async def dispatch(self, request: Request, call_next) -> Response:
        if self.token:
            query = request.query_params.get("token")
            given = request.headers.get("authorization", "").removeprefix("Bearer ").strip() or \
                request.cookies.get(COOKIE) or query or ""
            if not hmac.compare_digest(given.encode(), self.token.encode()):
                return JSONResponse({"error": "this page needs the token squareq ui was started with: open it as "
                                              "http://HOST:PORT/?token=TOKEN."}, status_code=401)
            if query:  # once: the cookie carries it from now on, and the address bar no longer shows it
                answer = RedirectResponse(request.url.remove_query_params("token"), status_code=303)
                answer.set_cookie(COOKIE, self.token, httponly=True, samesite="strict")
                return answer
        if request.method not in ("GET", "HEAD"):
            origin = request.headers.get("origin")
            if request.headers.get("content-type", "").split(";")[0] != "application/json" or \
                    origin and urlsplit(origin).netloc != request.headers.get("host"):
                return JSONResponse({"error": "actions are JSON requests from the page itself."}, status_code=403)
        answer = await call_next(request)
        answer.headers.update(SECURITY_HEADERS)
        return answer


def _ui_error(request: Request, exc: UiError) -> JSONResponse:
    return JSONResponse({"error": str(exc)}, status_code=exc.status)


def _job_row(queue: Queue, job: dict) -> dict:
    """A job whose run folder does not show it yet (queued, starting, or failed before writing anything)."""
    state = {"queued": "queued", "running": "starting"}.get(job["state"], "failed")  # runs_list leaves cancelled out
    last = tail_lines(queue.log_path(job), 1)
    return {"name": job["run"], "status": state, "message": last[0] if state == "failed" and last else None,
            "job": job, "step": 0, "total": None, "eta_s": None, "config": None, "resumable": False,
            "log_url": f"/files/{queue.roots.state.name}/logs/{job['id']}.log"}


def runs_list(roots: Roots, queue: Queue) -> list[dict]:
    """Every run folder, and the page's jobs that have none yet; a queued or starting job shows over its folder."""
    jobs = {j["run"]: j for j in queue.jobs()}  # the newest job of each run
    rows = []
    for folder in run_folders(roots.runs):
        row = run_files.summary(folder)
        job = jobs.pop(folder.name, None)
        if job is not None:
            row["job"] = job
            # started, and not yet past writing its record: its folder still says how the run before it ended
            if job["state"] == "queued" or job["state"] == "running" and row["status"] != "running" and \
                    queue.holds(job) and pid_alive(job["pid"], job["started_at"]):
                row.update(status="queued" if job["state"] == "queued" else "starting", resumable=False)
        rows.append(row)
    rows += [_job_row(queue, job) for job in jobs.values() if job["state"] != "cancelled"]
    return rows


def _middleware(token: str | None, host: str) -> list[Middleware]:
    """The token and origin checks; on a local bind, local host names only, so a rebound DNS name cannot reach it."""
    middleware = [Middleware(Guard, token=token)]
    if is_local(host):
        named = f"[{host}]" if ":" in host else host  # an IPv6 address, as a Host header writes it
        allowed = ["127.0.0.1", "localhost", "[::1]", named]
        middleware.insert(0, Middleware(TrustedHostMiddleware, allowed_hosts=allowed))
    return middleware


def create_app(roots: Roots, token: str | None = None, host: str = "127.0.0.1", schedule: bool = True,
               lanes: list[str | None] | None = None, every: float = 0.5) -> Starlette:
    """The application serving ``roots``; with ``schedule``, a thread that starts queued jobs while it runs."""
    roots.runs.mkdir(parents=True, exist_ok=True)
    queue = Queue(roots, gpu_lanes() if lanes is None else lanes)

    def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"cache-control": "no-store"})

    def api_runs(request: Request) -> JSONResponse:
        return JSONResponse({"runs": runs_list(roots, queue), "host": socket.gethostname(), "runs_folder":
                             str(roots.runs), "lanes": ["CPU" if lane is None else f"GPU {lane}" for lane in
                                                        queue.lanes]})

    def api_run(request: Request) -> JSONResponse:
        folder = _run_folder(request)
        detail = run_files.detail(folder)
        detail["job"] = next((j for j in reversed(queue.jobs()) if j["run"] == folder.name), None)
        return JSONResponse(detail)

    def api_metrics(request: Request) -> JSONResponse:
        since = request.query_params.get("since", "0")
        if not since.isdigit():
            raise UiError(f"since={since!r} is not a step number.")
        return JSONResponse(run_files.metrics(_run_folder(request), int(since)))

    def _run_folder(request: Request) -> Path:
        folder = roots.run(request.path_params["name"])
        if not folder.is_dir():
            raise UiError(f"there is no run {request.path_params['name']!r} in {roots.runs}.")
        return folder

    async def api_start(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise UiError("a start request is a JSON object; use the page's form.")
        return JSONResponse({"job": await run_in_threadpool(start, roots, queue, body)})

    def api_stop(request: Request) -> JSONResponse:
        return JSONResponse({"done": queue.stop(roots.run(request.path_params["name"]).name)})

    def api_resume(request: Request) -> JSONResponse:
        return JSONResponse({"job": resume(roots, queue, request.path_params["name"])})

    def files(request: Request) -> Response:
        path = inside(roots.runs, request.path_params["path"], "file")
        if not path.is_file():
            raise UiError(f"{request.path_params['path']} is not a file of the runs folder.")
        kind = SERVED_TYPES.get(path.suffix.lower())
        return FileResponse(path, media_type=kind or "application/octet-stream", headers={"cache-control": "no-cache"},
                            filename=None if kind else path.name)

    @asynccontextmanager
    async def lifespan(app):
        scheduler = Scheduler(queue, every).start() if schedule else None
        yield
        if scheduler is not None:
            scheduler.close()

    routes = [Route("/", index), Route("/api/runs", api_runs), Route("/api/runs/{name}", api_run),
              Route("/api/runs/{name}/metrics", api_metrics),
              Route("/api/start", lambda request: JSONResponse(start_options(roots))),
              Route("/api/start", api_start, methods=["POST"]),
              Route("/api/runs/{name}/stop", api_stop, methods=["POST"]),
              Route("/api/runs/{name}/resume", api_resume, methods=["POST"]),
              Route("/files/{path:path}", files), Mount("/static", StaticFiles(directory=STATIC))]
    app = Starlette(routes=routes, middleware=_middleware(token, host), exception_handlers={UiError: _ui_error},
                    lifespan=lifespan)
    app.state.queue = queue
    return app
