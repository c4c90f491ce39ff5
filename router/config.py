"""The application config: what `build_app` and `specserve up/deploy` read from a YAML file.

Owns the user-facing shape of a deployment (model folders, tensor-parallel size, replicas, the
price table, API keys, limits) as pydantic models that refuse bad input with a clear message.
Typed end to end: a tier builds the engine's own dataclass config (`TierModelConfig.engine_config`
-> `engine.config.EngineConfig`), the policy section is the policy's own `PolicyConfig`, both
checked when the file is loaded. Imports neither torch nor Ray.
"""

from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from router.autoscaling import Autoscaling
from router.alignment_config import AlignmentSection
from router.capture import CaptureConfig
from engine.config import EngineConfig
from router.policy import PLANS, TIERS, PolicyConfig



class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TierModelConfig(_Strict):
    """One engine: a model folder (plus its draft for the target) and how its replicas run."""
    model: str = Field(description="local Hugging Face checkpoint folder")
    draft: str | None = Field(None, description="draft checkpoint folder (target tier only)")
    tp_size: int = Field(1, ge=1, le=64, description="tensor-parallel ranks per replica")
    num_replicas: int = Field(1, ge=1, description="replicas (one placement group each); "
                              "with `autoscaling`, the autoscaler sets the count instead")
    autoscaling: Autoscaling | None = Field(None, description="scale the tier's replicas on "
                                            "their load (router/autoscaling.py); None: fixed "
                                            "num_replicas")
    dtype: str = Field("float32", description="weights and KV; auto: bfloat16 where the device "
                       "computes it natively (AVX512-BF16/AMX CPUs, GPUs), else float32")
    device: Literal["cpu", "cuda"] = "cpu"
    num_cpus_per_rank: float = Field(1.0, ge=0, description="CPUs reserved per rank bundle")
    num_gpus_per_rank: float = Field(0.0, ge=0, description="GPUs per rank bundle (1 in production)")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources "
        "per rank bundle: the tier's replicas go only to nodes that have them (e.g. a node "
        "started with --resources '{\"small_node\": 1}')")
    kv_budget_bytes: int | None = Field(None, gt=0, description="None: derived from device memory")
    gpu_memory_utilization: float = Field(0.90, gt=0, le=1, description="share of each GPU's "
        "memory the replica plans for: weights, peak activations and the KV cache (vLLM's knob)")
    max_num_seqs: int = Field(32, ge=1, description="largest running batch")
    max_model_len: int | None = Field(None, ge=8, description="None: the checkpoint's context")
    max_waiting: int = Field(64, ge=0, description="engine waiting-queue bound (then 429)")
    num_threads: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="torch threads per rank process; auto: the CPUs the rank reserves "
        "(num_cpus_per_rank, at least 1), since threads past a rank's reservation contend with "
        "the replicas and Ray beside it (docs/decisions/0016-served-target-threads.md)")
    openmp_wait: Literal["passive", "brief", "spin"] = Field(
        "passive", description="idle OpenMP threads sleep at once (passive: cores shared with "
        "busy replicas and Ray), spin tens of microseconds first (brief: a step runs at nearly "
        "the spinning speed, idle replicas sleep), or spin up to ~1 ms (spin: the rank has its "
        "cores to itself); see engine/__init__.py")
    stream_interval: int = Field(1, ge=1, description="tokens a stream gathers before it sends "
        "them (the first token and the last go at once): every message up the serving path "
        "(Ray, ingress, proxy, client) costs CPU per request and step, so more than 1 trades "
        "smooth streaming for throughput under load, as vLLM's --stream-interval")
    engine_process: bool | None = Field(None, description="run the step loop in a process of "
        "its own (engine/engine_core.py), away from the replica's event loop, Ray's threads and "
        "the GIL; None: yes where tp_size is 1 (a tensor-parallel target's rank 0 drives its "
        "peers in the replica's process)")
    engine_restarts: int = Field(3, ge=0, description="in-place restarts of a dead engine "
        "process within 10 minutes (the replica routes around itself meanwhile); past them, or "
        "with 0, the replica fails its health check and Serve replaces it")
    max_ongoing_requests: int | None = Field(None, ge=1, description="Serve: concurrent "
        "requests per replica; None: the engine's own bound (max_num_seqs + max_waiting) and "
        "room for requests in transit (`serve_max_ongoing`)")
    max_queued_requests: int = Field(32, ge=1, description="Serve: queued requests per caller")
    enable_prefix_caching: bool = Field(True, description="reuse the KV of cached prompt "
        "prefixes (target and draft) across requests and siblings, skipping their prefill; "
        "output unchanged (docs/decisions/0028-prefix-caching.md)")
    engine_args: dict[str, Any] = Field(default_factory=dict,
                                        description="more EngineConfig fields (adaptive_k, block_size, ...)")

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value: str) -> str:
        allowed = {"auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"}
        if value not in allowed:
            raise ValueError(f"dtype must be one of {sorted(allowed)}, got {value!r}")
        return value

    @model_validator(mode="after")
    def _engine_args(self) -> "TierModelConfig":
        known = {f.name for f in fields(EngineConfig)}
        unknown = set(self.engine_args) - known
        if unknown:
            raise ValueError(f"engine_args {sorted(unknown)} are not EngineConfig fields")
        # (a dumped config carries num_replicas 1 beside autoscaling: that one is ignored)
        if self.autoscaling is not None and self.num_replicas != 1:
            raise ValueError("give num_replicas or autoscaling, not both: with autoscaling the "
                             "replica count is min_replicas..max_replicas")
        if self.engine_process is True and self.tp_size > 1:
            raise ValueError("engine_process runs a tp_size 1 engine; a tensor-parallel target's "
                             "rank 0 drives its peers in the replica's process")
        self.engine_config()        # EngineConfig's own checks, at load time
        return self

    @property
    def serve_max_ongoing(self) -> int:
        """What a replica takes at once: by default all its engine holds (running and waiting)
        plus a quarter of a batch (at least 4) in transit (being refused, or streaming their
        last chunk after the engine let them go). So past saturation the engine's own queue
        holds the backlog and refuses beyond it (429), cheaply, in order. With a replica bound
        below the engine's, the replica would fill first and the rest wait at the caller's Serve
        handle, whose router polls the full replica for its queue length, and past saturation
        the served tokens halve (docs/decisions/0015-replica-takes-what-its-engine-holds.md)."""
        if self.max_ongoing_requests is not None:
            return self.max_ongoing_requests
        return self.max_num_seqs + self.max_waiting + max(4, self.max_num_seqs // 4)

    @property
    def threads(self) -> int:
        """`num_threads` resolved: the same on every node (it reads the reservation only)."""
        if self.num_threads == "auto":
            return max(1, int(self.num_cpus_per_rank))
        return self.num_threads

    @property
    def runs_engine_process(self) -> bool:
        return self.engine_process if self.engine_process is not None else self.tp_size == 1

    def engine_config(self) -> EngineConfig:
        """The engine's dataclass config for one replica of this tier. A served replica writes
        its KV pool at start (`kv_resident`; engine_args may turn it off)."""
        return EngineConfig(**{
            "kv_resident": True,
            "target": self.model, "draft": self.draft, "dtype": self.dtype, "device": self.device,
            "kv_budget_bytes": self.kv_budget_bytes, "max_num_seqs": self.max_num_seqs,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "max_model_len": self.max_model_len, "num_threads": self.threads,
            "max_waiting": self.max_waiting, "tp_size": self.tp_size,
            "enable_prefix_caching": self.enable_prefix_caching, **self.engine_args})


class TierPrice(_Strict):
    """USD per million tokens, that is micro-dollars per token: `router/billing.py` reads them
    exactly (as decimals) and prices a request in integer micro-dollars."""
    prompt_per_1m: float = Field(ge=0)
    completion_per_1m: float = Field(ge=0)


def _default_prices() -> dict[str, TierPrice]:
    return {"speculative": TierPrice(prompt_per_1m=3.0, completion_per_1m=15.0),
            "baseline": TierPrice(prompt_per_1m=1.0, completion_per_1m=5.0),
            "small": TierPrice(prompt_per_1m=0.1, completion_per_1m=0.4)}


class InlineKey(_Strict):
    """A key given in the config itself, already hashed (see `router.keys`)."""
    name: str
    plan: Literal[PLANS]
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class AuthConfig(_Strict):
    require_key: bool = Field(True, description="False: a request without a key gets default_plan")
    keys_file: str | None = Field(None, description="JSON file of hashed keys (specserve keys add)")
    keys: list[InlineKey] = Field(default_factory=list)
    default_plan: Literal[PLANS] = "auto"
    admin_keys: list[str] = Field(default_factory=list,
                                  description="SHA-256 of admin keys (beside `specserve keys add --admin`)")
    refresh_s: float = Field(1.0, gt=0, description="how often the ingress re-reads the live keys")


class LimitsConfig(_Strict):
    max_queued_requests: int = Field(64, ge=1, description="ingress: queued requests per proxy")
    max_ongoing_requests: int = Field(256, ge=1, description="ingress: concurrent requests")
    max_in_flight: int = Field(192, ge=1, description="ingress admission: past it a 429 in "
                               "OpenAI's shape (below max_ongoing_requests, so the ingress "
                               "answers before Serve's proxy would)")
    retry_after_s: float = Field(1.0, ge=0, description="Retry-After sent with a 429")
    max_tokens_default: int = Field(16, ge=1)
    max_tokens_limit: int = Field(4096, ge=1, description="bound on max_tokens and "
                                  "max_completion_tokens")
    max_n: int = Field(16, ge=1, le=128, description="bound on n, the choices of one request "
                       "(each a sequence in the engine)")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="request body bytes (then 413)")
    max_json_depth: int = Field(16, ge=4, le=64, description="JSON nesting of a request body")

    @model_validator(mode="after")
    def _ingress_answers_first(self) -> "LimitsConfig":
        if self.max_in_flight >= self.max_ongoing_requests:
            raise ValueError(f"limits.max_in_flight ({self.max_in_flight}) must be below "
                             f"limits.max_ongoing_requests ({self.max_ongoing_requests}), so "
                             "overload is answered by the ingress (429 in OpenAI's shape)")
        return self


