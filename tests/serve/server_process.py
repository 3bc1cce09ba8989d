"""A `dflash-serve` process in a test: a free loopback port, and a graceful stop that never leaves it running; and
an app served by uvicorn in a thread of the test process (`serve_in_thread`)."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen, timeout: float = 60) -> int:
    """SIGTERM (the graceful shutdown under test), then its exit code; killed if it does not exit in time."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def wait_ready(client, proc: subprocess.Popen, timeout: float = 300):
    """The server's model list once it answers (an `openai` client); fails naming the cause when the process ended
    or did not answer in time."""
    import openai

    deadline = time.time() + timeout
    while True:
        try:
            return client.models.list()
        except openai.APIConnectionError:
            assert proc.poll() is None, proc.stderr.read()
            assert time.time() < deadline, "dflash-serve did not start"
            time.sleep(0.5)


@contextlib.contextmanager
def serve_in_thread(app, timeout: float = 60):
    """Serves the ASGI `app` with uvicorn on a free loopback port in a daemon thread; yields its base URL, then
    asks it to exit and checks that it did."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + timeout
    while not srv.started:
        assert time.time() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(30)
    assert not thread.is_alive(), "the server did not shut down"
