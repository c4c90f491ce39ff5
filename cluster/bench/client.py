"""The load side of `specserve bench serve`: streamed OpenAI completions over HTTP, closed-loop
users and open-loop Poisson arrivals, and a sampler of the cluster's `/health` during a run.

A policy is an endpoint plus body fields, chosen through the public API only:
  standard        /standard/v1   baseline (no speculation)
  premium         /premium/v1    speculative, the engine's adaptive k (k <= k_max per step)
  auto            /v1            the router picks the tier from load and live acceptance
  economy         /economy/v1    the small model
  always-adaptive /v1 + "speculation": "on"   speculative with adaptive k whatever the load
(premium and always-adaptive take the same tier and k rule; they differ in price and in the
reason the ingress reports, and measuring both shows the run-to-run noise side by side.)
Owns HTTP, SSE parsing and timing; the statistics are `cluster/bench/stats.py`'s.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from dataclasses import dataclass

import httpx

from cluster.bench.stats import RequestRecord

_REQUEST_NUMBERS = itertools.count(1)      # the unique opening of synthetic prompts (`draw`)
POLICIES = {
    "standard": ("/standard/v1", {}),
    "premium": ("/premium/v1", {}),
    "auto": ("/v1", {}),
    "economy": ("/economy/v1", {}),
    "always-adaptive": ("/v1", {"speculation": "on"}),
}
ERROR_STATUS = {"invalid_request_error": 400, "authentication_error": 401,
                "permission_error": 403, "not_found_error": 404, "rate_limit_error": 429,
                "overloaded_error": 503, "server_error": 500}


@dataclass(frozen=True)
class Prompt:
    prompt_class: str
    text: str
    max_tokens: int


async def send(client: httpx.AsyncClient, policy: str, prompt: Prompt, model: str,
               temperature: float, ignore_eos: bool) -> RequestRecord:
    """One streamed completion; every outcome (error, exception) becomes a record."""
    body = {"model": model, "prompt": prompt.text, "max_tokens": prompt.max_tokens,
            "temperature": temperature, "ignore_eos": ignore_eos}
    return await _stream(client, policy, prompt.prompt_class, "completions", body)


async def send_chat(client: httpx.AsyncClient, policy: str, messages: list[dict], max_tokens: int,
                    model: str, temperature: float, ignore_eos: bool, label: str = "chat",
                    logprobs: bool = False) -> RequestRecord:
    """One streamed chat completion; the record keeps the answer's text and token ids (and
    each token's log-probability, with `logprobs`)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": temperature, "ignore_eos": ignore_eos, "logprobs": logprobs}
    return await _stream(client, policy, label, "chat/completions", body)


async def _stream(client: httpx.AsyncClient, policy: str, label: str, route: str,
                  body: dict) -> RequestRecord:
    prefix, extra = POLICIES[policy]
    body = {**body, "stream": True, "return_token_ids": True, **extra}
    rec = RequestRecord(policy=policy, prompt_class=label, sent=time.monotonic())
    try:
        async with client.stream("POST", f"{prefix}/{route}", json=body) as resp:
            rec.status = resp.status_code
            rec.tier = resp.headers.get("x-specserve-tier")
            rec.reason = resp.headers.get("x-specserve-reason")
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec.error = _error_code(text)
                rec.finished = time.monotonic()
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    break
                _event(rec, json.loads(payload), time.monotonic())
        rec.finished = time.monotonic()
    except (httpx.HTTPError, OSError, json.JSONDecodeError) as exc:
        rec.status, rec.error = type(exc).__name__, str(exc)[:200]
    if rec.status == 200 and rec.finished is not None and rec.prompt_tokens == 0:
        rec.status = "no_usage"      # a 200 stream that ended without its usage chunk
    return rec


