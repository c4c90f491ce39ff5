"""The alignment loop's state after a round ends (deployments/alignment_loop.py), without Ray."""

import asyncio
import json
import os
import sys
import time
import types
from pathlib import Path

from deployments import alignment_loop
from deployments.alignment_loop import Loop, read_history, round_verdict
from router.config import AppConfig


def _loop(tmp_path, **round_) -> Loop:
    cfg = AppConfig.model_validate({
        "target": {"model": str(tmp_path / "target"), "draft": str(tmp_path / "draft")},
        "alignment": {"enabled": True, "dir": str(tmp_path / "alignment"), "round": round_},
        "capture": {"dir": str(tmp_path / "capture")}})
    return Loop(cfg, "specserve", target=None, ingress=None)


def test_a_round_that_ends_makes_a_class_stay_below_again_before_the_next(tmp_path):
    """A failed or refused round leaves the serving draft as it was; the class that asked for
    it must then stay below the threshold for `stay_below_s` again, not start the next round
    at the next look (which would distil the same prompts over and over)."""
    for make_report in (False, True):
        loop = _loop(tmp_path / str(make_report))
        out = tmp_path / str(make_report) / "round-001"
        out.mkdir(parents=True)
        if make_report:             # a report the guard refuses: code lost ground
            (out / "distill.json").write_text('{"heldout": {"before": {"code": {"acceptance": '
                                              '0.8}}, "after": {"code": {"acceptance": 0.7}}}}')
        loop.state, loop.candidate, loop.round = "distilling", str(out), 1
        loop.proc = types.SimpleNamespace(returncode=0 if make_report else 1)
        loop.first_below = {"creative": 0.0}
        asyncio.run(loop._distilling(100.0))
        assert loop.state == "idle" and loop.candidate is None and loop.first_below == {}
        reasons = [r.get("reason") for r in read_history(loop.dir)]
        assert reasons == [None, "guard_refused" if make_report else "round_failed"]


def test_a_round_goes_to_the_canary_only_with_a_gain_the_guard_takes():
    """A failed round, one whose training kept the draft it was given (canarying it would
    only cost the window), and one the swap guard refuses each end at the round."""
    ok = {"train": {"kept_step": 120}}
    assert round_verdict(0, ok, []) is None
    assert round_verdict(1, ok, []) == {"reason": "round_failed"}
    assert round_verdict(0, {"train": {"kept_step": 0}}, []) == {"reason": "round_no_gain"}
    assert round_verdict(0, ok, ["class 'replay' fell"]) == {
        "reason": "guard_refused", "problems": ["class 'replay' fell"]}
    assert round_verdict(0, {}, []) is None          # a report from before kept_step: canary