class PlanLimits(_Strict):
    """Per key on a plan; None is unlimited. Shared by every ingress replica (the database)."""
    requests_per_min: int | None = Field(None, ge=1)
    tokens_per_min: int | None = Field(None, ge=1, description="prompt + max_tokens reserved at admission")
    monthly_tokens: int | None = Field(None, ge=1, description="prompt + completion, calendar month (UTC)")


class LedgerConfig(_Strict):
    """Where usage, live keys and rate-limit counters live (`router/store.py`)."""
    url: str | None = Field(None, description="sqlite:///PATH (default ~/.specserve/ledger.db) "
                                              "or postgresql://... for several nodes")
    spool_dir: str | None = Field(None, description="local fsynced spool (default: beside the "
                                                    "SQLite file, or ~/.specserve/spool)")
    drain_period_s: float = Field(0.5, gt=0, description="spool -> database period")


class StatsConfig(_Strict):
    period_s: float = Field(1.0, gt=0, description="replica stats period (record_routing_stats)")
    stale_after_s: float = Field(10.0, gt=0, description="stats older than this count as missing")


class AppConfig(_Strict):
    """Everything one specserve application needs; `build_app(AppConfig)` turns it into Serve."""
    name: str = "specserve"
    model_name: str = Field("specserve", description="the `model` clients send; /v1/models lists it")
    model_aliases: list[str] = Field(default_factory=list)
    route_prefix: str = "/"
    target: TierModelConfig
    small: TierModelConfig | None = None
    prices: dict[str, TierPrice] = Field(default_factory=_default_prices)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    stats: StatsConfig = Field(default_factory=StatsConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig,
                                 description="the tier policy's settings (router/policy.py)")
    ledger: LedgerConfig = Field(default_factory=LedgerConfig)
    plans: dict[str, PlanLimits] = Field(default_factory=dict, description="rate limits per plan")
    ingress_num_cpus: float = Field(0.1, ge=0)
    ingress_num_replicas: int = Field(1, ge=1, description="ingress replicas: each polls the "
        "tiers' stats itself; keys, rate limits and the ledger are shared through the ledger "
        "database (with several nodes, PostgreSQL)")
    capture: CaptureConfig = Field(default_factory=CaptureConfig,
                                   description="opt-in prompt capture for draft distillation")
    alignment: AlignmentSection = Field(default_factory=AlignmentSection, description="the "
                                        "closed alignment loop (deployments/alignment_loop.py)")

    @model_validator(mode="before")
    @classmethod
    def _legacy_k_cap(cls, data: Any) -> Any:
        """The k cap is `policy.k_max`; older files named it `policy.max_k` or `target.k_max`."""
        if not isinstance(data, dict) or not isinstance(data.get("policy", {}), dict):
            return data
        policy = dict(data.get("policy") or {})
        target = data.get("target")
        if isinstance(target, dict) and "k_max" in target:
            target = dict(target)
            policy.setdefault("k_max", target.pop("k_max"))
            data = {**data, "target": target}
        if "max_k" in policy:
            policy.setdefault("k_max", policy.pop("max_k"))
        return {**data, "policy": policy} if policy else data

    @model_validator(mode="after")
    def _check(self) -> "AppConfig":
        missing = [t for t in TIERS if t not in self.prices]
        if missing:
            raise ValueError(f"prices is missing tiers {missing}; give all of {list(TIERS)}")
        unknown = [t for t in self.prices if t not in TIERS]
        if unknown:
            raise ValueError(f"prices has unknown tiers {unknown}; tiers are {list(TIERS)}")
        bad_plans = [p for p in self.plans if p not in PLANS]
        if bad_plans:
            raise ValueError(f"plans has unknown plans {bad_plans}; plans are {list(PLANS)}")
        if self.small is not None and self.small.draft is not None:
            raise ValueError("the small tier runs without a draft; remove small.draft")
        if self.small is not None and self.small.tp_size != 1:
            raise ValueError("the small tier runs with tp_size 1")
        if self.target.autoscaling is not None and self.target.autoscaling.min_replicas == 0:
            raise ValueError("the target tier cannot scale to zero (every plan but economy "
                             "needs it); only the small tier takes autoscaling.min_replicas 0")
        return self

    @property
    def scales_to_zero(self) -> frozenset[str]:
        """Tiers (`small`) whose autoscaler may leave no replica: while one is cold, economy
        goes to baseline (`small_cold`) and a request wakes it."""
        small = self.small.autoscaling if self.small is not None else None
        return frozenset({"small"}) if small is not None and small.min_replicas == 0 else frozenset()

    @property
    def served_model_names(self) -> list[str]:
        return [self.model_name, *self.model_aliases]

    def resolve_paths(self, base: str | Path) -> "AppConfig":
        """Model and key paths relative to the config file's folder (and `~`) made absolute."""
        base = Path(base)

        def fix(path: str | None) -> str | None:
            if path is None:
                return None
            p = Path(path).expanduser()
            return str(p if p.is_absolute() else (base / p).resolve())

        data = self.model_dump()
        for tier in ("target", "small"):
            if data.get(tier):
                data[tier]["model"] = fix(data[tier]["model"])
                data[tier]["draft"] = fix(data[tier]["draft"])
        data["auth"]["keys_file"] = fix(data["auth"]["keys_file"])
        url = data["ledger"]["url"]
        if url and url.startswith("sqlite:///") and not url.startswith("sqlite:////"):
            data["ledger"]["url"] = "sqlite:///" + fix(url[len("sqlite:///"):])
        data["ledger"]["spool_dir"] = fix(data["ledger"]["spool_dir"])
        return AppConfig.model_validate(data)


