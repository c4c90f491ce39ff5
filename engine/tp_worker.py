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

from engine.attention import SeqSlice, token_major
from engine.faults import Faults
from engine.kv_cache import BlockPool
from engine.model_runner import ModelRunner
from models.cpu_linear import plan_dir
from models.loader import load_served

COLLECTIVE_TIMEOUT_S = 30


def init_tp(rank: int, world: int, init_method: str, device: str = "cpu",
            timeout_s: float = COLLECTIVE_TIMEOUT_S):
    """Join the group; returns the all-reduce the row-parallel layers call. NCCL on GPUs (one
    rank a GPU), gloo elsewhere; SPECSERVE_TP_BACKEND=gloo runs several ranks on one GPU (NCCL
    refuses two ranks on one device): for checks, scripts/gpu_tp_check.py."""
    backend = os.environ.get("SPECSERVE_TP_BACKEND") or (
        "nccl" if torch.device(device).type == "cuda" else "gloo")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    return all_reduce


def share_ids(input_ids: torch.Tensor) -> None:
    """Rank 0's side of `receive_ids`: a forward's token ids, from its device to every rank."""
    dist.broadcast(input_ids, src=0)


def receive_ids(count: int, device) -> torch.Tensor:
    """The `count` token ids rank 0 sends with `share_ids`, on this rank's device."""
    input_ids = torch.empty(count, dtype=torch.long, device=device)
    dist.broadcast(input_ids, src=0)
    return input_ids


def resident_bytes(reset_peak: bool = False) -> int:
    """This process's resident memory (VmRSS); `reset_peak` first resets its high-water mark
    (VmHWM), where Linux allows it."""
    if reset_peak:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
    return _status_kib("VmRSS") * 1024


def peak_resident_bytes() -> int:
    return _status_kib("VmHWM") * 1024


