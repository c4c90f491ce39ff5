"""`specserve up` stops gracefully: SIGTERM mid-stream lets the stream finish, refuses new work
with 503 + Retry-After, tears down and exits 0 without a fatal-signal stack dump.

Runs the real command in a subprocess on the tiny family (a config with explicit model paths,
so no demo family is built), with its own Ray token file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from models.rendezvous import free_port

pytestmark = [pytest.mark.ray, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = 600


def _config(tmp_path: Path, family: dict, port: int, direct: bool) -> Path:
    launcher = {"http_port": port, "metrics_port": None}
    if direct:      # as make run serves: the API from the ingress replica, the proxy beside it
        launcher.update(direct_ingress=True, proxy_port=free_port())
    cfg = {"launcher": launcher,
           "app": {"model_name": "tiny",
                   "target": {"model": str(family["target"]), "draft": str(family["draft"]),
                              "num_cpus_per_rank": 0.5, "kv_budget_bytes": 8 << 20},
                   "auth": {"require_key": False}, "stats": {"period_s": 0.5}}}
    path = tmp_path / "up.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _descendants(pid: int, marker: str) -> list[int]:
    """The processes under `pid` whose command line holds `marker` (read from /proc)."""
    parents, cmds = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1]
                                               .split()[1])
                cmds[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            except (OSError, IndexError, ValueError):
                continue

    def under(p: int) -> bool:
        while p > 1:
            p = parents.get(p, 0)
            if p == pid:
                return True
        return False
    return [p for p, cmd in cmds.items() if marker.encode() in cmd and under(p)]


def _wait_for(path: Path, text: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while text not in path.read_text():
        if proc.poll() is not None or time.time() > deadline:
            raise AssertionError(f"no {text!r} (rc {proc.poll()}):\n{path.read_text()[-3000:]}")
        time.sleep(0.5)


@pytest.mark.parametrize("exported,direct", [(None, False), ("1", True)],
                         ids=["serve-defaults-proxy", "mode-exported-direct"])
def test_sigterm_drains_the_stream_and_exits_0(long_family, tmp_path, exported, direct):
    """`exported`: the user exported RAY_SERVE_THROUGHPUT_OPTIMIZED=1, so `specserve up`'s own
    process runs Serve's handles in that mode too (their router on the caller's event loop,
    which refuses plain `.result()` calls: a drain made of them would be skipped). `direct`:
    the API port is served by the ingress replica (direct ingress, as local.yaml has it), so
    the drain's refusals and the stream's last bytes come from that replica's own server."""
    port = free_port()
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_TOKEN_PATH": str(tmp_path / "token")}
    env.pop("RAY_SERVE_THROUGHPUT_OPTIMIZED", None)
    env.pop("RAY_worker_niceness", None)
    if exported:
        env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] = exported
    cmd = [sys.executable, "-m", "cluster", "up", "--config", str(_config(tmp_path, long_family,
           port, direct)), "--num-cpus", "4", "--no-dashboard", "--drain-timeout", "60"]
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=stdout, stderr=stderr)
    try:
        _wait_for(out, "specserve is up", proc, timeout_s=240)
        # the engine runs at the priority of any server, not at Ray's worker niceness 15
        engines = _descendants(proc.pid, "engine.engine_core")
        assert engines and all(os.getpriority(os.PRIO_PROCESS, p) == 0 for p in engines)
        url = f"http://127.0.0.1:{port}"
        events, started = [], threading.Event()

        def stream():
            body = {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": MAX_TOKENS,
                    "ignore_eos": True, "stream": True, "speculation": "off"}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(60), "the stream never started"
        proc.send_signal(signal.SIGTERM)
        _wait_for(out, "draining", proc, timeout_s=30)
        refused = httpx.post(url + "/v1/completions", timeout=30,
                             json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        reader.join(90)
        rc = proc.wait(90)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr_text = err.read_text()
    assert rc == 0, f"exit {rc}\n{out.read_text()[-2000:]}\n{stderr_text[-3000:]}"
    assert "Fatal Python error" not in stderr_text and "Traceback" not in stderr_text, \
        stderr_text[-3000:]
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "shutting_down"
    assert events and events[-1] == "[DONE]", events[-3:]
    final = json.loads(events[-2])
    assert final["choices"][0]["finish_reason"] == "length"
    assert final["usage"]["completion_tokens"] == MAX_TOKENS      # the stream was not cut