DEMO_PLACEHOLDER = "{demo_family}"


def default_demo_dir() -> Path:
    """The demo family to serve, as `models.demo.default_demo_dir` says (no torch import here):
    `$SPECSERVE_DEMO_DIR`, else the family committed in the repository, else the user's cache."""
    if not os.environ.get("SPECSERVE_DEMO_DIR"):
        committed = Path(__file__).resolve().parents[1] / "demo-family"
        if (committed / "family.json").is_file():
            return committed
    # resolved here, from the working directory: substituted into a YAML, a relative path
    # would be taken from the config file's folder (`resolve_paths`) and name another folder
    return Path(os.environ.get("SPECSERVE_DEMO_DIR") or "~/.cache/specserve/demo-family").expanduser().resolve()


def read_yaml(path: str | Path, demo_dir: str | Path | None = None) -> dict:
    """The YAML file as a dict, with `{demo_family}` replaced by the demo family's folder."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    text = path.read_text().replace(DEMO_PLACEHOLDER, str(demo_dir or default_demo_dir()))
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return data


def uses_demo_family(path: str | Path) -> bool:
    return DEMO_PLACEHOLDER in Path(path).expanduser().read_text()


def load_config(path: str | Path, demo_dir: str | Path | None = None) -> AppConfig:
    """Read a YAML app config; relative paths in it are taken from the file's folder.

    The file holds the `AppConfig` fields under `app:` (beside `launcher:`, the settings of
    `specserve up`), or at the top level. `{demo_family}` in a path is the demo family folder.
    """
    data = read_yaml(path, demo_dir)
    data = data.get("app", data)
    return AppConfig.model_validate(data).resolve_paths(Path(path).expanduser().parent)
