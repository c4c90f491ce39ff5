"""One model's forward over the paged KV cache: token ids in, logits for chosen rows out.

Owns: packing a ragged batch into flat tensors and running the model's forward with paged
attention. With tensor parallelism the same inputs go to every rank (`peers`), each runs its
shard, and rank 0 (this process) reads the logits. Does not own: sampling or scheduling.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch

from engine.attention import PagedAttention, SeqSlice, paged_backend
from engine import cpu_attention, cpu_ops, flex_attention
from engine.cuda_graphs import DecodeGraphs
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
