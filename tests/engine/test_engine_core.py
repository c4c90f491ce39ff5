"""The engine in its own process (`ProcessEngine`): the same outputs as the in-process engine,
errors that keep their type across the pipe, a draft swapped between steps, and a core that
dies (or loses its replica) taken as dead, never as a hang or an orphan."""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine_core import ProcessEngine
from engine.errors import EngineDeadError
from engine.sampling_params import RequestOptions, SamplingParams

pytestmark = pytest.mark.timeout(300)     # a hang is a failure, never a stalled run

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _config(family, **kw) -> EngineConfig:
    return EngineConfig(str(family["target"]), str(family["draft"]), kv_budget_bytes=4 << 20,
                        profile=False, num_threads=1, max_model_len=256, **kw)


@pytest.fixture(scope="module")
def core(tiny_family):
    e = ProcessEngine(_config(tiny_family))
    yield e
    e.shutdown()


async def _collect(engine, rid, prompt, params=GREEDY, mode="speculative"):
    return [t async for o in engine.generate(rid, prompt, params, RequestOptions(mode, k_max=3))
            for t in o.token_ids]


def _run_mix(engine) -> list[list[int]]:
    prompts = [[5, 7, 9], [11, 13, 17, 19], list(range(20, 60)), [3] * 7]

    async def go():
        return await asyncio.gather(*[_collect(engine, f"m{i}-{m}", p, mode=m)
                                      for i, p in enumerate(prompts)
                                      for m in ("speculative", "baseline")])
    return asyncio.run(go())


def test_the_core_streams_what_the_in_process_engine_streams(core, tiny_family):
    here = AsyncEngine(_config(tiny_family))
    try:
        expected = _run_mix(here)
    finally:
        here.shutdown()
    got = _run_mix(core)
    assert got == expected and all(len(t) == 24 for t in got)
    assert core.pid != os.getpid() and core.is_alive
    stats = core.stats()
    assert stats.available and stats.num_running == 0 and stats.kv_used_target_bytes == 0
    assert core.metrics().num_emitted_tokens >= 8 * 24


def test_a_refused_request_keeps_its_error_type_across_the_pipe(core):
    from engine.errors import PromptTooLongError

    with pytest.raises(PromptTooLongError, match="at most 255") as info:
        asyncio.run(_collect(core, "long", [5] * 300))
    assert info.value.limit == 255 and core.is_alive
    with pytest.raises(ValueError, match="not 'step'"):
        core._call("call", "step", ())          # the replica may not drive the loop itself


def test_a_draft_swapped_in_the_core_serves_on_losslessly(core, tiny_family, tmp_path):
    import shutil

    baseline = asyncio.run(_collect(core, "b0", [5, 7, 9], mode="baseline"))
    copy = tmp_path / "draft-copy"
    shutil.copytree(tiny_family["draft"], copy)
    core.swap_draft(str(copy))
    assert core.draft_path == str(copy.resolve())
    assert asyncio.run(_collect(core, "s1", [5, 7, 9])) == baseline
    with pytest.raises(ValueError, match="KV shape"):
        core.swap_draft(str(tiny_family["small"]))
    assert core.is_alive and core.draft_path == str(copy.resolve())


def test_a_killed_core_fails_its_streams_and_reports_itself_dead(tiny_family):
    engine = ProcessEngine(_config(tiny_family))
    try:
        assert engine.stats().available

        async def go():
            gen = engine.generate("k", [5, 7, 9], SamplingParams(temperature=0, max_tokens=200,
                                  ignore_eos=True), RequestOptions("speculative", k_max=3))
            await gen.__anext__()
            os.kill(engine.pid, signal.SIGKILL)
            async for _ in gen:
                pass
        with pytest.raises(EngineDeadError):
            asyncio.run(go())
        assert not engine.is_alive
        assert engine.stats().available is False        # least-loaded routing skips it
        with pytest.raises(EngineDeadError):
            asyncio.run(_collect(engine, "after", [5, 7]))
    finally:
        engine.shutdown()


def test_a_crashed_step_loop_fails_its_streams(tiny_family):
    engine = ProcessEngine(_config(tiny_family, fault_injection=True))
    try:
        engine.inject_fault("engine_crash", after=2)
        with pytest.raises(EngineDeadError, match="injected fault"):
            asyncio.run(_collect(engine, "c", [5, 7, 9]))
        assert not engine.is_alive
        # Never asked for stats while alive: still reports itself, unavailable and empty.
        dead = engine.stats()
        assert dead.available is False and dead.num_running == 0 and dead.kv_budget_bytes > 0
        engine.process.wait(timeout=30)                  # the core exits after reporting
    finally:
        engine.shutdown()


def test_a_bad_checkpoint_fails_the_start_with_the_engines_error(tiny_family, tmp_path):
    with pytest.raises(Exception, match=str(tmp_path)):
        ProcessEngine(EngineConfig(str(tmp_path), None, profile=False, num_threads=1))


def test_the_core_exits_when_its_replica_dies(tiny_family, tmp_path):
    """The replica killed outright (Serve's kill, the OOM killer): the core reads end-of-file
    and exits, and no orphan keeps the model's memory."""
    script = tmp_path / "replica.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, time
        sys.path[:0] = {[str(p) for p in sys.path if p]!r}
        from engine.config import EngineConfig
        from engine.engine_core import ProcessEngine
        e = ProcessEngine(EngineConfig({str(tiny_family["target"])!r}, None, profile=False,
                                       num_threads=1, kv_budget_bytes=1 << 20))
        print(e.pid, flush=True)
        time.sleep(600)
    """))
    replica = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        core_pid = int(replica.stdout.readline())
        os.kill(core_pid, 0)                             # running
        replica.kill()
        replica.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _running(core_pid):
            time.sleep(0.1)
        assert not _running(core_pid), "the engine core outlived its replica"
    finally:
        replica.kill()


def _running(pid: int) -> bool:
    """True while `pid` runs (a zombie, exited but not yet reaped by init, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