def test_an_operator_canary_of_a_folder_that_is_no_checkpoint_is_refused(tmp_path):
    """`specserve draft canary DIR --force` skips the guard, not the check that DIR is a
    checkpoint: a missing folder would otherwise fail every window's swap until the timeout."""
    import pytest

    from router.wire import TierError

    loop = _loop(tmp_path)
    loop.serving = str(tmp_path / "draft")
    with pytest.raises(TierError, match="no config.json") as err:
        asyncio.run(loop.canary(str(tmp_path / "missing"), force=True))
    assert err.value.status == 400 and loop.state == "idle" and read_history(loop.dir) == []


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_throttled_round_runs_its_share_of_each_cycle_and_is_never_left_stopped(
        tmp_path, monkeypatch):
    """`round.cpu_share` below 1: the round's process runs in a process group of its own (the
    loop's is never stopped), is stopped the rest of each cycle, gets its minutes of compute as
    minutes / share of wall time, and runs again once the throttle ends. The round distils the
    newest captured prompts, half of them of the class that triggered it."""
    loop = _loop(tmp_path, cpu_share=0.25, minutes=10)
    loop.serving, loop.focus = str(tmp_path / "draft"), "creative"
    cmd = loop.round_command(tmp_path / "out")
    assert cmd[cmd.index("--minutes") + 1] == "40.0"
    assert cmd[cmd.index("--max-prompts") + 1] == "600" and cmd[cmd.index("--focus") + 1] == \
        "creative"                      # the class that triggered the round takes half
    from cluster.cli import build_parser           # every flag is one `draft distill` takes
    args = build_parser(cmd[3:]).parse_args(cmd[3:])
    assert (args.replay_drop, args.validation, args.replay) == (0.02, 0.15, 200)
    # cycles long against the event loop's jitter on a loaded machine (the spinning round
    # takes a core whenever it runs); the share stopped is measured in wall time, 4 cycles
    monkeypatch.setattr(alignment_loop, "CYCLE_S", 0.5)
    monkeypatch.setattr(loop, "round_command",
                        lambda out: [sys.executable, "-c", "while True: pass"])

    async def run() -> tuple[list[str], str]:
        await loop._start_round()
        pid = loop.proc.pid
        try:
            assert os.getpgid(pid) == pid != os.getpgid(0)
            states, seconds = [], []            # each state read and the time it stood for
            start = last = time.monotonic()
            while last - start < 4 * alignment_loop.CYCLE_S:
                await asyncio.sleep(0.01)
                states.append(_state(pid))
                now = time.monotonic()
                seconds.append(now - last)
                last = now
            while _state(pid) != "T":           # cancelled while the process is stopped
                await asyncio.sleep(0.005)
            loop.throttling.cancel()
            await asyncio.sleep(0.05)
            after = _state(pid)
        finally:
            loop.proc.kill()
            await loop.proc.wait()
        await loop._distilling(0.0)
        assert loop.throttling is None
        return states, seconds, after

    states, seconds, after = asyncio.run(run())
    stopped = sum(t for st, t in zip(states, seconds) if st == "T") / sum(seconds)
    assert 0.5 <= stopped <= 0.95, states
    assert after != "T"


def test_a_round_is_a_process_group_of_its_own(tmp_path, monkeypatch):
    """A distillation once run in the loop's process leaves its group's rank variables and a
    port it still listens on (models/distill.py: init_deepspeed); the round must not inherit
    them (it failed with EADDRINUSE), and runs with the round's thread count."""
    import socket

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    monkeypatch.setenv("MASTER_PORT", str(held.getsockname()[1]))
    monkeypatch.setenv("RANK", "0")
    loop = _loop(tmp_path, cpu_share=1.0, threads=3)
    loop.serving = str(tmp_path / "draft")
    seen = tmp_path / "env.json"
    monkeypatch.setattr(loop, "round_command", lambda out: [
        sys.executable, "-c", f"import json, os; open({str(seen)!r}, 'w').write(json.dumps(dict(os.environ)))"])

    async def run() -> None:
        await loop._start_round()
        await loop.proc.wait()

    try:
        asyncio.run(run())
    finally:
        held.close()
    env = json.loads(seen.read_text())
    assert "MASTER_PORT" not in env and "RANK" not in env
    assert env["OMP_NUM_THREADS"] == "3" and env["PATH"] == os.environ["PATH"]


def test_a_round_dies_with_the_loops_process(tmp_path):
    """A round outliving its loop (the replica killed) would run, or with the throttle stay
    stopped, with no one to read or resume it: the kernel kills it with its parent."""
    import subprocess
    import textwrap
    import time

    script = textwrap.dedent(f"""
        import asyncio, os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_alignment_loop_states import _loop
        loop = _loop(__import__("pathlib").Path({str(tmp_path)!r}), cpu_share=0.5)
        loop.serving = "draft"
        loop.round_command = lambda out: [sys.executable, "-c", "import time; time.sleep(60)"]
        async def main():
            await loop._start_round()
            print(loop.proc.pid, flush=True)
        asyncio.run(main())
        os._exit(0)
    """)
    parent = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, cwd=Path(__file__).parents[2])
    assert parent.returncode == 0, parent.stderr[-2000:]
    child = int(parent.stdout.split()[-1])
    deadline = time.time() + 10
    while Path(f"/proc/{child}").exists() and _state(child) != "Z" and time.time() < deadline:
        time.sleep(0.05)
    alive = Path(f"/proc/{child}").exists() and _state(child) != "Z"
    if alive:
        os.kill(child, 9)
    assert not alive
