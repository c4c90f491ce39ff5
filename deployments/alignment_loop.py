"""The closed alignment loop: a draft that follows the traffic without an operator.

One replica (`alignment.enabled` in the app config; router/alignment_config.py) looks every
`period_s` at what the ingress measured per draft and prompt class (router/draft_live.py) and
acts by the rules of router/alignment.py. Its states:

  state      | what it watches                              | then
  -----------|----------------------------------------------|-----------------------------------
  idle       | the serving draft's acceptance per class over | `trigger` says distil: a round
             | its last `min_requests` requests, how long    | starts (-> distilling)
             | each class has stayed below, captured prompts |
  distilling | the round's process (`specserve draft         | `round_verdict`: failed, kept the
             | distill` on the capture buffer, replay and    | given draft, or refused by the swap
             | guard prompts, lowest CPU priority)           | guard: rolled back -> idle; else
             |                                              | canary
  canary     | the candidate serves `canary_share` of the    | `judge_canary`: promote (every
             | time in alternating windows; both drafts'     | replica, -> watching) or roll back
             | figures since the canary began                | (-> idle); no verdict by
             |                                              | canary_timeout_s: roll back
  watching   | the promoted draft's figures since promotion | `watch_promoted` rolls back (the
             |                                              | previous draft) -> idle; watch_s
             |                                              | over: kept -> idle

An operator can canary a draft of their own (`specserve draft canary DIR`): the same canary,
promote and roll back, with trigger `operator`. Every step is a record in
`alignment.dir/history.jsonl` (`specserve draft history`). The canary runs on every target
replica in alternating windows rather than on one replica, so it works with one replica and
compares the drafts on the same traffic; attribution is exact, since each request reports the
draft it ran with and one that saw a swap counts for neither.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from ray import serve

from models.distill_report import guard
from router.alignment import ClassLive, judge_canary, trigger, watch_promoted
from router.capture import captured_counts
from router.config import AppConfig
from router.draft_live import from_dict
from router.wire import TierError

logger = logging.getLogger("ray.serve")
HISTORY = "history.jsonl"
CYCLE_S = 2.0           # a throttled round runs cpu_share of each cycle, stopped the rest


def read_history(folder: str | Path) -> list[dict]:
    path = Path(folder).expanduser() / HISTORY
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _figures(classes: dict[str, ClassLive]) -> dict:
    return {name: {"acceptance": round(c.acceptance, 4), "requests": c.requests,
                   "goodput": None if c.goodput is None else round(c.goodput, 2)}
            for name, c in sorted(classes.items())}


# looked up here, not in the forked child: dlopen there could wait on a lock another thread held
_PRCTL = ctypes.CDLL(None).prctl if sys.platform.startswith("linux") else None


GROUP_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                   "LOCAL_WORLD_SIZE")


def round_env(threads: int) -> dict[str, str]:
    """The round's environment: this process's, with `threads` OpenMP threads and without a
    process group's rank variables. A round is a DeepSpeed group of one of its own; the port a
    distillation in this process once took (models/distill.py: init_deepspeed) is still held
    here, and a round that inherited it could not listen on it."""
    env = {k: v for k, v in os.environ.items() if k not in GROUP_VARIABLES}
    return {**env, "OMP_NUM_THREADS": str(threads)}


def _round_child(niceness: int) -> None:
    """In the round's process before it runs: lower its priority, and have the kernel kill it
    when the loop's process dies (a round stopped by the throttle would otherwise stay stopped,
    holding its memory, with no one to resume it)."""
    os.nice(niceness)
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)                           # PR_SET_PDEATHSIG


async def throttle(pgid: int, share: float, cycle_s: float = CYCLE_S) -> None:
    """Let process group `pgid` run `share` of each `cycle_s` and stop it (SIGSTOP) the rest,
    until the group is gone or this task is cancelled; the group is left running. On shared CPU
    cores a niced process still takes the cycles serving leaves and slows it; a stopped one
    takes none (docs/decisions/0033-alignment-loop.md)."""
    try:
        while True:
            await asyncio.sleep(share * cycle_s)
            os.killpg(pgid, signal.SIGSTOP)
            try:
                await asyncio.sleep((1 - share) * cycle_s)
            finally:
                os.killpg(pgid, signal.SIGCONT)
    except ProcessLookupError:
        return


def round_verdict(returncode: int, report: dict, problems: list[str]) -> dict | None:
    """Why a finished round's draft goes no further (None: on to the canary): the round failed;
    its training kept the draft it was given (no validation step beat it within the guard's
    drops: nothing to canary); or the swap's guard refuses its held-out figures (`problems`)."""
    if returncode != 0:
        return {"reason": "round_failed"}
    if report.get("train", {}).get("kept_step") == 0:
        return {"reason": "round_no_gain"}
    if problems:
        return {"reason": "guard_refused", "problems": problems}
    return None