def _status_kib(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def leave_group() -> None:
    """Break this process's side of the group, so ranks blocked in a collective with it fail
    instead of waiting out the timeout (a no-op outside a group, or on a broken one)."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def _import_config_classes(path: str) -> None:
    """Import what loading the checkpoint imports (transformers' config classes, read from its
    config), so that what loading then costs is the shard's."""
    from transformers import AutoConfig

    AutoConfig.from_pretrained(path)


def rank_options(config) -> dict:
    """What a rank > 0 is built from (`TPWorker(rank, world, init_method, **rank_options)`), for
    every launcher of ranks (`LocalPeers`, deployments/tp_group.py), from rank 0's EngineConfig:
    the ranks and rank 0 cannot be told different things."""
    return {"target": config.target, "dtype": config.dtype, "device": config.device,
            "attention": config.attention, "num_threads": config.num_threads,
            "max_num_seqs": config.max_num_seqs,
            "fault_injection": config.fault_injection, "row_plan_dir": config.row_plan_dir}


class TPWorker:
    """Rank r > 0: a shard of the target and a KV pool with rank 0's layout and block ids."""

    def __init__(self, rank: int, world: int, init_method: str, target: str, dtype: str,
                 device: str, num_threads: int = 1, attention: str = "fused",
                 fault_injection: bool = False, row_plan_dir: str | None = None,
                 max_num_seqs: int = 256):
        torch.set_num_threads(num_threads)
        self.plan_dir = plan_dir(row_plan_dir)
        all_reduce = init_tp(rank, world, init_method, device)
        self.rank = rank
        _import_config_classes(target)         # a fixed cost of the process, not of the shard
        before = resident_bytes(reset_peak=True)
        self.forward = load_served(target, dtype, device, rank, world, all_reduce,
                                   tokenizer=False).forward
        # what loading cost this process: its peak resident memory above where it started,
        # against the bytes of its shard
        self.load_memory = {"resident_before": before, "peak": peak_resident_bytes(),
                            "shard_bytes": self.forward.weight_bytes()}
        self.device, self.attention, self.max_num_seqs = device, attention, max_num_seqs
        self.pool: BlockPool | None = None
        self.runner: ModelRunner | None = None
        self.failed: str | None = None        # a forward failed here: the group is broken
        self.faults = Faults() if fault_injection else None     # test-only (engine/faults.py)
        if self.faults is not None:
            self._wrap_forward_for_faults()

    def configure_pool(self, tokens_per_block: int, num_blocks: int, dtype: str,
                       graphs: tuple[str, int] | None = None) -> None:
        """Take rank 0's layout: its tokens per block (set by target + draft) and block count,
        and its target's CUDA graphs (mode, scratch block; engine/cuda_graphs.py: every rank pads
        a forward to the same bucket and captures it at the same forward, so the graphs'
        collectives pair up). Ranks in different dtypes would all-reduce tensors of different
        sizes (gloo aborts the process): refused here with both dtypes named. The pool starts
        zeroed, as rank 0's blocks are when handed out."""
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
                              self.forward.dtype, self.device, resident=True,
                              token_major=token_major(self.device, self.attention))
        assert self.pool.num_blocks == num_blocks
        assert self.pool.target.tokens_per_block == tokens_per_block
        self.runner = ModelRunner(self.forward, self.pool.layers(self.pool.target),
                                  attention=self.attention, plan_dir=self.plan_dir,
                                  max_batch=self.max_num_seqs, graphs=graphs)
        self.load_memory["peak_with_kernels"] = peak_resident_bytes()

    def run(self, input_ids: list[int] | int, positions: list[int], seqs: list[tuple],
            zero_blocks: list[int]) -> None:
        """One forward (`engine.model_runner.run_message`; a count of ids: they come through
        the group, `receive_ids`). A failure marks the rank failed;
        its host then ends the process (`_serve`, deployments/tp_group.py), which closes its
        side of the group, so rank 0 and the other ranks stop waiting in their collectives
        (destroying the process group alone leaves its connections open while anything
        still refers to it)."""
        if self.runner is None:
            raise RuntimeError("configure_pool(rank 0's layout) must come before the first run")
        if self.failed:
            raise RuntimeError(f"rank {self.rank} failed earlier ({self.failed}); the group "
                               f"must be rebuilt")
        try:
            self.pool.zero_blocks(zero_blocks)
            if isinstance(input_ids, int):
                input_ids = receive_ids(input_ids, self.device)
            self.runner.hidden([SeqSlice(*s) for s in seqs], input_ids, positions)
        except Exception as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
            raise RuntimeError(f"rank {self.rank}: {self.failed}") from exc

    def inject_fault(self, count: int = 1, after: int = 0) -> None:
        """TEST ONLY: the next `count` forwards (after `after` more) raise mid-forward."""
        if self.faults is None:
            raise RuntimeError("fault injection is off (EngineConfig.fault_injection)")
        self.faults.arm("rank_raise", count, after)

    def fill_pool(self, value: float) -> None:
        """TEST ONLY: write `value` (NaN, say) over this rank's whole KV pool, as stale memory
        would hold it; blocks are zeroed when rank 0 hands them out, so no output may change."""
        if self.faults is None:
            raise RuntimeError("fault injection is off (EngineConfig.fault_injection)")
        self.pool.pool.fill_(value)

    def _wrap_forward_for_faults(self) -> None:
        """Raise an armed fault inside the forward, at the second layer's attention: after the
        first layer's all-reduces, so rank 0 is waiting in a collective when it happens."""
        forward, faults = self.forward.forward, self.faults
        at = min(1, self.forward.shape.num_layers - 1)

        def forward_with_faults(input_ids, positions, attn):
            def attn_or_fault(i, q, k, v):
                if i == at:
                    faults.fire("rank_raise")
                return attn(i, q, k, v)
            return forward(input_ids, positions, attn_or_fault)

        self.forward.forward = forward_with_faults

    def ping(self) -> int:
        return os.getpid()

    def memory(self) -> dict:
        """What loading this rank's shard cost in resident memory (`load_memory`)."""
        return dict(self.load_memory)

    def attention_path(self) -> dict:
        """The attention path this rank's runner took, its pool's layout (`paged_backend`,
        `token_major` in engine/attention.py) and its CUDA graphs' mode: the same as rank 0's;
        and how many forwards ran padded for the graphs (engine/cuda_graphs.py)."""
        graphs = self.runner.graphs
        return {"backend": self.runner.backend, "token_major": self.pool.token_major,
                "graphs": graphs and graphs.mode, "padded": graphs and graphs.forwards}


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
            result = getattr(worker, method)(*args)
        except Exception as e:               # back to rank 0, which raises it
            try:
                conn.send(e)
            except Exception:                # not picklable: its text, then
                conn.send(RuntimeError(f"rank {kwargs['rank']}: {type(e).__name__}: {e}"))
            if worker.failed:                # the group is broken: leave, closing our side
                conn.close()
                os._exit(1)
            continue
        conn.send(True if result is None else result)


