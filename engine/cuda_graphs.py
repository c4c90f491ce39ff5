"""Decode and verify forwards replayed from CUDA graphs (docs/decisions/0039-cuda-graphs.md).

A forward of decode and verify sequences on FlexAttention's path (a GPU's) is captured once per
shape bucket and replayed: one launch for the whole forward instead of a few kernels per layer.
A bucket is (batch, query tokens): the batch padded to a power of two, query tokens to 1 (decode,
a draft's round) or 8 (verify, a draft's first round); the forward then runs batch x query
tokens + 1 token (at least one padding token, whose attention output row takes the pads). The
padding tokens write their KV into a scratch block no sequence holds.

Everything the captured kernels read is rewritten in place before a replay: the token ids and
positions (`DecodeGraphs`' buffers), the KV write's slots and the block mask's buffers
(`FlexPages`; `PagedAttention(pad=...)` writes them). A bucket is run eagerly the first time it
occurs (its kernels compile then), and captured the second time. Where graphs are captured, the
engine runs every bucket twice at start (`ModelRunner.warm_up`), so serving only replays.

`mode`: "capture" records graphs (CUDA); "static" runs the same padded forward over the same
buffers without capturing, on any device (the CPU tests' path: what a replay computes, and
where a failed capture leaves a runner).
"""

from __future__ import annotations

import logging

import torch

from engine.attention import PagedAttention, SeqSlice, paged_backend
from engine.flex_attention import FlexPages, bucket
from engine.host_sync import upload

logger = logging.getLogger(__name__)

GRAPH_QUERY_BUCKETS = (1, 8)    # query tokens a sequence, padded; longer forwards run eagerly
_POOL: list = []                # the process's graph memory pool, made at the first capture


def graph_buckets(max_batch: int) -> list[tuple[int, int]]:
    """Every (batch, query tokens) bucket of a runner whose groups hold up to `max_batch`
    sequences, largest first."""
    batches = sorted({bucket(n, max_batch) for n in range(1, max_batch + 1)}, reverse=True)
    return [(b, q) for b in batches for q in reversed(GRAPH_QUERY_BUCKETS)]


def _shared_pool():
    """One memory pool for every runner's graphs (the target's, the draft's, a swapped draft's):
    they replay one at a time and each forward's output is read before the next replay, so one
    graph's intermediates may reuse another's (engine/memory.py: graph_pool_bytes plans it)."""
    if not _POOL:
        _POOL.append(torch.cuda.graph_pool_handle())
    return _POOL[0]


class DecodeGraphs:
    def __init__(self, forward, layers, flex: FlexPages, scale: float, scratch_block: int,
                 mode: str):
        if mode not in ("capture", "static"):
            raise ValueError(f"graph mode {mode!r}: capture or static")
        self.forward, self.layers, self.flex, self.scale = forward, layers, flex, scale
        self.scratch, self.mode = scratch_block, mode
        size = flex.max_batch * GRAPH_QUERY_BUCKETS[-1] + 1
        self.ids = torch.zeros(size, dtype=torch.long, device=flex.device)
        self.pos = torch.zeros(size, dtype=torch.long, device=flex.device)
        self.seen: set[tuple[int, int]] = set()            # buckets run once (kernels built)
        self.graphs: dict[tuple[int, int], tuple] = {}     # bucket -> (graph, hidden output)
        self.pool = _shared_pool() if mode == "capture" else None
        self.forwards = 0                                  # forwards run padded (or replayed)

    def bucket(self, seqs: list[SeqSlice]) -> tuple[int, int] | None:
        """(batch, query tokens) of a forward that can be padded, else None."""
        qmax = max(s.num_query for s in seqs)
        if any(s.prefill_align for s in seqs) or qmax > GRAPH_QUERY_BUCKETS[-1]:
            return None
        batch = bucket(len(seqs), self.flex.max_batch)
        if batch > self.flex.max_batch:
            return None
        return batch, next(q for q in GRAPH_QUERY_BUCKETS if q >= qmax)

    def hidden(self, seqs: list[SeqSlice], input_ids, positions: list[int]) -> torch.Tensor | None:
        """The forward's hidden states [num_tokens, hidden] from the bucket's graph (None: this
        forward is not one a graph takes; run it eagerly)."""
        key = self.bucket(seqs)
        if key is None:
            return None
        n, size = len(positions), key[0] * key[1] + 1
        ids, pos = self.ids[:size], self.pos[:size]
        ids[:n].copy_(upload(input_ids, torch.long, ids.device))
        pos[:n].copy_(upload(positions, torch.long, pos.device))
        ids[n:].zero_()
        pos[n:].zero_()
        attn = PagedAttention(self.layers, seqs, self.scale, flex=self.flex,
                              pad=(size, self.scratch))
        self.forwards += 1
        if key in self.graphs:
            graph, out = self.graphs[key]
            graph.replay()
            return out[:n]
        if self.mode == "capture" and key in self.seen:
            out = self._capture(key, ids, pos, attn)
            if out is not None:
                return out[:n]
        self.seen.add(key)
        return self.forward.forward(ids, pos, attn)[:n]

    def _capture(self, key, ids, pos, attn) -> torch.Tensor | None:
        """Record the bucket's forward (its inputs already written) and replay it once."""
        graph = torch.cuda.CUDAGraph()
        try:
            # a forward on a side stream first, as torch's capture needs (lazy per-stream set-up)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.forward.forward(ids, pos, attn)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.forward.forward(ids, pos, attn)
        except Exception:           # capture refused (an op that syncs, say)
            # Padded forwards from now on, uncaptured: under tensor parallelism the other
            # ranks' all-reduces (replayed or not) carry the padded shapes, so this rank's must
            logger.exception("CUDA graph capture of bucket %s failed: forwards run padded "
                             "without graphs", key)
            self.mode = "static"
            return None
        self.graphs[key] = graph, out
        graph.replay()
        return out


def graph_mode(setting: str, device, attention: str, collectives: str | None = None) -> str | None:
    """How one runner takes graphs (`EngineConfig.graphs`): "capture" ("auto" on a GPU's
    FlexAttention path, where the runner's forward has no collectives or NCCL's, which a graph
    records), "static", or None (no graphs). `collectives`: the backend of the runner's
    tensor-parallel group (`torch.distributed.get_backend()`), None at one rank."""
    if setting == "off" or paged_backend(device, attention) != "flex":
        return None
    if setting == "static":
        return "static"
    cuda = torch.device(device).type == "cuda"
    return "capture" if cuda and collectives in (None, "nccl") else None


def graph_plan(setting: str, device, attention: str, collectives: str | None,
               pool) -> tuple[tuple[str, int] | None, tuple[str, int] | None]:
    """(target's, draft's) (mode, scratch block) for an engine's runners, None where a runner
    takes no graphs (`graph_mode`). The draft runs on rank 0 alone, so its forward has no
    collectives. One scratch block serves both (each block holds both models' KV), reserved
    from `pool` only when some runner takes graphs; the target's plan is every rank's."""
    modes = (graph_mode(setting, device, attention, collectives),
             graph_mode(setting, device, attention))
    if modes == (None, None):
        return None, None
    scratch = pool.reserve()
    return tuple(None if m is None else (m, scratch) for m in modes)
