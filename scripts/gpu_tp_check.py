"""TP = 2 on one GPU equals TP = 1, for scripts/gpu_check.sh: both ranks on cuda:0, joined over
gloo (SPECSERVE_TP_BACKEND; NCCL refuses two ranks on one device), the tiny random family in
float32, greedy, baseline and speculative requests, the engine's default attention. Writes
$OUT/tp_check.json and exits 1 where the tokens differ."""

import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ["SPECSERVE_TP_BACKEND"] = "gloo"

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import RequestOptions, SamplingParams  # noqa: E402
from engine.tp_worker import LocalPeers  # noqa: E402
from tiny_models import make_family  # noqa: E402

OUT = Path(os.environ.get("OUT", ROOT / "gpu-check-out"))
DEVICE = os.environ.get("DEVICE", "cuda")     # cpu: a dry run of the script here
PROMPTS = [[5 + i, 7, 9 + 2 * i, 11] * (1 + i % 4) + [20 + i] * (i % 3) for i in range(4)]


def greedy(engine) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, params, RequestOptions("speculative" if i % 2 else "baseline",
                                                              k_max=3))
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
    return [outs[f"r{i}"] for i in range(len(PROMPTS))]


def main() -> int:
    fam = make_family(Path(tempfile.mkdtemp()) / "tiny")
    config = EngineConfig(str(fam["target"]), str(fam["draft"]), device=DEVICE, dtype="float32",
                          kv_budget_bytes=8 << 20, profile=False, adaptive_k=False)
    start = time.perf_counter()
    one = greedy(LLMEngine(config))
    config = replace(config, tp_size=2)
    peers = LocalPeers(config)
    try:
        engine = LLMEngine(config, peers=peers)
        two = greedy(engine)
        backend = engine.target.backend
    finally:
        peers.close()
    result = {"equal": one == two, "attention": backend, "tp1": one, "tp2": two,
              "seconds": time.perf_counter() - start}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "tp_check.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0 if one == two else 1


if __name__ == "__main__":
    sys.exit(main())