def _event(rec: RequestRecord, data: dict, now: float) -> None:
    if "error" in data:             # an error after the stream began (status already 200)
        err = data["error"]
        rec.status = ERROR_STATUS.get(err.get("type"), "stream_error")
        rec.error = err.get("code") or err.get("message", "")[:200]
        return
    choice = (data.get("choices") or [{}])[0]
    ids = choice.get("token_ids") or []
    if ids:
        rec.token_times.append((now, len(ids)))
        rec.output_ids += ids
    rec.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    rec.logprobs += [e["logprob"] for e in (choice.get("logprobs") or {}).get("content") or []]
    usage = data.get("usage")
    if usage:
        rec.prompt_tokens = usage["prompt_tokens"]
        rec.completion_tokens = usage["completion_tokens"]
        rec.tier, rec.reason = usage.get("tier", rec.tier), usage.get("reason", rec.reason)
        rec.acceptance_rate = usage.get("acceptance_rate")
        rec.mean_acceptance_length = usage.get("mean_acceptance_length")


def _error_code(text: str) -> str:
    try:
        err = json.loads(text).get("error", {})
        return err.get("code") or err.get("type") or text[:200]
    except (json.JSONDecodeError, AttributeError):
        return text[:200]


class Workload:
    """Draws prompts: uniform over classes (a `mix` weight each), uniform within a class, and
    max_tokens uniform in [mean * (1 - spread), mean * (1 + spread)]."""

    def __init__(self, prompts: dict[str, list[str]], mix: dict[str, float], output_tokens: int,
                 spread: float, seed: int, shift: tuple[float, dict[str, float]] | None = None):
        self.prompts = prompts
        self.classes, self.weights = self._pick(mix)
        # (seconds after the first draw, the mix from then on): traffic that drifts
        self.shift = None if shift is None else (shift[0], *self._pick(shift[1]))
        self.first: float | None = None
        self.low = max(1, round(output_tokens * (1 - spread)))
        self.high = max(self.low, round(output_tokens * (1 + spread)))
        self.rng = random.Random(seed)

    def _pick(self, mix: dict[str, float]) -> tuple[list[str], list[float]]:
        classes = sorted(c for c, p in self.prompts.items() if mix.get(c, 0) > 0 and p)
        if not classes:
            raise ValueError("the prompt mix selects no prompts")
        return classes, [mix[c] for c in classes]

    def draw(self) -> Prompt:
        """The next request. A synthetic class's prompt (`cluster/bench/synthetic.py`) opens
        with a number no other request of the process has, so that no request finds another's
        prompt in the prefix cache: a stock client's synthetic prompts are each new, and the
        same text in every policy's windows would let a later window reuse an earlier one's
        prefill."""
        from cluster.bench.synthetic import OUTPUT_SCALE, SYNTHETIC

        now = time.monotonic()
        self.first = now if self.first is None else self.first
        classes, weights = self.classes, self.weights
        if self.shift is not None and now - self.first >= self.shift[0]:
            classes, weights = self.shift[1], self.shift[2]
        cls = self.rng.choices(classes, weights)[0]
        tokens = self.rng.randint(self.low, self.high)
        text = self.rng.choice(self.prompts[cls])
        if cls in SYNTHETIC:
            text = f"{next(_REQUEST_NUMBERS)}: {text}"
        return Prompt(cls, text, max(1, round(tokens * OUTPUT_SCALE.get(cls, 1.0))))


async def closed_loop(issue, users: int, stop_at: float, think_s: float, rng: random.Random,
                      error_pause_s: float = 0.5):
    """`users` users, each: send, wait for the answer, think (exponential, mean think_s). A user
    whose request failed pauses `error_pause_s` first (a 429 asks for it; the others should not
    turn a closed loop into a flood)."""
    async def user(i: int):
        await asyncio.sleep(i * 0.01)            # do not fire every first request at once
        while time.monotonic() < stop_at:
            rec = await issue()
            if rec is not None and not rec.ok:
                await asyncio.sleep(error_pause_s)
            if think_s > 0:
                await asyncio.sleep(rng.expovariate(1 / think_s))
    await asyncio.gather(*(user(i) for i in range(users)))


async def poisson(issue, rate: float, stop_at: float, rng: random.Random):
    """Open loop: arrivals at exponential gaps (mean 1/rate), whatever the answers do."""
    tasks = []
    next_at = time.monotonic()
    while True:
        next_at += rng.expovariate(rate)
        if next_at >= stop_at:
            break
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        tasks.append(asyncio.create_task(issue()))
    await asyncio.gather(*tasks)


