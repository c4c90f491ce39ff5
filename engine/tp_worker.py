"""Tensor-parallel ranks of the target: the process group and the non-zero ranks' worker.

Owns: joining the group (gloo on CPU, NCCL on GPUs, every collective under a timeout) and
`TPWorker`, which holds one shard of the target and its KV heads and runs the same forward as
rank 0 on the inputs rank 0 sends it. Rank 0 is the engine itself (it also holds the draft and
the block allocator: block ids are decided there and are the same on every rank).
Ray-free: `deployments/tp_group.py` runs a TPWorker as a Ray actor; `LocalPeers` runs ranks as
plain processes (tests, a GPU box without Ray).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os

import torch
import torch.distributed as dist
from transformers import AutoConfig

from engine.attention import SeqSlice
from engine.kv_cache import BlockPool
from engine.model_runner import ModelRunner
from models.llama import LlamaForward, LlamaShape
from models.loader import load_model

COLLECTIVE_TIMEOUT_S = 30


def init_tp(rank: int, world: int, init_method: str, device: str = "cpu",
            timeout_s: float = COLLECTIVE_TIMEOUT_S):
    """Join the group; returns the all-reduce the row-parallel layers call."""
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    return all_reduce


class TPWorker:
    """Rank r > 0: a shard of the target and a KV pool with the same block ids as rank 0."""

    def __init__(self, rank: int, world: int, init_method: str, target: str, dtype: str,
                 device: str, kv_budget_bytes: int, block_size: int, num_threads: int = 1,
                 draft: str | None = None):
        torch.set_num_threads(num_threads)
        all_reduce = init_tp(rank, world, init_method, device)
        model = load_model(target, dtype, device)
        self.forward = LlamaForward(model.model, rank, world, all_reduce)
        del model
        s = self.forward.shape
        layout = (s.num_layers, s.num_kv_heads, s.head_dim)
        # The same budget and block layout as rank 0 (whose pool also holds the draft, which
        # sets the tokens per block), hence the same number of blocks and the same block ids.
        draft_layout = None
        if draft:
            d = LlamaShape.from_config(AutoConfig.from_pretrained(draft))
            draft_layout = (d.num_layers, d.num_kv_heads, d.head_dim)
        self.pool = BlockPool(kv_budget_bytes, layout, block_size, self.forward.dtype, device,
                              draft_layout)
        self.runner = ModelRunner(self.forward, self.pool.view(self.pool.target))
        # (Rank 0 decides block ids; this pool has the same count and layout, target only.)

    def run(self, input_ids: list[int], positions: list[int], seqs: list[tuple]) -> None:
        self.runner.hidden([SeqSlice(*s) for s in seqs], input_ids, positions)

    def ping(self) -> int:
        return os.getpid()


def _serve(conn, kwargs) -> None:
    worker = TPWorker(**kwargs)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        worker.run(*msg)
        conn.send(True)


class LocalPeers:
    """Ranks 1..N-1 as local processes (spawned), driven over pipes. Implements `Peers`."""

    def __init__(self, world: int, target: str, dtype: str = "float32", device: str = "cpu",
                 kv_budget_bytes: int = 64 << 20, block_size: int = 16, port: int = 29511,
                 draft: str | None = None):
        self.init_method = f"tcp://127.0.0.1:{port}"
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(1, world):
            parent, child = ctx.Pipe()
            kwargs = dict(rank=rank, world=world, init_method=self.init_method, target=target,
                          dtype=dtype, device=device, kv_budget_bytes=kv_budget_bytes,
                          block_size=block_size, draft=draft)
            proc = ctx.Process(target=_serve, args=(child, kwargs), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self.all_reduce = init_tp(0, world, self.init_method, device)
        for c in self.conns:
            assert c.recv() == "ready"

    def launch(self, input_ids, positions, seqs) -> None:
        msg = (input_ids, positions, [(s.block_table, s.num_cached, s.num_query) for s in seqs])
        for c in self.conns:
            c.send(msg)

    def wait(self) -> None:
        for c in self.conns:
            c.recv()

    def close(self) -> None:
        for c in self.conns:
            c.send(None)
        for p in self.procs:
            p.join(timeout=10)
        if dist.is_initialized():
            dist.destroy_process_group()