class Loop:
    """The loop's state and actions, apart from Serve (the deployment below wraps it)."""

    def __init__(self, cfg: AppConfig, app_name: str, target, ingress=None):
        self.section = cfg.alignment
        self.rules = cfg.alignment.rules
        self.target_model = cfg.target.model
        self.capture_dir = cfg.capture.dir
        self.app_name = app_name
        self.target = target                  # the TargetServer handle
        self._ingress = ingress
        self.dir = Path(self.section.dir).expanduser()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.state = "idle"
        self.serving: str | None = None       # the draft every replica serves outside a canary
        self.first_below: dict[str, float] = {}
        self.round = sum(r["event"] == "trigger" for r in read_history(self.dir))
        self.proc = None
        self.throttling: asyncio.Task | None = None
        self.focus: str | None = None         # the class the round is asked to lift
        self.candidate: str | None = None
        self.since = 0.0                      # the canary's or the promotion's start
        self.on_candidate = False
        self.window_end = 0.0
        self.promoted: dict | None = None     # {"previous", "at": {class: acceptance}}
        self.started = 0.0                    # the round's start

    # -- records ------------------------------------------------------------------------------
    def record(self, event: str, **fields) -> dict:
        rec = {"time": round(time.time(), 3), "event": event, "round": self.round, **fields}
        with (self.dir / HISTORY).open("a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
        logger.info("alignment: %s", rec)
        return rec

    def status(self) -> dict:
        return {"state": self.state, "serving": self.serving, "candidate": self.candidate,
                "round": self.round, "on_candidate": self.on_candidate,
                "history": read_history(self.dir)[-20:]}

    # -- the replicas ------------------------------------------------------------------------
    def ingress(self):
        if self._ingress is None:
            self._ingress = serve.get_deployment_handle("Ingress", app_name=self.app_name)
        return self._ingress

    async def figures(self, since: float = 0.0, last: int | None = None) -> dict:
        out = await self.ingress().draft_figures.remote(since, last)
        return from_dict(out["drafts"])

    def _replicas(self) -> int:
        status = serve.status().applications[self.app_name].deployments["TargetServer"]
        return max(1, status.replica_states.get("RUNNING", 1))

    async def swap_all(self, path: str) -> None:
        """Every target replica serves `path` (the handle picks a replica per call)."""
        replicas, done = self._replicas(), set()
        for _ in range(20 * replicas):
            if len(done) >= replicas:
                return
            out = await self.target.swap_draft.remote(path)
            done.add(out["pid"])
        logger.warning("alignment: %d of %d replicas answered the swap to %s", len(done),
                       replicas, path)

    async def serving_draft(self) -> str:
        return (await self.target.draft.remote())["draft"]

    # -- one look -----------------------------------------------------------------------------
    async def tick(self, now: float) -> None:
        if self.serving is None:
            self.serving = await self.serving_draft()
        await {"idle": self._idle, "distilling": self._distilling, "canary": self._canary,
               "watching": self._watching}[self.state](now)

    async def _idle(self, now: float) -> None:
        live = (await self.figures(last=self.rules.min_requests)).get(self.serving, {})
        for name, c in live.items():
            if c.requests >= self.rules.min_requests and c.acceptance < self.rules.threshold:
                self.first_below.setdefault(name, now)
            else:
                self.first_below.pop(name, None)
        live = {name: ClassLive(c.acceptance, c.requests, c.goodput,
                                now - self.first_below[name] if name in self.first_below else None)
                for name, c in live.items()}
        captured = captured_counts(self.capture_dir)
        decision = trigger(self.rules, live, captured, round_running=False)
        if decision.action != "distil":
            return
        self.round += 1
        name = decision.prompt_class
        self.record("trigger", reason=decision.reason, prompt_class=name,
                    live=_figures(live), captured=captured)
        self.focus = name
        await self._start_round()

    def round_command(self, out: Path) -> list[str]:
        """`specserve draft distill` for a round into `out`: a throttled round's minutes of
        compute are minutes / cpu_share of wall time."""
        r = self.section.round
        return [sys.executable, "-m", "cluster", "draft", "distill", "--target",
                self.target_model, "--draft", self.serving, "--from-buffer",
                str(Path(self.capture_dir).expanduser()), "--out", str(out), "--threads",
                str(r.threads), "--temperature", r.temperature, "--replay", str(r.replay),
                "--replay-drop", str(r.replay_drop),
                "--new-tokens", str(r.new_tokens), "--validation", str(r.validation),
                *(["--steps", str(r.steps)] if r.steps
                  else ["--minutes", str(round(r.minutes / r.cpu_share, 3))]),
                *(["--max-prompts", str(r.max_prompts)] if r.max_prompts else []),
                *(["--focus", self.focus] if self.focus else []),
                *(["--guard-prompts", r.guard_prompts] if r.guard_prompts else []),
                *r.extra_args]

    async def _start_round(self) -> None:
        r = self.section.round
        out = self.dir / f"round-{self.round:03d}"
        out.mkdir(parents=True, exist_ok=True)
        cmd = self.round_command(out)
        env = round_env(r.threads)
        log = (out / "round.log").open("ab")
        self.proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=log, stderr=asyncio.subprocess.STDOUT, env=env, start_new_session=True,
            preexec_fn=lambda: _round_child(r.niceness))
        log.close()
        if r.cpu_share < 1:
            self.throttling = asyncio.get_running_loop().create_task(
                throttle(self.proc.pid, r.cpu_share, CYCLE_S))
        self.candidate, self.state = str(out), "distilling"
        self.started = time.time()

    async def _distilling(self, now: float) -> None:
        if self.proc.returncode is None:
            return
        rc, self.proc = self.proc.returncode, None
        if self.throttling is not None:
            self.throttling.cancel()
            self.throttling = None
        report_file = Path(self.candidate) / "distill.json"
        report = json.loads(report_file.read_text()) if report_file.exists() else {}
        self.record("round", draft=self.candidate, returncode=rc,
                    heldout_delta=report.get("heldout", {}).get("delta"),
                    kept_step=report.get("train", {}).get("kept_step"),
                    seconds=round(now - self.started, 1))
        self.first_below = {}       # a class must stay below for stay_below_s again first
        verdict = round_verdict(rc, report, guard(Path(self.candidate)) if rc == 0 else [])
        if verdict:
            self.record("rollback", draft=self.candidate, **verdict)
            self.candidate, self.state = None, "idle"
            return
        self.begin_canary(now)

    def begin_canary(self, now: float) -> None:
        self.record("canary", draft=self.candidate, serving=self.serving,
                    share=self.section.canary_share)
        self.state, self.since = "canary", now
        self.on_candidate, self.window_end = False, now     # the first window: the candidate

    async def canary(self, path: str, force: bool = False) -> dict:
        """An operator's candidate: canaried like a round's (refused while the loop is busy)."""
        if self.state != "idle":
            raise TierError(409, f"the alignment loop is {self.state}; try when it is idle")
        folder = Path(path).expanduser().resolve()
        if not (folder / "config.json").is_file():     # force skips the guard, not this
            raise TierError(400, f"{folder} is not a checkpoint folder (no config.json)")
        problems = [] if force else guard(folder)
        if problems:
            raise TierError(400, "refused by the swap guard (force to override): "
                            + "; ".join(problems))
        if self.serving is None:
            self.serving = await self.serving_draft()
        self.round += 1
        self.record("trigger", reason="operator", draft=str(folder))
        self.candidate = str(folder)
        self.begin_canary(time.time())
        return self.status()

    async def _canary(self, now: float) -> None:
        share = self.section.canary_share
        if now >= self.window_end:            # the next window, on the other draft
            self.on_candidate = not self.on_candidate
            await self.swap_all(self.candidate if self.on_candidate else self.serving)
            span = self.section.canary_window_s * (share / (1 - share) if self.on_candidate
                                                     else 1.0)
            self.window_end = time.time() + span
        drafts = await self.figures(since=self.since)
        canary, rest = drafts.get(self.candidate, {}), drafts.get(self.serving, {})
        decision = judge_canary(self.rules, canary, rest)
        if decision.action == "wait" and now - self.since < self.section.canary_timeout_s:
            return
        reason = decision.reason if decision.action != "wait" else "canary_timeout"
        figures = {"canary": _figures(canary), "rest": _figures(rest)}
        if decision.action == "promote":
            await self.swap_all(self.candidate)
            self.record("promote", reason=reason, prompt_class=decision.prompt_class,
                        draft=self.candidate, previous=self.serving, **figures)
            self.promoted = {"previous": self.serving,
                             "at": {n: c.acceptance for n, c in canary.items()}}
            self.serving, self.since, self.state = self.candidate, time.time(), "watching"
            await self.ingress().draft_swapped.remote()
        else:
            await self.swap_all(self.serving)
            self.record("rollback", reason=reason, prompt_class=decision.prompt_class,
                        draft=self.candidate, serving=self.serving, **figures)
            self.state = "idle"
        self.candidate, self.on_candidate = None, False

    async def _watching(self, now: float) -> None:
        live = (await self.figures(since=self.since)).get(self.serving, {})
        decision = watch_promoted(self.rules, self.promoted["at"], live)
        if decision.action == "rollback":
            previous = self.promoted["previous"]
            await self.swap_all(previous)
            self.record("rollback", reason=decision.reason, prompt_class=decision.prompt_class,
                        draft=self.serving, serving=previous, live=_figures(live))
            self.serving = previous
            await self.ingress().draft_swapped.remote()
        elif now - self.since >= self.section.watch_s:
            self.record("kept", reason="watch_over", draft=self.serving, live=_figures(live))
        else:
            return
        self.promoted, self.state, self.first_below = None, "idle", {}


@serve.deployment(name="AlignmentLoop", num_replicas=1, health_check_period_s=2.0,
                  max_ongoing_requests=8)
class AlignmentLoopDeployment:
    """The loop in its own actor; it starts looking at the first health check."""

    def __init__(self, cfg: AppConfig | dict, app_name: str, target):
        cfg = cfg if isinstance(cfg, AppConfig) else AppConfig.model_validate(cfg)
        self.loop = Loop(cfg, app_name, target)
        self._task: asyncio.Task | None = None

    async def check_health(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await self.loop.tick(time.time())
            except Exception:               # a failed look never stops the loop
                logger.exception("alignment loop: a look failed")
            await asyncio.sleep(self.loop.section.period_s)

    async def status(self) -> dict:
        return self.loop.status()

    async def canary(self, path: str, force: bool = False) -> dict:
        return await self.loop.canary(path, force)