def window_serving(d: dict) -> dict:
    """A window's differences of a tier's cumulative `ServingTimes`, as `simulate --scenario
    local-cpu` reads them: what its steps took against their profile's prices (target part,
    draft part), the loop's time between steps, a request's time in the engine."""
    ratio = lambda a, b: a / b if b > 0 else None   # noqa: E731
    return {"steps": d["steps"],
            "target_factor": ratio(d["step_s"] - d["draft_s"], d["priced_target_s"]),
            "draft_factor": ratio(d["draft_s"], d["priced_draft_s"]),
            "loop_gap_ms": ratio(d["gap_s"] * 1e3, d["gaps"]),
            "engine_request_s": ratio(d["request_s"], d["requests"])}


async def served_profiles(client: httpx.AsyncClient, admin_key: str | None) -> dict:
    """{tier: the step-cost profile its engine runs on} (`/health?profile=1`, admin keys only;
    {} without one): `simulate --scenario local-cpu` times its replicas with the very table
    the served engines profiled, not one profiled again later (the machine's speed drifts:
    three profiles of one target an hour apart differed by 15%)."""
    if not admin_key:
        return {}
    try:
        r = await client.get("/health", params={"profile": "1"}, timeout=10,
                             headers={"Authorization": f"Bearer {admin_key}"})
        tiers = r.json().get("tiers", {})
    except (httpx.HTTPError, ValueError):
        return {}
    return {kind: t["cost_profile"] for kind, t in tiers.items() if t.get("cost_profile")}


class HealthSampler:
    """Polls `/health` while a run lasts: peak KV bytes (target, draft) and queue, and the
    target's live acceptance, from what the replicas report to the router."""

    def __init__(self, client: httpx.AsyncClient, period_s: float = 0.5, admin_key: str | None = None):
        # /health shows the tiers' details to admin keys only (router/admin.py)
        self.client, self.period_s = client, period_s
        self.headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.samples: list[tuple[float, dict]] = []
        self._task: asyncio.Task | None = None

    async def _loop(self):
        while True:
            try:
                r = await self.client.get("/health", timeout=5, headers=self.headers)
                self.samples.append((time.monotonic(), r.json().get("tiers", {})))
            except (httpx.HTTPError, ValueError):
                pass
            await asyncio.sleep(self.period_s)

    def start(self):
        self._task = asyncio.create_task(self._loop())

    async def stop(self):
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def peaks(self, start: float, end: float) -> dict:
        out: dict[str, dict] = {}
        for t, tiers in self.samples:
            if not start <= t < end:
                continue
            for kind, s in tiers.items():
                p = out.setdefault(kind, {"samples": 0, "acceptance": []})
                p["samples"] += 1
                for key in ("kv_used_target_bytes", "kv_used_draft_bytes", "running", "waiting"):
                    if key in s:
                        p[f"peak_{key}"] = max(p.get(f"peak_{key}", 0), s[key])
                # the replicas' own peaks between reports (a sample alone can miss a short run's)
                for model in ("target", "draft"):
                    if s.get(f"kv_peak_{model}_bytes") is not None:
                        key = f"peak_kv_used_{model}_bytes"
                        p[key] = max(p.get(key, 0), s[f"kv_peak_{model}_bytes"])
                p["peak_kv_used_fraction"] = max(p.get("peak_kv_used_fraction", 0.0),
                                                 1.0 - s.get("kv_headroom", 1.0))
                if s.get("token_acceptance") is not None:
                    p["acceptance"].append(s["token_acceptance"])
                for key in ("cost_per_seq_ms", "cost_spec_scale"):   # the window's last value
                    if s.get(key) is not None:
                        p[key] = s[key]
                p.setdefault("running", []).append(s.get("running", 0))
                if s.get("serving"):              # cumulative: the window's first and last
                    p.setdefault("first_serving", s["serving"])
                    p["last_serving"] = s["serving"]
        for p in out.values():
            acc = p.pop("acceptance")
            p["mean_token_acceptance"] = sum(acc) / len(acc) if acc else None
            running = p.pop("running")
            p["mean_running"] = sum(running) / len(running)
            first, last = p.pop("first_serving", None), p.pop("last_serving", None)
            if first and last:
                p.update(window_serving({k: last[k] - first[k] for k in last}))
        return out
