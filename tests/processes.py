"""Helpers for tests that start several trainer processes on 127.0.0.1 (jax.distributed)."""

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_all(procs, timeout: float) -> list[int]:
    """Waits for every (Popen, log file) pair, killing what is still running after `timeout`
    (a hung peer must not hang the suite); closes the logs; returns the exit statuses."""
    try:
        for p, _ in procs:
            p.wait(timeout=timeout)
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    return [p.returncode for p, _ in procs]
