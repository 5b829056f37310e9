"""The pieces the drafters share (eagle3.py's Llama attention, mla.py's latent attention, dflash.py's blocks):
Llama's RMSNorm, RoPE tables computed from position ids, and the draft vocabulary's maps."""

from __future__ import annotations

import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in float32 (bf16 sums of squares are too coarse),
    cast back to the input dtype, then scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Default Llama RoPE tables for arbitrary positions.

    position_ids [B, T] -> cos, sin [B, T, head_dim], float32.
    Computed on the fly rather than kept in a buffer: a buffer would be cast by
    `model.to(torch.bfloat16)`, and bf16 frequencies give visibly wrong angles
    at large positions. The cost is a [B, T, head_dim/2] outer product.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device,
                                             dtype=torch.int64).float() / head_dim))
    freqs = position_ids.float()[..., None] * inv_freq  # [B, T, head_dim/2]
    # rotate_half convention: the two halves of a head share frequencies
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, head_dim]; cos, sin [B, T, head_dim]."""
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    return x * cos + rotate_half(x) * sin


def register_vocab_maps(module: nn.Module, draft_vocab_size: int, vocab_size: int) -> None:
    """The draft vocabulary's buffers, as vLLM reads them: d2t [Dv] int64 (draft id i is target id i + d2t[i]) and
    t2d [V] bool (which target ids are in the draft vocabulary); the identity on the first Dv ids until
    init.init_from_target sets them."""
    module.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[:draft_vocab_size] = True
    module.register_buffer("t2d", t2d)
