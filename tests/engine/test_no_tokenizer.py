"""A checkpoint without a tokenizer (random weights written for a benchmark, as
scripts/gpu_roofline.py writes them) serves token ids; what needs text is refused clearly."""

import pytest

from conftest import run_all
from engine.config import EngineConfig
from engine.errors import InvalidParamError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from models.synthetic import write_random_llama


def test_a_checkpoint_without_a_tokenizer_serves_token_ids(tmp_path):
    write_random_llama(tmp_path / "t", 2, 64, 4, 2, 128, 256, shards=1)
    engine = LLMEngine(EngineConfig(str(tmp_path / "t"), profile=False, kv_budget_bytes=1 << 20,
                                    num_threads=1))
    assert engine.tokenizer is None
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4,
                                                      ignore_eos=True))
    assert len(run_all(engine)[0]["a"]) == 4
    with pytest.raises(InvalidParamError, match="no tokenizer"):
        engine.add_request("b", [1, 2], SamplingParams(max_tokens=4,
                                                       json_schema='{"type": "object"}'))
