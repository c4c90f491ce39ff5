"""One model's forward over the paged KV cache: token ids in, logits for chosen rows out.

Owns: packing a ragged batch into flat tensors and running the model's forward with paged
attention. With tensor parallelism the same inputs go to every rank (`peers`), each runs its
shard, and rank 0 (this process) reads the logits. Does not own: sampling or scheduling.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

from engine.attention import PagedAttention, SeqSlice, paged_backend
from engine import cpu_attention, cpu_ops, flex_attention
from engine.cuda_graphs import DecodeGraphs, graph_buckets
from engine.errors import TPGroupError
from engine.flex_attention import FlexPages
from engine.host_sync import upload

logger = logging.getLogger(__name__)


def run_message(input_ids: list[int] | torch.Tensor, positions: list[int],
                seqs: list[SeqSlice], zero_blocks: list[int]) -> tuple:
    """What rank 0 sends every other rank for one forward (`TPWorker.run` takes it as is):
    the tokens (a host list; for tokens on rank 0's device, such as a draft's, their count:
    the tokens follow through the group, `Peers.share`), each sequence's slice, and the blocks
    rank 0 zeroed since the last forward."""
    return (input_ids if isinstance(input_ids, list) else len(input_ids), positions,
            [(s.block_table, s.num_cached, s.num_query, s.prefill_align) for s in seqs],
            zero_blocks)


class Peers(Protocol):
    """The other ranks of a tensor-parallel group (`LocalPeers` in engine/tp_worker.py, `RayPeers`
    in deployments/tp_group.py)."""

    def configure_pool(self, tokens_per_block: int, num_blocks: int, dtype: str,
                       graphs: tuple[str, int] | None = None) -> None:
        """Give every rank rank 0's KV pool layout and its target's CUDA graphs (mode, scratch
        block) (called once, before the first forward); a rank whose weights are in another
        dtype than rank 0's (`dtype`) refuses."""

    def launch(self, message: tuple) -> None:
        """Start the forward `message` (`run_message`) on every other rank."""

    def share(self, input_ids: torch.Tensor) -> None:
        """Send the forward's token ids, on rank 0's device, to every other rank through the
        group (a broadcast), after `launch`: the host never reads them (docs/decisions/0038)."""

    def wait(self) -> None:
        """Wait for the forward on every other rank; raise the first rank's error."""

    def abort(self) -> None:
        """Break this process's side of the group, so a rank blocked in a collective fails at
        once instead of after the collective timeout."""


