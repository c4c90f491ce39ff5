"""Tensor-parallel ranks of the target: the process group and the non-zero ranks' worker.

Owns: joining the group (gloo on CPU, NCCL on GPUs, every collective under a timeout) and
`TPWorker`, which holds one shard of the target and its KV heads and runs the same forward as
rank 0 on the inputs rank 0 sends it. Rank 0 is the engine itself (it also holds the draft and
the block allocator: block ids are decided there and are the same on every rank). Rank 0 also
decides the pool's layout (its blocks hold target and draft KV, which sets the tokens per block)
and hands it to the other ranks (`configure_pool`), which never re-derive it.
Ray-free: `deployments/tp_group.py` runs a TPWorker as a Ray actor; `LocalPeers` runs ranks as
plain processes (tests, a GPU box without Ray).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os

import torch
import torch.distributed as dist

from engine.attention import SeqSlice
from engine.kv_cache import BlockPool
from engine.model_runner import ModelRunner
from models.loader import load_served

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
    """Rank r > 0: a shard of the target and a KV pool with rank 0's layout and block ids."""

    def __init__(self, rank: int, world: int, init_method: str, target: str, dtype: str,
                 device: str, num_threads: int = 1, attention: str = "fused"):
        torch.set_num_threads(num_threads)
        all_reduce = init_tp(rank, world, init_method, device)
        self.forward = load_served(target, dtype, device, rank, world, all_reduce,
                                   tokenizer=False).forward
        self.device, self.attention = device, attention
        self.pool: BlockPool | None = None
        self.runner: ModelRunner | None = None

    def configure_pool(self, tokens_per_block: int, num_blocks: int, dtype: str) -> None:
        """Take rank 0's layout: its tokens per block (set by target + draft) and block count.
        Ranks in different dtypes would all-reduce tensors of different sizes (gloo aborts the
        process): refused here with both dtypes named."""
        mine = str(self.forward.dtype).removeprefix("torch.")
        if mine != dtype:
            raise ValueError(f"tensor-parallel rank runs {mine} but rank 0 runs {dtype}: give "
                             f"every rank the same dtype")
        s = self.forward.shape
        layout = (s.num_layers, s.num_kv_heads, s.head_dim)
        block_bytes = (tokens_per_block * 2 * s.num_layers * s.num_kv_heads * s.head_dim
                       * torch.empty((), dtype=self.forward.dtype).element_size())
        # A target-only pool whose block is exactly tokens_per_block of this rank's KV heads.
        self.pool = BlockPool(num_blocks * block_bytes, layout, tokens_per_block,
                              self.forward.dtype, self.device)
        assert self.pool.num_blocks == num_blocks
        assert self.pool.target.tokens_per_block == tokens_per_block
        self.runner = ModelRunner(self.forward, self.pool.layers(self.pool.target),
                                  attention=self.attention)

    def run(self, input_ids: list[int], positions: list[int], seqs: list[tuple]) -> None:
        if self.runner is None:
            raise RuntimeError("configure_pool(rank 0's layout) must come before the first run")
        self.runner.hidden([SeqSlice(*s) for s in seqs], input_ids, positions)

    def ping(self) -> int:
        return os.getpid()


def _serve(conn, kwargs) -> None:
    try:
        worker = TPWorker(**kwargs)
    except Exception as e:                   # rank 0 raises it instead of waiting for "ready"
        conn.send(RuntimeError(f"rank {kwargs['rank']} failed to start: {type(e).__name__}: {e}"))
        return
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        method, args = msg
        try:
            getattr(worker, method)(*args)
        except Exception as e:               # back to rank 0, which raises it
            try:
                conn.send(e)
            except Exception:                # not picklable: its text, then
                conn.send(RuntimeError(f"rank {kwargs['rank']}: {type(e).__name__}: {e}"))
            continue
        conn.send(True)


class LocalPeers:
    """Ranks 1..N-1 as local processes (spawned), driven over pipes. Implements `Peers`."""

    def __init__(self, world: int, target: str, dtype: str = "auto", device: str = "cpu",
                 port: int = 29511, attention: str = "fused"):
        self.init_method = f"tcp://127.0.0.1:{port}"
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(1, world):
            parent, child = ctx.Pipe()
            kwargs = dict(rank=rank, world=world, init_method=self.init_method, target=target,
                          dtype=dtype, device=device, attention=attention)
            proc = ctx.Process(target=_serve, args=(child, kwargs), daemon=True)
            proc.start()
            child.close()          # the child's end lives in the child: its death is our EOF
            self.conns.append(parent)
            self.procs.append(proc)
        self.all_reduce = init_tp(0, world, self.init_method, device)
        for c in self.conns:
            answer = c.recv()
            if answer != "ready":
                self.close()
                raise answer if isinstance(answer, Exception) else RuntimeError(answer)

    def configure_pool(self, tokens_per_block: int, num_blocks: int, dtype: str) -> None:
        for c in self.conns:
            c.send(("configure_pool", (tokens_per_block, num_blocks, dtype)))
        self.wait()

    def launch(self, input_ids, positions, seqs) -> None:
        msg = (input_ids, positions, [(s.block_table, s.num_cached, s.num_query, s.prefill_align)
                                        for s in seqs])
        for c in self.conns:
            c.send(("run", msg))

    def wait(self) -> None:
        for c in self.conns:
            answer = c.recv()
            if isinstance(answer, Exception):
                raise answer

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except OSError:                  # that rank is gone already
                pass
        for p in self.procs:
            p.join(timeout=10)
        if dist.is_initialized():
            dist.destroy_process_group()
