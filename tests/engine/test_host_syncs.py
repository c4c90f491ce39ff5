"""A decode step reads the device once, for its accepted tokens, and sends the device nothing
through a blocking copy (docs/decisions/0038-one-host-read-per-step.md). On a GPU each such read
or copy stalls the host; here `tests/host_syncs.py` counts the calls that would, on the CPU.
tests/engine/test_gpu.py counts the real synchronisations where a GPU is at hand."""

import pytest
import torch

from conftest import run_all
from engine.config import EngineConfig
from engine.host_sync import StepClock, upload
from engine.llm_engine import LLMEngine
from engine.sampling_params import RequestOptions, SamplingParams
from engine.tp_worker import LocalPeers
from host_syncs import HostSyncs

STEPS = 6


def _decode_steps(engine, speculative: bool) -> HostSyncs:
    """Five requests (greedy, sampled, top-p, top-k, seeded) past their prefill, then STEPS
    steps counted."""
    params = [SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, max_tokens=64, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=20, max_tokens=64, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=11, max_tokens=64, ignore_eos=True)]
    mode = "speculative" if speculative else "baseline"
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", [5 + i, 7, 9, 11] * (3 + i), p,
                           RequestOptions(mode=mode, k_max=3))
    for _ in range(3):
        engine.step()
    assert all(s.num_computed >= s.num_prompt for s in engine.seqs.values())   # decoding now
    drafted = engine.metrics.data.num_draft_tokens
    counter = HostSyncs()
    with counter:
        for _ in range(STEPS):
            engine.step()
    if speculative:     # every step drafted k = 3 for each request
        assert engine.metrics.data.num_draft_tokens - drafted == STEPS * 3 * len(params)
    return counter


@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "baseline"])
@pytest.mark.parametrize("attention", ["flex", "fused"])
def test_a_decode_step_reads_the_device_once(make_engine, attention, speculative):
    """The draft's rounds feed their tokens to the next round and to the verify forward on the
    device, and the accept rule reads its result in one transfer. Red when a round's tokens
    come back to the host, when a branch reads a sampling setting off the device, when the
    accepted counts and tokens are read apart, or when a seeded row is indexed by a list."""
    engine = make_engine(draft=speculative, adaptive_k=False, attention=attention)
    counter = _decode_steps(engine, speculative)
    assert sum(counter.reads.values()) == STEPS, counter.reads
    assert sum(counter.uploads.values()) == 0, counter.uploads    # nothing goes up blocking


def test_a_tensor_parallel_step_reads_the_device_once(tiny_family):
    """TP = 2: the verify forward's ids (the drafts, on rank 0's device) go to rank 1 through
    the group, not through a read for the rank message. Red when rank 0 reads them."""
    config = EngineConfig(str(tiny_family["target"]), str(tiny_family["draft"]), tp_size=2,
                          kv_budget_bytes=8 << 20, profile=False, num_threads=1,
                          adaptive_k=False, attention="flex", graphs="static")
    peers = LocalPeers(config)
    try:
        counter = _decode_steps(LLMEngine(config, peers=peers), speculative=True)
    finally:
        peers.close()
    assert sum(counter.reads.values()) == STEPS, counter.reads
    assert sum(counter.uploads.values()) == 0, counter.uploads


def test_the_counter_sees_reads_and_blocking_copies():
    """The tool the test above rests on: red if it misses what it must count."""
    counter = HostSyncs(tests=True)
    x = torch.arange(6)
    with counter:
        x.tolist(), bool(x.any()), int(x.sum()), x[x > 2], x.nonzero()
        torch.tensor([1, 2], device="cpu"), x.to("cpu"), x[[1, 2]]
        upload([1, 2], torch.long, "cpu"), x + 1, x[1], x[1:3]
    assert sum(counter.reads.values()) == 5, counter.reads
    assert sum(counter.uploads.values()) == 3, counter.uploads


def test_upload_and_the_step_clock_on_the_host():
    assert upload([[1, 2], [3, 4]], torch.int32, "cpu").tolist() == [[1, 2], [3, 4]]
    assert upload(torch.arange(3), torch.float32, None).dtype == torch.float32
    clock = StepClock("cpu")
    clock.mark("a")
    clock.mark("b")
    assert clock.seconds("a", "b") >= 0 and clock.seconds("a", "missing") == 0.0


def test_drafts_fed_on_the_device_reach_their_own_rows(make_engine, tiny_family):
    """The target as its own draft, requests of k 1 to 4 side by side, greedy and sampled: every
    draft is accepted. Red when a round feeds another request's token, or the flat drafts
    (round after round on the device) reach the verify forward or the accept rule in another
    order than item after item: output stays lossless then, acceptance does not."""
    engine = make_engine(draft=tiny_family["target"], adaptive_k=False)
    for i in range(4):
        engine.add_request(f"r{i}", [5 + i, 7, 9 + i, 11] * (2 + i),
                           SamplingParams(temperature=0.0 if i % 2 else 1.0, max_tokens=24,
                                          ignore_eos=True),
                           RequestOptions(mode="speculative", k_max=1 + i))
    run_all(engine)
    data = engine.metrics.data
    assert data.num_draft_tokens > 40
    assert data.num_accepted_tokens == data.num_draft_tokens
