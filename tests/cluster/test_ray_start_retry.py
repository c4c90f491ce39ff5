"""`ray_local.start_with_retry`: a Ray start that missed Ray's fixed wait is tried once more, after
what it left running is stopped; other errors and other processes are left alone."""

import subprocess
import sys

import psutil
import pytest

from cluster.launch import ray_local

TIMEOUT = "The current node timed out during startup. This could happen because ..."


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def test_a_timed_out_start_is_retried_after_its_processes_are_stopped():
    kept = _sleeper()                     # a child from before the start: not the start's
    left, calls, cleanups = [], [], []

    def start():
        calls.append(1)
        if len(calls) == 1:
            left.append(_sleeper())       # what a failed ray.init leaves (its GCS, say)
            raise Exception(TIMEOUT)
        return "context"

    try:
        assert ray_local.start_with_retry(start, cleanup=lambda: cleanups.append(1)) == "context"
        assert len(calls) == 2 and cleanups == [1]
        left[0].wait(timeout=10)          # stopped before the retry (reaped here, its parent)
        assert left[0].returncode is not None
        assert kept.poll() is None and psutil.pid_exists(kept.pid)
    finally:
        for proc in [kept, *left]:
            proc.kill()
            proc.wait()


def test_other_errors_and_a_second_timeout_are_raised():
    def broken():
        raise RuntimeError("port 6379 in use")

    with pytest.raises(RuntimeError, match="6379"):
        ray_local.start_with_retry(broken)
    calls = []

    def always_late():
        calls.append(1)
        raise Exception(TIMEOUT)

    with pytest.raises(Exception, match="timed out during startup"):
        ray_local.start_with_retry(always_late)
    assert len(calls) == 2
