"""A `dflash-serve` process in a test: a free loopback port, and a graceful stop that never leaves it running."""

from __future__ import annotations

import signal
import socket
import subprocess
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
