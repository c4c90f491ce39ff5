"""The CUDA tests of tests/engine/test_gpu.py without pytest (for a GPU box that lacks it)."""

import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "engine")]

import torch  # noqa: E402

torch.set_num_threads(1)
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from tiny_models import make_family  # noqa: E402

import test_gpu  # noqa: E402
from test_attention import PLANS  # noqa: E402


def main() -> int:
    fam = make_family(Path(tempfile.mkdtemp()) / "tiny")

    def make_engine(draft=True, **kw):
        kw.setdefault("kv_budget_bytes", 8 << 20)
        kw.setdefault("profile", False)
        kw.setdefault("num_threads", 1)
        return LLMEngine(EngineConfig(str(fam["target"]), str(fam["draft"]) if draft else None, **kw))

    cases = [(test_gpu.test_cuda_attention_equals_per_sequence, (dt, plan))
             for dt in (torch.float32, torch.bfloat16) for plan in sorted(PLANS)]
    cases += [(test_gpu.test_cuda_flex_attention_equals_per_sequence, (dt,))
              for dt in (torch.float32, torch.bfloat16)]
    cases += [(test_gpu.test_cuda_speculative_equals_plain, (make_engine, dt))
              for dt in ("float32", "bfloat16")]
    cases += [(test_gpu.test_cuda_prompt_pieces_past_position_0_run_flash_attention, ())]
    cases += [(test_gpu.test_cuda_decode_step_synchronises_once, (make_engine,)),
              (test_gpu.test_cuda_graphs_replay_what_eager_forwards_compute, (make_engine,)),
              (test_gpu.test_cuda_graphs_warmed_up_at_start_replay_what_eager_forwards_compute,
               (make_engine,))]
    failed = 0
    for fn, args in cases:
        try:
            fn(*args)
            print("PASS", fn.__name__, args[-1])
        except Exception:
            failed += 1
            print("FAIL", fn.__name__, args[-1])
            traceback.print_exc()
    print(f"{len(cases) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
