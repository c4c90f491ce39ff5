"""The ingress's pure parts, without Ray: configs, keys, prices, request validation, stats."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from router.config import AppConfig, TierModelConfig, load_config, uses_demo_family
from router.keys import KeyStore, add_key, make_record, read_keys
from router.openai_schema import ChatCompletionRequest, CompletionRequest, error_body
from router.plans import effective_plan, plan_covers

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "cluster" / "configs"


def test_local_yaml_loads_with_the_demo_family(tmp_path):
    assert uses_demo_family(CONFIGS / "local.yaml")
    cfg = load_config(CONFIGS / "local.yaml", demo_dir=tmp_path / "demo")
    assert cfg.target.model == str(tmp_path / "demo" / "target")
    assert cfg.target.draft == str(tmp_path / "demo" / "draft")
    assert cfg.small is not None and cfg.small.num_replicas == 1
    assert cfg.target.tp_size == 1 and cfg.target.device == "cpu"
    assert cfg.auth.keys_file and os.path.isabs(cfg.auth.keys_file)


def test_the_autoscaling_config_loads_and_round_trips(tmp_path):
    """A tier with `autoscaling:` survives load_config's path resolution (a dump and a second
    validation, where num_replicas comes back beside it) and every other dump and reload;
    everything but the tiers' replica settings is make run's."""
    cfg = load_config(CONFIGS / "local-autoscale.yaml", demo_dir=tmp_path)
    local = load_config(CONFIGS / "local.yaml", demo_dir=tmp_path)
    assert cfg.target.autoscaling.max_replicas == 2 and cfg.small.autoscaling.max_replicas == 3
    assert AppConfig.model_validate(cfg.model_dump()) == cfg
    for tier in ("target", "small"):
        a, b = getattr(cfg, tier).model_dump(), getattr(local, tier).model_dump()
        assert {k: v for k, v in a.items() if k != "autoscaling"} == \
            {k: v for k, v in b.items() if k != "autoscaling"}
    assert cfg.model_dump(exclude={"target", "small", "plans"}) == \
        local.model_dump(exclude={"target", "small", "plans"})


def test_the_benchmark_config_serves_as_make_run_does(tmp_path):
    """The number published is the number served: bench-http.yaml differs from local.yaml (what
    `make run` serves) in the key it asks for and the names, never in a setting of a tier or of
    the serving path."""
    local = load_config(CONFIGS / "local.yaml", demo_dir=tmp_path)
    bench = load_config(CONFIGS / "bench-http.yaml", demo_dir=tmp_path)
    assert bench.target == local.target and bench.small == local.small
    assert bench.limits == local.limits and bench.stats == local.stats
    assert bench.policy == local.policy
    launch = [yaml.safe_load((CONFIGS / name).read_text())["launcher"]
              for name in ("local.yaml", "bench-http.yaml")]
    assert launch[0] == launch[1]


def test_relative_demo_dir_is_taken_from_the_working_directory(tmp_path, monkeypatch):
    """The README's `SPECSERVE_DEMO_DIR=../shared/models/reference-py specserve up --config
    cluster/configs/bench-http.yaml`: resolved from the config's folder instead, the replicas
    would look for cluster/shared/models/... and every tier would fail to load."""
    from models.demo import default_demo_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPECSERVE_DEMO_DIR", "family")
    here = tmp_path.resolve() / "family"
    assert default_demo_dir() == here
    cfg = load_config(CONFIGS / "bench-http.yaml")
    assert cfg.target.model == str(here / "target") and cfg.small.model == str(here / "small")


def test_llama2_70b_yaml_loads():
    cfg = load_config(CONFIGS / "llama2-70b-4xa100.yaml")
    assert cfg.target.tp_size == 4 and cfg.target.num_gpus_per_rank == 1
    assert cfg.target.model.endswith("Llama-2-70b-hf") and cfg.target.draft.endswith("Llama-2-7b-hf")
    assert cfg.small.model.endswith("Meta-Llama-3-8B-Instruct") and cfg.small.device == "cuda"
    assert set(cfg.prices) == {"speculative", "baseline", "small"}
    assert cfg.policy.k_max == 8            # a typed PolicyConfig, read at load time
    engine = cfg.target.engine_config()     # the engine's dataclass, built straight from the tier
    assert (engine.tp_size, engine.max_num_seqs, engine.kv_budget_bytes) == (4, 64, None)
    assert engine.gpu_memory_utilization == 0.90     # rank 0 plans the budget on its GPU
    assert engine.kv_resident               # a served replica holds its KV budget from the start
    off = TierModelConfig(model="/m", engine_args={"kv_resident": False}).engine_config()
    assert not off.kv_resident
    assert engine.enable_prefix_caching      # on by default (docs/decisions/0028-prefix-caching.md)
    assert not TierModelConfig(model="/m", enable_prefix_caching=False).engine_config().enable_prefix_caching


@pytest.mark.parametrize("name", ["local.yaml", "bench-http.yaml", "llama2-70b-4xa100.yaml"])
def test_a_replica_takes_all_its_engine_holds(name, tmp_path):
    """Past saturation the engine's own queue holds the backlog and refuses beyond it: a Serve
    replica bound below the engine's would fill first, and the rest wait at the caller's
    handle, whose router polls the full replica
    (docs/decisions/0015-replica-takes-what-its-engine-holds.md). So a tier's Serve options
    take every request its engine runs and queues, plus some in transit."""
    from deployments.app import _tier_options

    cfg = load_config(CONFIGS / name, demo_dir=tmp_path)
    for tier in filter(None, (cfg.target, cfg.small)):
        limit = _tier_options(tier, cfg)["max_ongoing_requests"]
        assert limit > tier.max_num_seqs + tier.max_waiting, (name, limit)
        assert limit <= tier.max_num_seqs + tier.max_waiting + max(4, tier.max_num_seqs // 4)
    explicit = TierModelConfig(model="/m", max_ongoing_requests=3)
    assert _tier_options(explicit, cfg)["max_ongoing_requests"] == 3    # an explicit bound holds


def test_a_tier_goes_to_the_nodes_with_its_resources():
    """`resources` reach the replica's actor options and every rank's placement bundle."""
    from deployments.app import _tier_options

    cfg = AppConfig.model_validate({"target": {"model": "/m"}, "ingress_num_replicas": 2})
    small = TierModelConfig(model="/s", resources={"small_node": 1})
    assert _tier_options(small, cfg)["ray_actor_options"]["resources"] == {"small_node": 1}
    tp = TierModelConfig(model="/t", tp_size=2, num_gpus_per_rank=1, resources={"gpu_node": 1})
    bundles = _tier_options(tp, cfg)["placement_group_bundles"]
    assert bundles == [{"CPU": 1.0, "GPU": 1.0, "gpu_node": 1}] * 2
    assert _tier_options(cfg.target, cfg)["ray_actor_options"]["resources"] == {}


def test_bad_policy_or_engine_args_fail_when_the_config_loads(tmp_path):
    base = {"target": {"model": "/m"}}
    for policy, match in (({"k_max": -1}, "k_max"), ({"kmax": 3}, "kmax"),
                          ({"min_gain": 0}, "min_gain"),
                          ({"queue_deep_enter": 2, "queue_deep_exit": 2}, "queue_deep"),
                          ({"default_acceptance": "high"}, "default_acceptance")):
        with pytest.raises(ValidationError, match=match):
            AppConfig.model_validate({**base, "policy": policy})
    with pytest.raises(ValidationError, match="not EngineConfig fields"):
        AppConfig.model_validate({"target": {"model": "/m", "engine_args": {"blocksize": 8}}})
    with pytest.raises(ValidationError, match="max_num_batched_tokens"):
        AppConfig.model_validate({"target": {"model": "/m", "engine_args": {"max_num_batched_tokens": 1}}})
    for args, match in (({"graph_warmup": "yes"}, "graph_warmup must be true or false"),
                        ({"graphs": "sometimes"}, "graphs must be auto, off or static")):
        with pytest.raises(ValidationError, match=match):
            AppConfig.model_validate({"target": {"model": "/m", "engine_args": args}})
    path = tmp_path / "app.yaml"
    path.write_text("app:\n  target: {model: /m}\n  policy: {k_max: 99}\n")
    with pytest.raises(ValidationError, match="k_max"):
        load_config(path)
    # the cap's older names still load, as policy.k_max
    assert AppConfig.model_validate({**base, "policy": {"max_k": 3}}).policy.k_max == 3
    assert AppConfig.model_validate({"target": {"model": "/m", "k_max": 5}}).policy.k_max == 5


def test_ray_cluster_launcher_yaml_matches_the_topology():
    import yaml

    launcher = yaml.safe_load((REPO / "ray_config.yaml").read_text())
    workers = launcher["available_node_types"]
    gpus = [t["resources"].get("GPU", 0) for t in workers.values()]
    assert 4 in gpus and launcher["head_node_type"] in workers


def test_config_refuses_bad_input():
    base = {"target": {"model": "/m"}}
    AppConfig.model_validate(base)
    with pytest.raises(ValidationError, match="tp_size"):
        AppConfig.model_validate({"target": {"model": "/m", "tp_size": 0}})
    with pytest.raises(ValidationError, match="dtype"):
        AppConfig.model_validate({"target": {"model": "/m", "dtype": "int3"}})
    with pytest.raises(ValidationError, match="missing tiers"):
        AppConfig.model_validate({**base, "prices": {"baseline": {"prompt_per_1m": 1,
                                                                  "completion_per_1m": 1}}})
    with pytest.raises(ValidationError, match="small tier runs without a draft"):
        AppConfig.model_validate({**base, "small": {"model": "/s", "draft": "/d"}})
    with pytest.raises(ValidationError, match="Extra inputs"):
        AppConfig.model_validate({**base, "targte": {}})


def test_keys_are_stored_hashed_and_found(tmp_path):
    path = tmp_path / "keys.json"
    key = add_key(path, "alice", "premium")
    assert key.startswith("sk-ss-") and key not in path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    records = read_keys(path)
    assert [(r.name, r.plan) for r in records] == [("alice", "premium")]
    with pytest.raises(ValueError, match="already exists"):
        add_key(path, "alice", "economy")
    with pytest.raises(ValueError, match="unknown plan"):
        add_key(path, "bob", "gold")
    store = KeyStore(records)
    assert store.lookup(key).plan == "premium" and store.lookup(key + "x") is None


def test_keys_from_config_file_and_inline(tmp_path):
    path = tmp_path / "keys.json"
    file_key = add_key(path, "a", "economy")
    inline_key, record = make_record("b", "auto")
    cfg = AppConfig.model_validate({"target": {"model": "/m"}, "auth": {
        "keys_file": str(path), "keys": [{"name": "b", "plan": "auto", "sha256": record.sha256}]}})
    store = KeyStore.from_config(cfg.auth)
    assert store.lookup(file_key).plan == "economy" and store.lookup(inline_key).plan == "auto"


def test_plan_coverage():
    assert plan_covers("premium", "economy") and plan_covers("auto", "premium")
    assert not plan_covers("economy", "premium") and not plan_covers("standard", "premium")
    assert plan_covers("economy", "auto")
    assert effective_plan("economy", "auto") == "economy"
    assert effective_plan("auto", "premium") == "premium"


def test_request_validation():
    ok = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "stop": "\n"})
    assert ok.stop == ["\n"] and ok.speculation == "auto" and not ok.allow_downgrade
    assert CompletionRequest.model_validate({"model": "m", "prompt": ["one"]}).prompt == "one"
    assert CompletionRequest.model_validate({"model": "m", "prompt": [1, 2]}).prompt == [1, 2]
    for bad in ({"model": "m", "prompt": "x", "n": 0}, {"model": "m", "prompt": "x", "top_p": 0},
                {"model": "m", "prompt": ["a", "b"]}, {"model": "m", "prompt": "x", "logprobs": 6},
                {"model": "m", "prompt": "x", "speculation": "maybe"}, {"model": "m"}):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate(bad)
    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "max_completion_tokens": 5,
         "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    assert chat.plain_messages() == [{"role": "user", "content": "hi"}]
    assert chat.sampling_kwargs(16)["max_tokens"] == 5
    assert json.dumps(error_body("m", "invalid_request_error", "c"))


def test_token_auth_is_switched_on_explicitly(tmp_path, monkeypatch):
    from cluster.launch import ray_local

    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    path = ray_local.enable_token_auth(tmp_path / "token")
    assert os.environ["RAY_AUTH_MODE"] == "token"
    assert os.environ["RAY_AUTH_TOKEN_PATH"] == str(path)
    assert len(path.read_text()) == 64 and stat.S_IMODE(path.stat().st_mode) == 0o600
    token = path.read_text()
    assert ray_local.enable_token_auth(path).read_text() == token      # kept, not rotated
    assert ray_local.auth_headers() == {"Authorization": f"Bearer {token}"}


def test_deploy_writes_a_serve_config():
    from cluster.launch.deploy import serve_config

    cfg = load_config(CONFIGS / "llama2-70b-4xa100.yaml")
    config = serve_config(cfg, "local:///opt/specserve", "0.0.0.0", 8000)
    app = config["applications"][0]
    assert app["import_path"] == "deployments.app:build_app"
    assert AppConfig.model_validate(app["args"]) == cfg
    assert app["runtime_env"]["working_dir"] == "local:///opt/specserve"
    with pytest.raises(ValueError, match="local://"):
        serve_config(cfg, "/home/me/specserve", "0.0.0.0", 8000)


def test_grafana_dashboard_uses_only_exported_metrics():
    import re

    dashboard = json.loads((REPO / "cluster" / "grafana_dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {re.sub(r"_(total|bucket)$", "", m)[len("ray_"):]
            for e in exprs for m in re.findall(r"ray_specserve_\w+", e)}
    source = "".join((REPO / f).read_text() for f in ("deployments/metrics.py", "router/ingress.py",
                                                       "router/lifecycle.py",
                                                       "router/autoscaling.py"))
    declared = set(re.findall(r'"(specserve_[a-z_]+)"', source))
    assert used and used <= declared, used - declared