class ModelRunner:
    def __init__(self, forward, layers: list[tuple[torch.Tensor, torch.Tensor]],
                 peers: Peers | None = None, attention: str = "fused",
                 zeroed: Callable[[], list[int]] | None = None, plan_dir=None,
                 max_batch: int = 256, graphs: tuple[str, int] | None = None):
        self.forward = forward            # models.llama.LlamaForward
        self.layers = layers              # per layer (K, V) views of the pool (BlockPool.layers)
        self.peers = peers
        self.zeroed = zeroed              # with peers: the blocks zeroed since the last forward
        self.scale = forward.shape.head_dim ** -0.5
        self.device = forward.device
        self.workspace: dict = {}         # attention's gather buffers, reused across steps
        # decode and verify groups (engine/attention.py: paged_backend): on CPU the fused
        # kernel (engine/cpu_attention.py: bitwise batch-invariant rows), on a GPU FlexAttention
        # over the pool in place (engine/flex_attention.py), else gather + SDPA
        self.backend = paged_backend(self.device, attention)
        if self.backend == "sdpa" and attention != "sdpa" and self.device.type != "cpu":
            logger.warning("FlexAttention unavailable (%s): decode and verify gather their KV "
                           "into a padded buffer every layer and step, an estimated 2.5x the "
                           "weight-bound step at batch 32 x 1k context (docs/decisions/0037)",
                           flex_attention.missing())
        if self.backend == "fused":
            self._build_fused()
        self.flex = self._flex_pages(max_batch) if self.backend == "flex" else None
        # (mode, scratch block): decode and verify forwards from CUDA graphs (every rank of a
        # tensor-parallel group takes rank 0's, engine/cuda_graphs.py: graph_plan)
        self.graphs = (DecodeGraphs(forward, layers, self.flex, self.scale, graphs[1], graphs[0])
                       if graphs and self.flex is not None else None)
        forward.build_kernels(plan_dir)

    def _flex_pages(self, max_batch: int) -> FlexPages | None:
        try:
            shape = self.forward.shape
            return FlexPages(self.layers, max_batch, compiled=self.device.type == "cuda",
                             group=shape.num_heads // shape.num_kv_heads)
        except ValueError as exc:          # a pool this model cannot be read from in place
            logger.warning("FlexAttention off for this model (%s): decode gathers its KV", exc)
            self.backend = "sdpa"
            return None

    def warm_up(self, pool, owner: str, modes: tuple[str, ...] = ("capture",)) -> int:
        """Run every graph bucket twice now, largest first, on blocks taken from `pool` (the
        `owner` model's layout) for the while: each bucket's kernels compile and its graph is
        captured at start (as vLLM and SGLang capture theirs), not at its first two forwards in
        serving, where a compile stalls every running request. A bucket needing more blocks
        than are free is left out (no step can reach it). Under tensor parallelism every rank
        runs the same forwards. Only for graphs in `modes`; returns the buckets run."""
        if self.graphs is None or self.graphs.mode not in modes:
            return 0
        start, tpb, done = time.perf_counter(), getattr(pool, owner).tokens_per_block, 0
        for batch, q in graph_buckets(self.graphs.flex.max_batch):
            per = -(-q // tpb)                   # blocks a sequence of q tokens needs
            if batch * per > pool.num_free:
                continue
            blocks = pool.allocate(batch * per, owner)
            seqs = [SeqSlice(blocks[i * per:(i + 1) * per], 0, q) for i in range(batch)]
            for _ in range(2):                   # eager (its kernels build), then captured
                self.run(seqs, [0] * (batch * q), list(range(q)) * batch, [0])
            pool.free(blocks, owner)
            done += 1
        logger.info("CUDA graphs of the %s: %d buckets built and captured in %.1f s", owner,
                    done, time.perf_counter() - start)
        return done

    @torch.inference_mode()
    def _build_fused(self) -> None:
        """Build the CPU kernels for this model's dtype and head size now (attention, the KV
        write and the forward's elementwise steps, `engine/cpu_ops.py`; a cold build takes ~5 s
        each, inductor's on-disk cache then well under a second a process), not in the middle
        of serving, and find out whether they can be built here at all."""
        dtype, d = self.layers[0][0].dtype, self.layers[0][0].shape[-1]
        if not (cpu_attention.build(dtype, d) and cpu_ops.build(dtype)):
            self.backend = "sdpa"                    # cannot build them here: gather + SDPA
        self.forward.ops = cpu_ops if self.fused else None

    @property
    def fused(self) -> bool:
        """Decode and verify rows run the CPU kernel (engine/cpu_attention.py)."""
        return self.backend == "fused"

    @torch.inference_mode()
    def run(self, seqs: list[SeqSlice], input_ids: list[int] | torch.Tensor,
            positions: list[int], logit_rows: list[int]) -> torch.Tensor:
        """Feed `input_ids` (flat, sequence after sequence; a host list, or a tensor on this
        runner's device such as the draft's last tokens) -> logits [len(logit_rows), vocab]."""
        if self.peers is None:
            hidden = self.hidden(seqs, input_ids, positions)
        else:
            hidden = self._group_forward(seqs, input_ids, positions)
        return self.forward.logits(hidden[upload(logit_rows, torch.long, self.device)])

    def _group_forward(self, seqs, input_ids, positions) -> torch.Tensor:
        """The forward on every rank. A failure on any rank fails the group for good
        (`TPGroupError`): a rank that stopped mid-forward leaves the others' collectives out of
        step, and a later forward would pair its all-reduces with theirs."""
        zero = self.zeroed() if self.zeroed is not None else []
        try:
            self.peers.launch(run_message(input_ids, positions, seqs, zero))
            if isinstance(input_ids, torch.Tensor):      # on the device: sent, not read
                input_ids = upload(input_ids, torch.long, self.device).contiguous()
                self.peers.share(input_ids)
            hidden = self.hidden(seqs, input_ids, positions)
        except Exception as exc:
            self.peers.abort()                  # ranks blocked in an all-reduce fail now
            try:
                self.peers.wait()
            except Exception as rank_exc:       # the rank that failed first says why
                raise TPGroupError(f"tensor-parallel forward failed: {rank_exc}") from exc
            raise TPGroupError(f"tensor-parallel forward failed on rank 0: {exc!r}") from exc
        try:
            self.peers.wait()
        except Exception as exc:
            self.peers.abort()
            raise TPGroupError(f"tensor-parallel forward failed: {exc}") from exc
        return hidden

    @torch.inference_mode()
    def hidden(self, seqs: list[SeqSlice], input_ids: list[int] | torch.Tensor,
               positions: list[int]) -> torch.Tensor:
        """The forward alone (what every rank of a tensor-parallel group runs)."""
        if self.graphs is not None:
            hidden = self.graphs.hidden(seqs, input_ids, positions)
            if hidden is not None:
                return hidden
        ids = upload(input_ids, torch.long, self.device)
        pos = upload(positions, torch.long, self.device)
        attn = PagedAttention(self.layers, seqs, self.scale, self.workspace, fused=self.fused,
                              flex=self.flex)
        return self.forward.forward(ids, pos, attn)
