"""A squareq ui application served by uvicorn in a thread of the test process, on a port of its own, and raw HTTP
requests to it (http.client sends a path as written, '..' included, where a browser would tidy it first)."""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from contextlib import contextmanager

import uvicorn


@contextmanager
def served(app):
    """``app`` on 127.0.0.1 at a free port until the block ends; yields the port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.02)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def request(port: int, path: str, body=None, headers: dict | None = None, method: str | None = None):
    """(status, parsed JSON or text) of one request; a ``body`` is sent as JSON."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    sent = dict(headers or {})
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        sent.setdefault("content-type", "application/json")
    conn.request(method or ("POST" if body is not None else "GET"), path, body=data, headers=sent)
    answer = conn.getresponse()
    text = answer.read().decode("utf-8", "replace")
    conn.close()
    try:
        return answer.status, json.loads(text)
    except ValueError:
        return answer.status, text