class LocalPeers:
    """Ranks 1..N-1 of `config.tp_size` as local processes (spawned), driven over pipes.
    Implements `engine.model_runner.Peers`."""

    def __init__(self, config, port: int | None = None, wait_timeout_s: float = 60.0):
        from models.rendezvous import free_port

        world = config.tp_size
        self.init_method = f"tcp://127.0.0.1:{port or free_port()}"
        self.wait_timeout_s = wait_timeout_s
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(1, world):
            parent, child = ctx.Pipe()
            kwargs = dict(rank=rank, world=world, init_method=self.init_method,
                          **rank_options(config))
            proc = ctx.Process(target=_serve, args=(child, kwargs), daemon=True)
            proc.start()
            child.close()          # the child's end lives in the child: its death is our EOF
            self.conns.append(parent)
            self.procs.append(proc)
        self.all_reduce = init_tp(0, world, self.init_method, config.device)
        for c in self.conns:
            answer = c.recv()
            if answer != "ready":
                self.close()
                raise answer if isinstance(answer, Exception) else RuntimeError(answer)

    def _call(self, method: str, args: tuple, conns=None) -> None:
        for c in conns or self.conns:
            c.send((method, args))

    def configure_pool(self, tokens_per_block: int, num_blocks: int, dtype: str,
                       graphs: tuple[str, int] | None = None) -> None:
        self._call("configure_pool", (tokens_per_block, num_blocks, dtype, graphs))
        self.wait()

    def launch(self, message: tuple) -> None:
        self._call("run", message)

    def share(self, input_ids: torch.Tensor) -> None:
        share_ids(input_ids)

    def wait(self) -> None:
        """Every rank's answer to the last call; the first error is raised once all answered
        (or the wait timed out), so no answer is left behind to be read as the next one's."""
        first = None
        for c in self.conns:
            if not c.poll(self.wait_timeout_s):
                first = first or TimeoutError(f"a rank did not answer in {self.wait_timeout_s}s")
                continue
            try:
                answer = c.recv()
            except EOFError:
                answer = RuntimeError("a rank process died")
            if isinstance(answer, Exception):
                first = first or answer
        if first is not None:
            raise first

    def abort(self) -> None:
        leave_group()

    def inject_fault(self, count: int = 1, after: int = 0) -> None:
        """TEST ONLY: arm rank 1's mid-forward fault (`TPWorker.inject_fault`)."""
        self.call_rank(1, "inject_fault", count, after)

    def call_rank(self, rank: int, method: str, *args):
        """Run `TPWorker.<method>(*args)` on one rank and return what it returns (tests)."""
        conn = self.conns[rank - 1]
        conn.send((method, args))
        answer = conn.recv()
        if isinstance(answer, Exception):
            raise answer
        return answer

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except OSError:                  # that rank is gone already
                pass
        for p in self.procs:
            p.join(timeout=10)
        leave_group()
