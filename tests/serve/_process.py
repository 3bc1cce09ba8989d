"""A `dflash-serve` process in a test: a free loopback port, and a graceful stop that never leaves it running."""

from __future__ import annotations

import signal
import socket
import subprocess


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
