"""One model's forward over the paged KV cache: token ids in, logits for chosen rows out.

Owns: packing a ragged batch into flat tensors and running the model's forward with paged
attention. With tensor parallelism the same inputs go to every rank (`peers`), each runs its
shard, and rank 0 (this process) reads the logits. Does not own: sampling or scheduling.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.attention import PagedAttention, SeqSlice
from engine import cpu_attention, cpu_ops


class Peers(Protocol):
    """The other ranks of a tensor-parallel group (see deployments/tp_group.py)."""

    def configure_pool(self, tokens_per_block: int, num_blocks: int, dtype: str) -> None:
        """Give every rank rank 0's KV pool layout (called once, before the first forward);
        a rank whose weights are in another dtype than rank 0's (`dtype`) refuses."""

    def launch(self, input_ids: list[int], positions: list[int], seqs: list[SeqSlice]) -> None: ...

    def wait(self) -> None: ...


class ModelRunner:
    def __init__(self, forward, layers: list[tuple[torch.Tensor, torch.Tensor]],
                 peers: Peers | None = None, attention: str = "fused"):
        self.forward = forward            # models.llama.LlamaForward
        self.layers = layers              # per layer (K, V) views of the pool (BlockPool.layers)
        self.peers = peers
        self.scale = forward.shape.head_dim ** -0.5
        self.device = forward.device
        self.workspace: dict = {}         # attention's gather buffers, reused across steps
        # attention "fused": every decode and verify group on CPU runs the fused kernel
        # (engine/cpu_attention.py: bitwise batch-invariant rows); False: gather + SDPA.
        self.fused = attention == "fused" and self.device.type == "cpu"
        if self.fused:
            self._build_fused()

    @torch.inference_mode()
    def _build_fused(self) -> None:
        """Build the CPU kernels for this model's dtype and head size now (attention, the KV
        write and the forward's elementwise steps, `engine/cpu_ops.py`; a cold build takes ~5 s
        each, inductor's on-disk cache then well under a second a process), not in the middle
        of serving, and find out whether they can be built here at all."""
        dtype, d = self.layers[0][0].dtype, self.layers[0][0].shape[-1]
        if not (cpu_attention.build(dtype, d) and cpu_ops.build(dtype)):
            self.fused = False                       # cannot build them here: gather + SDPA
        self.forward.ops = cpu_ops if self.fused else None

    @torch.inference_mode()
    def run(self, seqs: list[SeqSlice], input_ids: list[int], positions: list[int],
            logit_rows: list[int]) -> torch.Tensor:
        """Feed `input_ids` (flat, sequence after sequence) -> logits [len(logit_rows), vocab]."""
        if self.peers is not None:
            self.peers.launch(input_ids, positions, seqs)
        hidden = self.hidden(seqs, input_ids, positions)
        if self.peers is not None:
            self.peers.wait()
        rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        return self.forward.logits(hidden[rows])

    @torch.inference_mode()
    def hidden(self, seqs: list[SeqSlice], input_ids: list[int], positions: list[int]) -> torch.Tensor:
        """The forward alone (what every rank of a tensor-parallel group runs)."""
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        attn = PagedAttention(self.layers, seqs, self.scale, self.workspace, fused=self.fused)
        return self.forward.forward(ids, pos, attn)
