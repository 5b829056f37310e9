"""Multi-head latent attention for the drafter's layers, as vLLM's `deepseek_eagle3` builds it for an
MLA target (DeepSeek-V3, Kimi-K2, Kimi-K2.5): `DeepseekV2MLAAttention` whose projections read `in_dim`
wide inputs (2H = [emb | hidden] in the first layer, H after).

    q_a_proj [q_lora_rank, in], q_a_layernorm, q_b_proj [heads*(nope+rope), q_lora_rank]
        (or q_proj [heads*(nope+rope), in] when q_lora_rank is None)
    kv_a_proj_with_mqa [kv_lora_rank + rope, in]: the latent and one rotated key shared by all heads
    kv_a_layernorm [kv_lora_rank], kv_b_proj [heads*(nope+v), kv_lora_rank]: per-head keys and values
    o_proj [H, heads*v]

Parameter names are vLLM's, so the export is one-to-one (vLLM fuses q_a_proj and kv_a_proj_with_mqa into
its fused_qkv_a_proj on load). The computation is the "naive" form (keys and values expanded per head);
vLLM's absorbed form computes the same function.

Gotcha: DeepSeek's RoPE is interleaved (GPT-J style, vLLM's is_neox_style=False: dimensions 2i and 2i+1
form a pair). The rotated parts are de-interleaved here (evens, then odds) and rotated Llama-style, which
gives the same dot products as long as queries and keys are permuted alike; the softmax scale is
(nope + rope) ** -0.5, vLLM's for a drafter without yarn scaling.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from draftsmith.model.config import DrafterConfig
from draftsmith.model.parts import RMSNorm, apply_rope
from draftsmith.model.ttt import FlexTTTMask, TTTMask


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., d] with pairs (2i, 2i+1) -> [..., d] with the evens first, then the odds."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MLAAttention(nn.Module):
    def __init__(self, config: DrafterConfig, in_dim: int) -> None:
        super().__init__()
        c = config
        self.n_heads = c.num_attention_heads
        self.nope, self.rope, self.v_dim, self.kv_rank = (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                                                          c.kv_lora_rank)
        qk = self.nope + self.rope
        if c.q_lora_rank:
            self.q_a_proj = nn.Linear(in_dim, c.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, self.n_heads * qk, bias=False)
        else:
            self.q_proj = nn.Linear(in_dim, self.n_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(in_dim, self.kv_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_rank, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, c.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: "torch.Tensor | TTTMask | FlexTTTMask",
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x [B, T, in_dim]; cos, sin [B, T, rope]; past: keys [B, heads, P, nope+rope] and values
        [B, heads, P, v] placed before the new ones; mask as Eagle3Attention's.

        Returns the output [B, T, H] and this call's keys and values (rotated, per head)."""
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_a_proj") else self.q_proj(x)
        q = q.view(B, T, self.n_heads, self.nope + self.rope).transpose(1, 2)  # [B, heads, T, nope+rope]
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, self.n_heads, self.nope + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.v_dim], dim=-1)  # [B, heads, T, *]
        q_pe = apply_rope(deinterleave(q_pe), cos, sin)
        k_pe = apply_rope(deinterleave(k_pe).unsqueeze(1), cos, sin)  # [B, 1, T, rope]: one key for all heads
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(B, self.n_heads, T, self.rope)], dim=-1)
        v = v.contiguous()
        keys, values = k, v
        if past is not None:
            keys = torch.cat([past[0].to(k.dtype), k], dim=2)
            values = torch.cat([past[1].to(v.dtype), v], dim=2)
        if isinstance(mask, (TTTMask, FlexTTTMask)):
            y = mask.attend(q, keys, values)
        else:
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.v_dim)
        return self.o_proj(y), (k, v)
