"""The EAGLE-3 draft model, written to match vLLM's `llama_eagle3` exactly.

One decoder layer (or a few, `num_hidden_layers`) sits on top of the target
model: at every position the first layer reads the embedding of the next token
and a hidden state (at the first draft step: `fc` applied to three of the
target's intermediate hidden states; at later steps: the drafter's own previous
output), each later layer the output of the one before, and the last predicts
the token after that over a reduced "draft vocabulary".

Parameter and buffer names are those of vLLM's llama_eagle3 one-to-one:

    embed_tokens.weight                      [V, H]   frozen copy of the target's
    fc.weight                                [H, 3H]
    layers.0.self_attn.{q,k,v}_proj.weight   [*, 2H]  inputs are [emb | hidden]
    layers.0.self_attn.o_proj.weight         [H, heads*head_dim]
    layers.0.mlp.{gate,up,down}_proj.weight
    layers.0.{input_layernorm,hidden_norm,post_attention_layernorm}.weight
    layers.N.*  (N >= 1)  the same without hidden_norm; q/k/v read [H] (the previous layer's output)
    norm.weight, lm_head.weight              [Dv, H]
    d2t  int64 [Dv]   target_id = draft_id + d2t[draft_id]
    t2d  bool  [V]    True where a target token is in the draft vocabulary

Two forwards: `forward`, one drafting call with a DrafterCache as vLLM runs it, and `ttt_forward`,
`steps` drafting steps unrolled at every position at once over the masks of ttt.py. This module
knows nothing about training (no loss, no optimizer), files or serving formats: the drafter's
weights come from the target through init.py, checkpoints are train/checkpoint.py's, vLLM's files
export.py's.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from draftsmith.model.config import ATTN_BLOCK, DrafterConfig
from draftsmith.model.mla import MLAAttention
from draftsmith.model.parts import RMSNorm, apply_rope, register_vocab_maps, rope_cos_sin
from draftsmith.model.ttt import FlexShape, FlexTTTMask, TTTMask, ttt_step_masks

__all__ = ["DrafterCache", "Eagle3Drafter", "RMSNorm", "rope_cos_sin"]


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read `in_dim` wide inputs: 2H ([emb | hidden]) in the first
    layer, H in later ones."""

    def __init__(self, config: DrafterConfig, in_dim: int) -> None:
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(in_dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: "torch.Tensor | TTTMask | FlexTTTMask",
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x [B, T, in_dim]; cos, sin [B, T, head_dim]; past: keys/values
        [B, kv_heads, P, head_dim] placed before the new ones; mask bool
        [B or 1, 1, T, P+T], True = may attend, or a TTTMask / FlexTTTMask.

        Returns the output [B, T, H] and this call's own (rotated) keys and
        values [B, kv_heads, T, head_dim], for the caller to keep.
        """
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        keys, values = k, v
        if past is not None:
            keys = torch.cat([past[0].to(k.dtype), k], dim=2)
            values = torch.cat([past[1].to(v.dtype), v], dim=2)
        if isinstance(mask, FlexTTTMask):
            y = mask.attend(q, keys, values)  # GQA inside the kernel: kv heads read in place
        else:
            # GQA: query head h reads kv head h // group (HF's repeat_kv layout).
            # Repeated explicitly instead of SDPA's enable_gqa because the CUDA
            # memory-efficient kernel (the one that takes an arbitrary mask) does
            # not support enable_gqa and would fall back to the O(T^2) math kernel.
            group = self.n_heads // self.n_kv_heads
            if group > 1:
                keys = keys.repeat_interleave(group, dim=1)
                values = values.repeat_interleave(group, dim=1)
            if isinstance(mask, TTTMask):
                y = mask.attend(q, keys, values)
            else:
                y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return self.o_proj(y), (k, v)


class Eagle3MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    """vLLM llama_eagle3 `LlamaDecoderLayer` (norm_before_residual=False).

    The first layer (first=True) reads the next token's embedding beside the hidden state:
    q/k/v take [input_layernorm(emb) | hidden_norm(hidden)] (2H). A later layer is a plain
    Llama layer over the previous layer's output: q/k/v take input_layernorm(hidden) (H) and
    it has no hidden_norm (vLLM builds one for every layer but only layer 0 uses it; its
    loader keeps the default of ones where an export has none).
    """

    def __init__(self, config: DrafterConfig, first: bool = True) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.first = first
        attention = MLAAttention if config.attention == "mla" else Eagle3Attention
        self.self_attn = attention(config, in_dim=2 * H if first else H)
        self.mlp = Eagle3MLP(config)
        self.input_layernorm = RMSNorm(H, eps)  # over the token embeddings (first) or the hidden state
        if first:
            self.hidden_norm = RMSNorm(H, eps)  # over the incoming hidden state
        self.post_attention_layernorm = RMSNorm(H, eps)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: "torch.Tensor | TTTMask | FlexTTTMask",
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """embeds, hidden [B, T, H] -> pre-norm output state [B, T, H] (what
        the next layer or draft step reads) and this call's keys/values. A later
        layer ignores `embeds`."""
        # gotcha: the residual is the raw incoming state, not hidden_norm of it
        # (that would be vLLM's norm_before_residual=True variant)
        residual = hidden
        if self.first:
            x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
        else:
            x = self.input_layernorm(hidden)  # [B, T, H]
        x, kv = self.self_attn(x, cos, sin, mask, past)
        x = x + residual
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, kv


class DrafterCache:
    """Keys/values of the drafter's layers, for chain drafting.

    layers[l] = (keys, values) of layer l, each [B, kv_heads, length, head_dim]
    (empty list while empty). Every layer and every row of the batch has the same
    length. After the target rejects drafted tokens, `crop(n)` rolls back to the
    first n entries.
    """

    def __init__(self) -> None:
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def length(self) -> int:
        return 0 if not self.layers else self.layers[0][0].shape[2]

    def past(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.layers[layer] if layer < len(self.layers) else None

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """kv: one (keys, values) per layer, the same new length in each."""
        if not self.layers:
            self.layers = list(kv)
        else:
            if len(kv) != len(self.layers):
                raise ValueError(f"cache holds {len(self.layers)} layers, got {len(kv)}")
            self.layers = [(torch.cat([k0, k], dim=2), torch.cat([v0, v], dim=2))
                           for (k0, v0), (k, v) in zip(self.layers, kv)]

    def crop(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {n}")
        self.layers = [] if n == 0 else [(k[:, :, :n], v[:, :, :n]) for k, v in self.layers]


class Eagle3Drafter(nn.Module):
    """fc, the decoder layers, the final norm and the draft LM head over the frozen target
    embeddings, with the draft vocabulary's maps d2t and t2d."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, H)
        # the drafter reads the target's embeddings and never updates them
        self.embed_tokens.weight.requires_grad_(False)
        A = config.num_aux_layers
        if config.norm_before_fc:  # EAGLE-3.1: one norm over the concatenated aux states
            self.input_norm = RMSNorm(A * H, config.rms_norm_eps)
        if config.fc_norm:  # EAGLE-3.1: one norm per aux state
            self.fc_norm = nn.ModuleList([RMSNorm(H, config.rms_norm_eps) for _ in range(A)])
        self.fc = nn.Linear(A * H, H, bias=False)
        self.layers = nn.ModuleList([Eagle3DecoderLayer(config, first=i == 0)
                                     for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        register_vocab_maps(self, config.draft_vocab_size, config.vocab_size)

    def draft_ids(self) -> torch.Tensor:
        """The target token id of every draft id, [Dv] int64."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[B, L, num_aux*H] target hidden states, concatenated in increasing
        layer order -> [B, L, H]."""
        expected = self.config.num_aux_layers * self.config.hidden_size
        if aux_hidden.shape[-1] != expected:
            raise ValueError(f"aux_hidden must have last dim {expected}, got {aux_hidden.shape[-1]}")
        return self.fc(self.fc_input(aux_hidden))

    def fc_input(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """What fc reads: the concatenated aux states [..., num_aux*H], normed as EAGLE-3.1 asks (vLLM's
        combine_hidden_states: input_norm over the whole, or fc_norm per state; neither by default)."""
        if self.config.norm_before_fc:
            return self.input_norm(aux_hidden)
        if self.config.fc_norm:
            parts = aux_hidden.chunk(self.config.num_aux_layers, dim=-1)
            return torch.cat([norm(x) for norm, x in zip(self.fc_norm, parts)], dim=-1)
        return aux_hidden

    def carry(self, state: torch.Tensor) -> torch.Tensor:
        """The state a draft step hands to the next, from its pre-norm output [..., H]: the output itself, or with
        EAGLE-3.1's norm_output the final norm of it (what the logits read too)."""
        return self.norm(state) if self.config.norm_output else state

    def step_inputs(self, k: int, ids: torch.Tensor, carried: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeddings [B, L, H], incoming state [B, L, H]) of TTT step k: the tokens it reads (ids: t_{i+1+k} at
        index i) and what step k-1 handed on (step 0: fc of the target's states). A parallel drafter
        (model/peagle.py) feeds its later steps something else."""
        return self.embed_tokens(ids), carried

    def ttt_forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        steps: int,
        position_ids: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        return_hidden: bool = False,
        attn_block: int | None = ATTN_BLOCK,
        attention: str = "sdpa",
        key_floors: list[int] | None = None,
        flex_shape: FlexShape | None = None,
    ) -> list[torch.Tensor]:
        """Training-time test: simulate `steps` steps of chain drafting at every
        position at once.

        input_ids [B, L] tokens t_0..t_{L-1}; aux_hidden [B, L, num_aux*H], where
        aux_hidden[:, i] is the target's state after reading t_i;
        position_ids [B, L] (default arange(L), restarting per packed document);
        doc_ids [B, L] (default all one document).

        Returns `steps` logits [B, L, Dv]. At step k, index i is the chain
        drafted after the prefix t_0..t_{i+1}: it read token t_{i+1+k} at
        position position_ids[i] + k and predicts t_{i+2+k}. Where i+1+k runs
        past the row, or past the document, the outputs are meaningless and the
        caller must mask them.

        return_hidden: return each step's pre-norm output state [B, L, H]
        instead of its logits (logits = lm_head(norm(state))), so that a caller
        can run the [H, Dv] head only at the positions it trains on.
        attention: "sdpa" (scaled_dot_product_attention: with attn_block, one
        call per query block over just the keys it may see (TTTMask); with
        attn_block None, one call per step over the dense [L, (k+1)L] mask) or
        "flex" (compiled flex attention over a block mask, FlexTTTMask: no key
        copies, GQA in place; the lean and fast path on CUDA; on the CPU torch
        runs it forward only, and its first compile takes ~20 s).
        key_floors: the SDPA path's key_floors(doc_ids, attn_block), computed where doc_ids is on
        the host; None: computed here, one device->host read (a sync on CUDA) per call.
        flex_shape: the rows and length buckets flex pads every call to (FlexShape: a bounded set of
        compiled graphs over a run); None: this call's own rows and length, for one-off calls.
        """
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        B, L = input_ids.shape
        device = input_ids.device
        if position_ids is None:
            position_ids = torch.arange(L, device=device).expand(B, L)
        if doc_ids is None:
            doc_ids = torch.zeros(B, L, dtype=torch.long, device=device)
        if attention == "flex" and flex_shape is None:
            flex_shape = FlexShape(B, L, steps)
        mask_of = ttt_step_masks(doc_ids, attention, attn_block, key_floors, flex_shape)  # k -> step k's mask
        hidden = self.fuse(aux_hidden)  # [B, L, H]
        # per layer: keys/values of steps 0..k-1, [B, kv_heads, kL, head_dim]
        pasts: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.layers)
        logits = []
        for k in range(steps):
            # step k reads t_{i+1+k} at index i; the tail has no token (fill 0)
            ids = torch.zeros_like(input_ids)
            if k + 1 < L:
                ids[:, : L - k - 1] = input_ids[:, k + 1:]
            cos, sin = rope_cos_sin(position_ids + k, self.config.rope_dim, self.config.rope_theta)
            mask = mask_of(k)
            embeds, hidden = self.step_inputs(k, ids, hidden)
            for n, layer in enumerate(self.layers):
                past = pasts[n]
                hidden, (k_new, v_new) = layer(embeds, hidden, cos, sin, mask, past)
                pasts[n] = (k_new, v_new) if past is None else (
                    torch.cat([past[0], k_new], dim=2), torch.cat([past[1], v_new], dim=2))
            logits.append(hidden if return_hidden else self.lm_head(self.norm(hidden)))
            hidden = self.carry(hidden)
        return logits

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DrafterCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafting call, as vLLM runs it.

        input_ids [B, T]: the token after each hidden state's position;
        hidden [B, T, num_aux*H] (target states, fused here by `fc`) or
        [B, T, H] (the state the drafter handed on: the second output of a call before);
        position_ids [B, T]: the position of each hidden state (+k at draft
        step k). New tokens attend to everything in `cache` and causally among
        themselves; their keys/values are appended to it.

        Returns logits [B, T, Dv] and the state [B, T, H] to feed back (carry: the pre-norm output, or its
        final norm with norm_output).
        """
        H = self.config.hidden_size
        if hidden.shape[-1] == self.config.num_aux_layers * H:
            hidden = self.fuse(hidden)
        elif hidden.shape[-1] != H:
            raise ValueError(f"hidden must have last dim {H} or "
                             f"{self.config.num_aux_layers * H}, got {hidden.shape[-1]}")
        T = input_ids.shape[1]
        P = 0 if cache is None else cache.length
        # [T, P+T]: every cached entry, then causal among the new tokens
        j = torch.arange(P + T, device=input_ids.device)
        i = torch.arange(T, device=input_ids.device)
        mask = (j[None, :] <= (i[:, None] + P))[None, None]  # [1, 1, T, P+T]
        cos, sin = rope_cos_sin(position_ids, self.config.rope_dim, self.config.rope_theta)
        embeds, out, kv = self.embed_tokens(input_ids), hidden, []
        for n, layer in enumerate(self.layers):
            out, new = layer(embeds, out, cos, sin, mask, None if P == 0 else cache.past(n))
            kv.append(new)
        if cache is not None:
            cache.append(kv)
        return self.lm_head(self.norm(out)), self.carry(out)

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
