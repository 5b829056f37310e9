"""DFlash (block drafting, arXiv:2602.06036): one forward drafts a whole block of tokens with non-causal
attention, conditioned on the target's states through every layer's keys and values.

As vLLM 0.32 serves it (`DFlashQwen3ForCausalLM`, method dflash): after a verification, the block is the bonus
token (the target's next token, the "anchor") at its position p, then K mask tokens at p+1 .. p+K; the block
attends to itself in both directions and to the context: hidden_norm(fc(the target's concatenated aux states)) of
every verified position < p, projected by each layer's own k_proj/v_proj (with its k_norm and RoPE) straight into
that layer's keys and values. The context never runs through the layers. Slot k's output predicts the token at
p + k (slot 0, the anchor, predicts nothing).

Parameter names are vLLM's (Qwen3 layers, with per-head q_norm/k_norm):

    embed_tokens.weight   [V, H]   frozen copy of the target's (not exported: vLLM shares the target's)
    fc.weight             [H, A*H]
    hidden_norm.weight    [H]
    layers.N.self_attn.{q,k,v,o}_proj.weight, layers.N.self_attn.{q,k}_norm.weight [head_dim]
    layers.N.mlp.{gate,up,down}_proj.weight, layers.N.{input_layernorm,post_attention_layernorm}.weight
    norm.weight, lm_head.weight [Dv, H], d2t, t2d (as EAGLE-3's)

Two forwards: `block_forward` (training: many anchors per row at once, each block seeing the context before its
anchor) and `draft` (serving: one block after a DrafterCache of context keys/values, as vLLM runs it); tested
equal. The block size is num_speculative_tokens + 1; a DFlash drafter is served at the K it was trained with,
since every slot sees the whole block.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from draftsmith.model.config import DrafterConfig
from draftsmith.model.eagle3 import DrafterCache, Eagle3MLP
from draftsmith.model.parts import RMSNorm, apply_rope, register_vocab_maps, rope_cos_sin


class DFlashAttention(nn.Module):
    """Qwen3 attention (q_norm, k_norm per head) over [the context's keys | the block's keys]."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        H, hd = config.hidden_size, config.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(H, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(H, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> rotated keys and values [B, kv_heads, T, head_dim] (the context's, or the block's)."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                context: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] the block's states; context keys/values [B, kv_heads, C, head_dim]; mask bool
        [B or 1, 1, T, C+T] (True: may attend) -> [B, T, H]."""
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        keys, values = self.keys_values(x, cos, sin)
        if context is not None:  # None: no context yet
            keys = torch.cat([context[0].to(keys.dtype), keys], dim=2)
            values = torch.cat([context[1].to(values.dtype), values], dim=2)
        group = self.n_heads // self.n_kv_heads
        if group > 1:
            keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class DFlashLayer(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = Eagle3MLP(config)

    def forward(self, x, cos, sin, context, mask):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, context, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        if config.mask_token_id is None or not config.block_size:
            raise ValueError("a DFlash drafter needs mask_token_id and block_size")
        if config.attention != "gqa":
            raise ValueError("a DFlash drafter has Qwen3 (gqa) attention; vLLM 0.32 serves no MLA DFlash")
        self.config = config
        H = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, never trained
        self.fc = nn.Linear(config.num_aux_layers * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        register_vocab_maps(self, config.draft_vocab_size, config.vocab_size)

    def draft_ids(self) -> torch.Tensor:
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def context(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[B, C, A*H] the target's concatenated states -> [B, C, H], what every layer projects its keys and values
        of the context from."""
        return self.hidden_norm(self.fc(aux_hidden))

    def _rope(self, positions: torch.Tensor):
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)

    def _blocks(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """[B, M] anchor tokens -> [B, M * block_size] block tokens: each anchor, then block_size-1 mask tokens."""
        B, M = anchor_ids.shape
        ids = anchor_ids.new_full((B, M, self.config.block_size), self.config.mask_token_id)
        ids[:, :, 0] = anchor_ids
        return ids.reshape(B, M * self.config.block_size)

    def block_forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, anchors: torch.Tensor,
                      position_ids: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Training: the blocks of many anchors at once.

        input_ids [B, L]; aux_hidden [B, L, A*H] (aux_hidden[:, i]: the target's states after reading t_i);
        anchors [B, M] int64 indices into the row (the anchor token t_a, at position position_ids[a]);
        position_ids, doc_ids [B, L] (defaults: arange, one document).
        Block a sees the context i < a of its own document and its own block, both ways; never another block.
        Returns the pre-norm states [B, M, block_size, H]: slot k of block a predicts t_{a+k} (logits =
        lm_head(norm(state))); slot 0 predicts nothing.
        """
        B, L = input_ids.shape
        M, S = anchors.shape[1], self.config.block_size
        device = input_ids.device
        if position_ids is None:
            position_ids = torch.arange(L, device=device).expand(B, L)
        if doc_ids is None:
            doc_ids = torch.zeros(B, L, dtype=torch.long, device=device)
        ctx = self.context(aux_hidden)  # [B, L, H]
        ctx_cos, ctx_sin = self._rope(position_ids)
        a_pos = position_ids.gather(1, anchors)  # [B, M]
        blk_pos = (a_pos[:, :, None] + torch.arange(S, device=device)).reshape(B, M * S)
        cos, sin = self._rope(blk_pos)
        # [B, 1, M*S, L + M*S]: context keys before the anchor in its document; the block's own keys
        i = torch.arange(L, device=device)
        a_doc = doc_ids.gather(1, anchors)  # [B, M]
        see_ctx = (i[None, None, :] < anchors[:, :, None]) & (doc_ids[:, None, :] == a_doc[:, :, None])  # [B, M, L]
        see_ctx = see_ctx.repeat_interleave(S, dim=1)  # [B, M*S, L]
        blk = torch.arange(M * S, device=device) // S
        see_blk = (blk[:, None] == blk[None, :]).expand(B, M * S, M * S)
        mask = torch.cat([see_ctx, see_blk], dim=-1)[:, None]
        x = self.embed_tokens(self._blocks(input_ids.gather(1, anchors)))  # [B, M*S, H]
        for layer in self.layers:
            context = layer.self_attn.keys_values(ctx, ctx_cos, ctx_sin)
            x = layer(x, cos, sin, context, mask)
        return x.view(B, M, S, -1)

    def add_context(self, aux_hidden: torch.Tensor, position_ids: torch.Tensor, cache: DrafterCache) -> None:
        """Serving: the context keys/values of verified positions ([B, T, A*H] states at position_ids [B, T]) join
        `cache`, layer by layer, as vLLM's precompute_and_store_context_kv writes them."""
        ctx = self.context(aux_hidden)
        cos, sin = self._rope(position_ids)
        cache.append([layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers])

    def draft_states(self, anchor: torch.Tensor, position: int, cache: DrafterCache) -> torch.Tensor:
        """Serving: the normed states [B, block_size - 1, H] of the block's mask slots after anchor [B, 1] (the
        bonus token) at `position`, over every context entry of `cache`; the block's keys stay out of the cache."""
        B, S = anchor.shape[0], self.config.block_size
        pos = torch.arange(position, position + S, device=anchor.device).expand(B, S)
        cos, sin = self._rope(pos)
        x = self.embed_tokens(self._blocks(anchor))
        mask = torch.ones(1, 1, S, cache.length + S, dtype=torch.bool, device=anchor.device)
        for n, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.past(n), mask)
        return self.norm(x[:, 1:])

    def draft(self, anchor: torch.Tensor, position: int, cache: DrafterCache) -> torch.Tensor:
        """Serving: logits [B, block_size - 1, Dv] of the block after anchor [B, 1] (draft_states')."""
        return self.lm_head(self.draft_states(anchor, position, cache))

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
