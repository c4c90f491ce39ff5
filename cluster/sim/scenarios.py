"""Capacity-simulator scenarios: hardware, models, draft placement, workload, acceptance mix.

Owns the definitions (`SCENARIOS`) and the workload they generate (`make_request`): what users
send and how well the draft does on it. Knows nothing about replicas, policies or reports.
Every random draw comes from a `random.Random` seeded by (seed, user, index), so a request is the
same under every policy and every load; acceptance draws are indexed by output position.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class AcceptanceMix:
    """Per-request acceptance rate: a prompt domain, then Beta(kappa m, kappa (1 - m)) around it."""

    name: str
    weights: dict[str, float]  # domain -> probability
    means: dict[str, float]  # domain -> mean acceptance rate
    concentration: float = 12.0  # kappa; 0 = every request exactly at its domain mean
    note: str = ""

    def draw(self, rng: random.Random) -> tuple[str, float]:
        domains = list(self.weights)
        domain = rng.choices(domains, [self.weights[d] for d in domains])[0]
        m = self.means[domain]
        if self.concentration <= 0:
            return domain, m
        k = self.concentration
        return domain, min(0.99, rng.betavariate(k * m, k * (1 - m)))


DOMAIN_WEIGHTS = {"code": 0.25, "chat": 0.35, "qa": 0.25, "creative": 0.15}
MIXES: dict[str, AcceptanceMix] = {
    "article": AcceptanceMix("article", DOMAIN_WEIGHTS,
                             {"code": 0.69, "chat": 0.55, "qa": 0.60, "creative": 0.42},
                             note="median ~58%, as the seed article logged over 10,000 prompts"),
    "paper": AcceptanceMix("paper", DOMAIN_WEIGHTS,
                           {"code": 0.82, "chat": 0.72, "qa": 0.75, "creative": 0.60},
                           note="median ~75%, what the paper's speed-up assumes"),
}


def fixed_mix(a: float) -> AcceptanceMix:
    """Every request accepts at exactly a (tests, analytic checks)."""
    return AcceptanceMix(f"fixed-{a:g}", {"chat": 1.0}, {"chat": a}, concentration=0.0,
                         note=f"every request at a = {a:g}")


def mix_named(name: str) -> AcceptanceMix:
    """A preset mix, or 'fixed-A' for every request at acceptance A."""
    if name in MIXES:
        return MIXES[name]
    if name.startswith("fixed-"):
        return fixed_mix(float(name.removeprefix("fixed-")))
    raise KeyError(f"unknown acceptance mix {name!r}; presets: {sorted(MIXES)} or fixed-A")


@dataclass(frozen=True)
class Deployment:
    """One target replica (tp GPUs, draft colocated) and one small-tier replica."""

    gpu: str  # key of engine.hardware.GPUS
    target: str  # key of engine.hardware.MODELS
    tp: int
    draft: str | None
    small: str | None = None
    small_tp: int = 1
    activation_reserve_gib: float = 4.0  # per GPU, kept out of the KV budget
    max_num_seqs: int = 256
    max_batched_tokens: int = 2048  # chunked prefill budget per step
    max_context: int = 4096  # model context window: prompt + max_tokens
    small_replicas: int = 1  # small-tier replicas (small_tp GPUs each)
    step_times: str = "roofline"  # "fitted": cluster/sim/fitted.py (published tables), or the
    #   datasheet roofline (engine/hardware.py)
    cost_mismatch: float = 0.0  # the engines believe speculation costs (1 + m) x what it does
    gpu_hour_usd: float = 2.0  # price of one GPU-hour (cost per million output tokens)
    prefix_caching: bool = True  # the replicas reuse cached prompt prefixes (the engine's default)


@dataclass(frozen=True)
class Workload:
    closed_loop: bool = True  # True: loads are concurrent users; False: open-loop QPS
    arrival_cv: float = 1.0  # open loop: coefficient of variation of the gaps between arrivals
    #   (1: Poisson; > 1: bursty, gamma-distributed gaps with shape 1 / cv^2)
    loads: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64)
    quick_loads: tuple[float, ...] = (1, 8, 32, 64)
    prompt_median: int = 400  # tokens, lognormal
    prompt_sigma: float = 0.8
    output_median: int = 250  # tokens, lognormal, capped at max_tokens
    output_sigma: float = 0.7
    max_tokens: int = 1024  # the request field; KV is reserved for prompt + max_tokens
    output_spread: float = 0.0  # > 0: every request asks for max_tokens uniform in
    #   output_median * (1 +- spread) and gets them all (`bench serve`'s requests, ignore_eos)
    think_s: float = 0.0  # closed loop: mean exponential pause between a user's requests
    start_spread_s: float = 1.0  # closed loop: users start uniformly within this window
    requests: int = 160  # measured requests per run (at least 8 per user)
    plan: str = "auto"
    allow_downgrade: bool = False
    queue_timeout_s: float = 60.0  # a request waiting longer is refused
    path_s: float = 0.0  # the serving path's time a request (HTTP, router, Ray: outside the
    #   engine), taken before it reaches the engine: in its latency and first token, and in a
    #   closed-loop user's cycle
    slo_ttft_s: float = 2.0  # SLO: time to first token at most this ...
    slo_tpot_s: float = 0.1  # ... and time per output token after it at most this
    open_loads: tuple[float, ...] = ()  # QPS for --arrivals poisson | bursty (closed-loop scenarios)
    system_prompt_tokens: int = 0  # every prompt starts with the same system prompt, this long
    turns: int = 1  # closed loop: a user's conversation runs this many requests, each prompt
    #   resending the ones before it with their answers (a shared prefix the cache can keep)


@dataclass(frozen=True)
class Section:
    """One sweep of the scenario: a draft placement and an acceptance mix."""

    draft_placement: str  # "sharded" over the target's tp GPUs, or "whole" on GPU 0
    mix: str  # a name for mix_named

    @property
    def name(self) -> str:
        return f"{self.draft_placement}/{self.mix}"


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    deployment: Deployment
    workload: Workload
    sections: tuple[Section, ...]
    fixed_k: int = 4  # the naive speculative policy's k
    single_user_mixes: tuple[str, ...] = ("article", "paper", "fixed-0.58", "fixed-0.75")
    article: tuple[dict, ...] = field(default_factory=tuple)  # claims to put our figures beside


# The seed article's claims (Llama-2-70B TP4 on 4x A100-80GB, Llama-2-7B draft).
ARTICLE_CLAIMS = (
    {"id": "baseline_capacity", "claim": "baseline serves 48 users at about 850 ms p95",
     "users": 48, "p95_latency_s": 0.85},
    {"id": "speculative_capacity", "claim": "speculative runs out of memory at 22 users, about 1200 ms p95",
     "users": 22, "p95_latency_s": 1.2},
    {"id": "throughput_drop", "claim": "speculative throughput 35% lower than baseline under load",
     "ratio": 0.65},
    {"id": "isolated_speedup", "claim": "2.1x speed-up on isolated requests", "speedup": 2.1},
    {"id": "speedup_at_58", "claim": "1.4x speed-up at 58% acceptance", "speedup": 1.4,
     "acceptance": 0.58},
    {"id": "kv_per_request", "claim": "8 GB of KV cache per request", "bytes": 8e9},
)

USERS_1_64 = (1, 2, 3, 4, 6, 8, 12, 16, 20, 22, 24, 28, 32, 40, 48, 56, 64)

SCENARIOS: dict[str, Scenario] = {
    "seed-4xa100": Scenario(
        "seed-4xa100",
        "the article's setup: Llama-2-70B TP4 on 4x A100-80GB, Llama-2-7B draft colocated "
        "(sharded over the four GPUs, or whole on GPU 0); step times fitted to published A100 "
        "tables (cluster/sim/fitted.py); the small tier is four Llama-3-8B replicas on the same "
        "four A100s",
        Deployment("A100-80GB", "Llama-2-70B", 4, "Llama-2-7B", small="Llama-3-8B", small_replicas=4,
                   step_times="fitted"),
        Workload(loads=USERS_1_64, quick_loads=(1, 8, 22, 48, 64), open_loads=(0.5, 1, 2, 3, 4)),
        (Section("sharded", "article"), Section("whole", "article")),
        article=ARTICLE_CLAIMS,
    ),
    "chat-4xa100": Scenario(
        "chat-4xa100",
        "the seed's hardware and models under chat traffic: a 1,200-token system prompt on "
        "every request, conversations of six turns that resend their history (what the prefix "
        "cache keeps; --prefix-caching off for the engine without it)",
        Deployment("A100-80GB", "Llama-2-70B", 4, "Llama-2-7B", small="Llama-3-8B", small_replicas=4,
                   step_times="fitted"),
        Workload(loads=(1, 4, 8, 16, 32, 48, 64), quick_loads=(1, 16, 48), prompt_median=120,
                 output_median=200, system_prompt_tokens=1200, turns=6),
        (Section("sharded", "article"),),
    ),
    "h200-70b": Scenario(
        "h200-70b",
        "the same models on 4x H200 (141 GB each): more KV headroom, faster HBM",
        Deployment("H200", "Llama-2-70B", 4, "Llama-2-7B", small="Llama-3-8B"),
        Workload(loads=(1, 4, 16, 32, 64, 96, 128), quick_loads=(1, 32, 128)),
        (Section("sharded", "article"), Section("sharded", "paper")),
    ),
    "h200-8b": Scenario(
        "h200-8b",
        "one H200 (this project's measured rates): Llama-3-8B target, Llama-3.2-1B draft and "
        "small tier, open-loop Poisson arrivals",
        Deployment("H200", "Llama-3-8B", 1, "Llama-3.2-1B", small="Llama-3.2-1B"),
        Workload(closed_loop=False, loads=(0.5, 2, 5, 10, 20, 30), quick_loads=(0.5, 10),
                 requests=240),
        (Section("whole", "article"),),
    ),
}


@dataclass(frozen=True)
class RequestSpec:
    """One request as the workload makes it; identical under every policy."""

    user: int
    index: int
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    domain: str
    acceptance: float  # true per-token acceptance rate of the draft on this request
    think_s: float  # closed loop: the user's pause before sending it
    seed: int  # seeds the per-position acceptance draws
    prefix: tuple[tuple[str, int], ...] = ()  # the prompt's shareable prefixes, shortest first:
    #   (key, tokens); a key names content (the system prompt; a conversation so far), so two
    #   prompts that carry the same key start with the same tokens up to the shorter length


def make_request(w: Workload, mix: AcceptanceMix, seed: int, user: int, index: int,
                 max_context: int) -> RequestSpec:
    """The request `user` sends `index`-th. With a system prompt or multi-turn conversations,
    its prompt is the system prompt, the conversation's earlier prompts' new text and answers,
    then this turn's new text (drawn as a single request's prompt); a conversation that would
    not fit the context starts again from the system prompt."""
    spec = _single(w, mix, seed, user, index, max_context)
    if not w.system_prompt_tokens and w.turns <= 1:
        return spec
    turns = max(w.turns, 1)
    system = min(w.system_prompt_tokens, max_context - spec.max_tokens - 1)
    history, start = 0, index // turns * turns
    for j in range(start, index + 1):
        text = _single(w, mix, seed, user, j, max_context) if j < index else spec
        room = max_context - text.max_tokens
        if system + history + text.prompt_tokens > room:
            history, start = 0, j
        prompt = min(room, system + history + text.prompt_tokens)
        history += text.prompt_tokens + text.output_tokens
    prefix = ((("system", system),) if system else ()) + (
        ((f"conversation:{user}:{start}", prompt),) if w.turns > 1 else ())
    return dataclasses.replace(spec, prompt_tokens=prompt, prefix=prefix)


def _single(w: Workload, mix: AcceptanceMix, seed: int, user: int, index: int,
            max_context: int) -> RequestSpec:
    """A request on its own: its prompt, answer, acceptance and think time."""
    rng = random.Random(f"{seed}:{user}:{index}")

    def lognormal(median: int, sigma: float, lo: int, hi: int) -> int:
        return int(min(hi, max(lo, round(median * math.exp(rng.gauss(0.0, sigma))))))

    max_tokens = min(w.max_tokens, max_context - 16)
    prompt = lognormal(w.prompt_median, w.prompt_sigma, 16, max_context - max_tokens)
    if w.output_spread > 0:
        lo, hi = (max(1, round(w.output_median * (1 + d * w.output_spread))) for d in (-1, 1))
        output = max_tokens = min(max_tokens, rng.randint(lo, hi))
    else:
        output = lognormal(w.output_median, w.output_sigma, 8, max_tokens)
    domain, a = mix.draw(rng)
    think = rng.expovariate(1.0 / w.think_s) if w.think_s > 0 else 0.0
    return RequestSpec(user, index, prompt, output, max_tokens, domain, a, think, rng.getrandbits(32))
