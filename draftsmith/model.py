"""The EAGLE-3 draft model, written to match vLLM's `llama_eagle3` exactly.

One decoder layer (or a few, `num_hidden_layers`) sits on top of the target
model: at every position the first layer reads the embedding of the next token
and a hidden state (at the first draft step: `fc` applied to three of the
target's intermediate hidden states; at later steps: the drafter's own previous
output), each later layer the output of the one before, and the last predicts
the token after that over a reduced "draft vocabulary".

Parameter and buffer names map one-to-one to the checkpoint format vLLM loads:

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

This module knows nothing about training, files or serving formats.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

try:  # flex attention exists from torch 2.5 on; draftsmith allows 2.4, which then has the SDPA path only
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - torch 2.4
    BlockMask = flex_attention = None

# A checkpoint of train.fc_input_norm holds this [3H] factor beside the drafter's weights (aux
# states are multiplied by it before fc); export folds it into fc.weight.
FC_INPUT_SCALE = "fc_input_scale"

# TTT attention implementations (Eagle3Drafter.ttt_forward's `attention`)
ATTENTION_PATHS = ("sdpa", "flex")
# flex attention's tile (its default sparse block size): the block mask says, per tile of 128
# queries x 128 keys, whether the tile is skipped, fully visible, or visible by the mask function
FLEX_BLOCK = 128
# query block of the SDPA TTT path (TTTMask): ttt_forward's default attn_block
ATTN_BLOCK = 256


@dataclass
class Eagle3Config:
    # width of the drafter; must equal the target's hidden size because the
    # drafter reads the target's embeddings and hidden states directly
    hidden_size: int
    # width of the SwiGLU MLP
    intermediate_size: int
    num_attention_heads: int
    # grouped-query attention: each kv head serves heads/kv_heads query heads
    num_key_value_heads: int
    # per-head width; None means hidden_size // num_attention_heads
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    # base of the default (unscaled) RoPE
    rope_theta: float = 10000.0
    # only recorded for the exported config; RoPE is computed from position
    # ids on the fly, so nothing here is sized by it
    max_position_embeddings: int = 8192
    # the target's vocabulary: rows of `embed_tokens`, length of `t2d`
    vocab_size: int = 32000
    # the drafter's output vocabulary: rows of `lm_head`, length of `d2t`
    draft_vocab_size: int = 32000
    # how many target hidden states `fc` fuses; vLLM's llama_eagle3 expects 3
    num_aux_layers: int = 3
    # the MLP activation; vLLM's LlamaMLP only supports SiLU
    hidden_act: str = "silu"
    # decoder layers: the first reads [emb | hidden] (2H), each later one only the
    # previous layer's output (H), as vLLM's llama_eagle3 builds them
    num_hidden_layers: int = 1

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings",
                     "vocab_size", "draft_vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) is not divisible by "
                    f"num_attention_heads ({self.num_attention_heads}); "
                    "pass head_dim explicitly")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if not isinstance(self.head_dim, int) or self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be a positive even int (RoPE rotates "
                             f"pairs), got {self.head_dim!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads})")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft_vocab_size ({self.draft_vocab_size}) must be <= "
                f"vocab_size ({self.vocab_size})")
        # forward() tells fused from unfused hidden states by their width, which
        # is ambiguous with a single aux layer
        if not isinstance(self.num_aux_layers, int) or self.num_aux_layers < 2:
            raise ValueError(f"num_aux_layers must be an int >= 2, got {self.num_aux_layers!r}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if not isinstance(self.num_hidden_layers, int) or self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers must be an int >= 1, got {self.num_hidden_layers!r}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {self.hidden_act!r}")

    @classmethod
    def from_target_config(cls, hf_config: Any, draft_vocab_size: int, num_hidden_layers: int = 1) -> Eagle3Config:
        """Size a drafter for a target's transformers (text) config; the rules per family below.

        Only the target's shapes are copied. The drafter always uses SiLU and
        default (unscaled) RoPE with the target's rope_theta: it is its own model,
        so a target's rope scaling (e.g. Llama 3.1's "llama3" type) is not
        inherited, and the exported drafter config must say so. Its layer is the
        Llama layer of vLLM's `llama_eagle3` whatever the target's family; vLLM
        builds its attention from `num_attention_heads`, `num_key_value_heads` and
        `head_dim` (hidden_size // heads when absent), any of which may differ from
        hidden_size's split, since q/k/v/o_proj map between the two widths.

        Attention (see `drafter_attention_shape`):
        - Llama-style targets (Llama 3, Qwen3, Mistral, Gemma 3, gpt-oss, ...): the
          target's own heads, kv heads and head_dim.
        - MLA targets (DeepSeek-V3/R1, Kimi-K2: a `kv_lora_rank` in the config):
          their `head_dim` field is only the rope part (qk_rope_head_dim, 64), and
          their 128 "kv heads" are the heads after the latent up-projection, so
          neither describes a Llama layer. The drafter takes head_dim = v_head_dim
          (128 for both: the width each head hands to o_proj), heads = hidden_size //
          head_dim (56 for hidden 7,168) and 8 kv heads (the largest of 8, 4, 2, 1
          dividing the heads). This is the shape of SpecForge's published DeepSeek-V3
          EAGLE-3 config (configs/deepseek-v3-671b-eagle3.json: 56 heads, 8 kv heads,
          head size 7,168 / 56 = 128); its Kimi-K2 config keeps head_dim 128 with the
          target's 64 heads (8,192 wide), and either serves in vLLM. Never
          qk_rope_head_dim x heads (4,096 against 7,168 for Kimi-K2).

        MLP width (see `drafter_intermediate_size`):
        - dense targets: the target's `intermediate_size`;
        - MoE targets with a dense width beside the experts' (DeepSeek-V3, Kimi-K2:
          18,432 for their first dense layers; Qwen3-MoE: 6,144 for 30B-A3B): that
          dense `intermediate_size`, never `moe_intermediate_size` (2,048 / 768,
          one expert's slice, too thin for a dense layer that has to do the work of
          the whole routed MLP). SpecForge's Kimi-K2 EAGLE-3 config copies exactly
          18,432; its Qwen3-MoE and Llama-4 drafters go wider still (2x the dense width);
        - MoE targets whose `intermediate_size` is one expert's width and that have
          no dense layer (gpt-oss: 2,880 with 4 experts per token; Mixtral): the
          width the target spends per token, num_experts_per_tok x intermediate_size
          (gpt-oss: 11,520; SpecForge's gpt-oss-20B drafter uses 17,280); Llama 4
          names its dense width `intermediate_size_mlp`, which is taken.
        """
        num_heads, num_kv_heads, head_dim = drafter_attention_shape(hf_config)
        return cls(
            hidden_size=hf_config.hidden_size,
            intermediate_size=drafter_intermediate_size(hf_config),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(getattr(hf_config, "rms_norm_eps", 1e-5)),
            rope_theta=target_rope_theta(hf_config),
            max_position_embeddings=getattr(hf_config, "max_position_embeddings", 8192),
            vocab_size=hf_config.vocab_size,
            draft_vocab_size=draft_vocab_size,
            num_hidden_layers=num_hidden_layers,
        )


def is_mla(hf_config: Any) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3/R1, Kimi-K2): keys and values come from a
    compressed latent of width kv_lora_rank."""
    return bool(getattr(hf_config, "kv_lora_rank", None))


def _largest_divisor(n: int, candidates=(8, 4, 2, 1)) -> int:
    return next(c for c in candidates if n % c == 0)


def drafter_attention_shape(hf_config: Any) -> tuple[int, int, int | None]:
    """(heads, kv heads, head_dim or None) of the drafter's attention for a target config; the
    rule is in Eagle3Config.from_target_config's docstring."""
    hidden = hf_config.hidden_size
    if is_mla(hf_config):
        head_dim = getattr(hf_config, "v_head_dim", None) or getattr(hf_config, "qk_nope_head_dim", None) or 128
        if hidden % head_dim:
            head_dim = 128 if hidden % 128 == 0 else hidden // hf_config.num_attention_heads
        heads = hidden // head_dim
        return heads, _largest_divisor(heads), head_dim
    heads = hf_config.num_attention_heads
    return heads, getattr(hf_config, "num_key_value_heads", None) or heads, getattr(hf_config, "head_dim", None)


def drafter_intermediate_size(hf_config: Any) -> int:
    """Width of the drafter's MLP for a target config; the rule is in
    Eagle3Config.from_target_config's docstring."""
    inter = hf_config.intermediate_size
    if getattr(hf_config, "moe_intermediate_size", None):
        return inter  # a dense width beside the experts' (DeepSeek-V3, Kimi-K2, Qwen3-MoE)
    if getattr(hf_config, "intermediate_size_mlp", None):
        return hf_config.intermediate_size_mlp  # Llama 4: the dense layers' width beside the experts' intermediate_size
    experts = next((getattr(hf_config, k, None) for k in ("num_local_experts", "num_experts", "n_routed_experts")
                    if getattr(hf_config, k, None)), None)
    if experts:  # intermediate_size is one expert's width (gpt-oss, Mixtral)
        return inter * (getattr(hf_config, "num_experts_per_tok", None) or getattr(hf_config, "experts_per_token", None) or 1)
    return inter


def target_rope_theta(hf_config: Any) -> float:
    """The target's RoPE base: `rope_theta`, or transformers 5's `rope_parameters` (per layer type
    for Gemma 3, whose full-attention layers' base is taken: the drafter attends to the whole
    context), else 10000."""
    theta = getattr(hf_config, "rope_theta", None)
    if theta is None:
        params = getattr(hf_config, "rope_parameters", None) or {}
        if "rope_theta" not in params and isinstance(params.get("full_attention"), dict):
            params = params["full_attention"]
        theta = params.get("rope_theta", 10000.0)
    return float(theta)


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


def first_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, L] any ids -> [B, L] int64: the first position of each position's document in its row,
    i.e. the first step-0 key its query sees in TTT attention. Fixed-shape ops only (a stable sort
    per row groups the ids; the group's first element is its first position), so no device->host
    read; also an id per document (equal ids <=> equal documents) bounded by L."""
    B, L = doc_ids.shape
    ids, order = doc_ids.sort(dim=-1, stable=True)  # [B, L]; within a group, positions ascending
    at = torch.arange(L, device=doc_ids.device).expand(B, L)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    group_start = torch.where(starts, at, 0).cummax(-1).values  # [B, L] sorted index of the group's first
    first_sorted = order.gather(-1, group_start)  # its position in the row
    return torch.empty_like(order).scatter_(-1, order, first_sorted)


def _block_floors(first: torch.Tensor, block: int) -> list[int]:
    """[B, L] first visible key of each query -> per query block of `block` positions, the
    smallest over the block and the rows (one device->host read)."""
    B, L = first.shape
    nb = -(-L // block)
    padded = F.pad(first, (0, nb * block - L), value=L)  # a padded query sees nothing before L
    return padded.view(B, nb, block).amin(dim=(0, 2)).tolist()


def key_floors(doc_ids: torch.Tensor, block: int = ATTN_BLOCK) -> list[int]:
    """ttt_forward's `key_floors` for doc_ids [B, L]: per query block of `block` positions, the first
    step-0 key any of its queries sees. Computed where doc_ids is on the host (the data thread),
    it spares ttt_forward a device->host read per micro-batch."""
    return _block_floors(first_positions(doc_ids), block)


class TTTMask:
    """The attention pattern of a training-time-test step, computed block-sparsely.

    Keys are laid out [step0 (L) | step1 (L) | ... | stepk (L)]; query i sees the
    step-0 keys allowed by `step0` ([B, 1, L, L]: j <= i, same document) and key i
    of each later step. The dense [L, (k+1)L] mask is almost all False: a block of
    queries [s, e) can only see step-0 keys [lo, e) (lo = the first key any of them
    sees) and keys [s, e) of the later steps. `attend` runs one SDPA per query
    block over just those keys with the same mask entries, so the softmax is the
    dense one (the keys it leaves out are masked for these queries anyway) at a
    fraction of the cost: about (1 + k*block/L)/(2(k+1)) of it for one document
    per row, much less for short packed documents.
    """

    def __init__(self, step0: torch.Tensor, block: int, floors: list[int] | None = None) -> None:
        """floors: key_floors(doc_ids, block) when the caller has it from the host (no device
        read here); None: computed from `step0` (one device->host read)."""
        self.step0, self.block = step0, block
        L = step0.shape[-1]
        if floors is None:
            first = step0[:, 0].to(torch.uint8).argmax(-1)  # [B, L] first visible key (argmax: first max)
            floors = _block_floors(first, block)
        # per query block b: (s, e, a) = its queries [s, e) and the first step-0 key
        # block a it needs (keys are taken in whole blocks, so from a * block on)
        self.spans = [(s, min(L, s + block), floors[b] // block) for b, s in enumerate(range(0, L, block))]

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """q [B, heads, L, d]; keys, values [B, heads, (k+1)L, d] -> [B, heads, L, d]."""
        B, L = q.shape[0], q.shape[2]
        later = keys.shape[2] // L - 1  # k
        # One split into per-step blocks: its backward is a single concatenation,
        # where a slice per query block would allocate a full-size gradient each.
        sizes = [min(self.block, L - s) for s in range(0, L, self.block)]
        nb = len(sizes)
        kb, vb = keys.split(sizes * (later + 1), dim=2), values.split(sizes * (later + 1), dim=2)
        out = []
        for b, (s, e, a) in enumerate(self.spans):
            chunks = list(range(a, b + 1)) + [d * nb + b for d in range(1, later + 1)]
            eye = torch.eye(e - s, dtype=torch.bool, device=q.device).expand(B, 1, e - s, e - s)
            mask = torch.cat([self.step0[:, :, s:e, a * self.block:e]] + [eye] * later, dim=-1)
            out.append(F.scaled_dot_product_attention(
                q[:, :, s:e], torch.cat([kb[c] for c in chunks], dim=2),
                torch.cat([vb[c] for c in chunks], dim=2), attn_mask=mask))
        return torch.cat(out, dim=2)


@functools.cache
def compiled_flex_attention():
    """flex_attention compiled once per process. Uncompiled it is a reference implementation that
    materialises every score ([B, heads, L, (k+1)L]); compiled it is a fused kernel that visits only
    the tiles the block mask lists. dynamic=True: one kernel for every row length and TTT step
    (each new key length would otherwise compile again, ~20 s each)."""
    if flex_attention is None:
        raise ValueError(f"flex attention needs torch >= 2.5 (this is {torch.__version__})")
    return torch.compile(flex_attention, dynamic=True)


def _ordered_tiles(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, nq, nkv] bool (which key tiles each query tile visits) -> BlockMask's (counts [B, 1, nq]
    int32, indices [B, 1, nq, nkv] int32: the visited tiles first, in increasing order)."""
    counts = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[:, None], order[:, None]


class FlexTTTMask:
    """The attention pattern of a training-time-test step as a flex-attention block mask.

    Same pattern as TTTMask (query i sees the step-0 keys j <= i of its document and key i of each
    later step), computed by flex attention: a fused kernel that visits only the 128 x 128 tiles
    holding a visible key and reads GQA keys/values in place (enable_gqa), so neither the per-block
    key copies of TTTMask nor the expanded kv heads are kept for backward.

    Built once per batch: which step-0 tiles are visible, and which of those fully, from the
    document ids alone ([B, tiles, documents]; no [L, L] mask). Extended per TTT step k: one diagonal
    tile per query tile and later step (block_mask(k), cached for the layers of that step).
    Rows are padded to Lp, a multiple of 128, and each step's keys too, so that every step's keys
    start on a tile; the padding is a document of its own, which no real query sees.
    """

    def __init__(self, doc_ids: torch.Tensor) -> None:
        B, L = doc_ids.shape
        self.L = L
        self.Lp = -(-L // FLEX_BLOCK) * FLEX_BLOCK
        nb = self.Lp // FLEX_BLOCK
        # documents renumbered 1..L per row by their first position (any ids, -1 padding included;
        # fixed-shape, no device->host read as torch.unique and a max would need); the tile padding is 0
        self.doc = F.pad(first_positions(doc_ids) + 1, (0, self.Lp - L))  # [B, Lp]
        n_docs = L + 1
        present = torch.zeros(B, nb, n_docs, dtype=torch.bool, device=doc_ids.device)
        present.scatter_(2, self.doc.view(B, nb, FLEX_BLOCK), True)  # [B, tiles, documents]
        # a query tile sees a key tile before it iff they share a document (every j < i there);
        # fully iff both hold that one document only; its own tile is causal, so partly
        shared = torch.bmm(present.float(), present.float().transpose(1, 2)) > 0  # [B, nb, nb]
        single = present.sum(-1) == 1
        t = torch.arange(nb, device=doc_ids.device)
        below = t[:, None] > t[None, :]
        self.full0 = below & shared & single[:, :, None] & single[:, None, :]
        self.partial0 = (below & shared & ~self.full0) | (t[:, None] == t[None, :])
        self._masks: dict[int, Any] = {}
        doc = self.doc

        def mask_mod(b, h, q_idx, kv_idx):
            # flex's per-element rule inside partly visible tiles; keys [step0 | step1 | ...], Lp each
            Lp = doc.shape[1]
            step, j = kv_idx // Lp, kv_idx % Lp
            return torch.where(step == 0, (j <= q_idx) & (doc[b, q_idx] == doc[b, j]), j == q_idx)

        self.mask_mod = mask_mod  # a plain function of (b, h, q_idx, kv_idx), as flex tells mask from score mods

    def block_mask(self, k: int):
        """The block mask of TTT step k: the step-0 tiles, then k diagonal tiles per query tile."""
        if k not in self._masks:
            B, nb, _ = self.partial0.shape
            eye = torch.eye(nb, dtype=torch.bool, device=self.doc.device).expand(B, nb, nb)
            partial = torch.cat([self.partial0] + [eye] * k, dim=-1)  # [B, nb, (k+1)nb]
            full = torch.cat([self.full0] + [torch.zeros_like(eye)] * k, dim=-1)
            self._masks[k] = BlockMask.from_kv_blocks(
                *_ordered_tiles(partial), *_ordered_tiles(full), BLOCK_SIZE=FLEX_BLOCK,
                mask_mod=self.mask_mod, seq_lengths=(self.Lp, (k + 1) * self.Lp))
        return self._masks[k]

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """q [B, heads, L, d]; keys, values [B, kv_heads, (k+1)L, d] -> [B, heads, L, d]."""
        L, pad = self.L, self.Lp - self.L
        steps = keys.shape[2] // L
        if pad:
            q = F.pad(q, (0, 0, 0, pad))
            keys = F.pad(keys.unflatten(2, (steps, L)), (0, 0, 0, pad)).flatten(2, 3)
            values = F.pad(values.unflatten(2, (steps, L)), (0, 0, 0, pad)).flatten(2, 3)
        else:  # the padded ones are contiguous: one memory layout, so the compiled kernel serves both
            q, keys, values = q.contiguous(), keys.contiguous(), values.contiguous()
        out = compiled_flex_attention()(q, keys, values, block_mask=self.block_mask(steps - 1), enable_gqa=True)
        return out[:, :, :L]


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read `in_dim` wide inputs: 2H ([emb | hidden]) in the first
    layer, H in later ones."""

    def __init__(self, config: Eagle3Config, in_dim: int) -> None:
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

    def __init__(self, config: Eagle3Config) -> None:
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

    def __init__(self, config: Eagle3Config, first: bool = True) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.first = first
        self.self_attn = Eagle3Attention(config, in_dim=2 * H if first else H)
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


def check_target_layer(cfg: Eagle3Config, layer: dict[str, torch.Tensor]) -> None:
    """Raise ValueError unless `layer` (a target decoder layer's tensors by their names inside
    the layer) is a Llama layer of the drafter's shapes: exactly these tensors, nothing more
    (a bias or q/k norm it cannot hold would make the copy silently a different layer)."""
    H, hd = cfg.hidden_size, cfg.head_dim
    need = {
        "self_attn.q_proj.weight": (cfg.num_attention_heads * hd, H),
        "self_attn.k_proj.weight": (cfg.num_key_value_heads * hd, H),
        "self_attn.v_proj.weight": (cfg.num_key_value_heads * hd, H),
        "self_attn.o_proj.weight": (H, cfg.num_attention_heads * hd),
        "mlp.gate_proj.weight": (cfg.intermediate_size, H),
        "mlp.up_proj.weight": (cfg.intermediate_size, H),
        "mlp.down_proj.weight": (H, cfg.intermediate_size),
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
    }
    extra = sorted(set(layer) - set(need))
    if extra:
        raise ValueError(f"target layer has tensors a Llama-style drafter layer cannot hold: {extra[:3]}")
    for name, shape in need.items():
        if name not in layer:
            raise ValueError(f"target layer has no {name}")
        if tuple(layer[name].shape) != shape:
            raise ValueError(f"target {name} must be {list(shape)}, got {list(layer[name].shape)}")


class Eagle3Drafter(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, H)
        # the drafter reads the target's embeddings and never updates them
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(config.num_aux_layers * H, H, bias=False)
        self.layers = nn.ModuleList([Eagle3DecoderLayer(config, first=i == 0)
                                     for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        # default mapping until init_from_target: draft id i is target id i
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    @torch.no_grad()
    def init_from_target(
        self,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        final_norm_weight: torch.Tensor | None,
        draft_ids: torch.Tensor,
    ) -> None:
        """Copy the target's embeddings (frozen), the draft vocabulary's rows
        of its lm_head and its final norm weight, and set the vocab mapping.

        embed_weight, lm_head_weight [V, H]; final_norm_weight [H] or None
        (keep ones); draft_ids [Dv] strictly increasing target token ids.
        """
        cfg = self.config
        V, H, Dv = cfg.vocab_size, cfg.hidden_size, cfg.draft_vocab_size
        if tuple(embed_weight.shape) != (V, H):
            raise ValueError(f"embed_weight must be [{V}, {H}], got {list(embed_weight.shape)}")
        if tuple(lm_head_weight.shape) != (V, H):
            raise ValueError(f"lm_head_weight must be [{V}, {H}], got {list(lm_head_weight.shape)}")
        if final_norm_weight is not None and tuple(final_norm_weight.shape) != (H,):
            raise ValueError(f"final_norm_weight must be [{H}], got {list(final_norm_weight.shape)}")
        draft_ids = draft_ids.to(device=self.d2t.device, dtype=torch.long)
        if tuple(draft_ids.shape) != (Dv,):
            raise ValueError(f"draft_ids must be [{Dv}], got {list(draft_ids.shape)}")
        if Dv > 1 and not bool((draft_ids[1:] > draft_ids[:-1]).all()):
            raise ValueError("draft_ids must be strictly increasing (sorted, no duplicates)")
        if int(draft_ids[0]) < 0 or int(draft_ids[-1]) >= V:
            raise ValueError(f"draft_ids must lie in [0, {V})")

        self.embed_tokens.weight.copy_(embed_weight)
        self.lm_head.weight.copy_(lm_head_weight[draft_ids.to(lm_head_weight.device)])
        if final_norm_weight is not None:
            self.norm.weight.copy_(final_norm_weight)
        # offsets, not ids: this is the format vLLM's loader expects
        self.d2t.copy_(draft_ids - torch.arange(Dv, device=draft_ids.device))
        self.t2d.zero_()
        self.t2d[draft_ids] = True

    @torch.no_grad()
    def init_layer_from_target(self, layer: "dict[str, torch.Tensor] | list[dict[str, torch.Tensor]]",
                               aux_index: int, input_scale: torch.Tensor | None = None) -> None:
        """Start the decoder layers from consecutive decoder layers of the target and
        `fc` as a pass-through of one aux state, instead of from random weights.

        layer: the target layer's tensors by their names inside the layer
        (`self_attn.q_proj.weight` [heads*hd, H], `mlp.gate_proj.weight`, ...,
        `input_layernorm.weight`, `post_attention_layernorm.weight`), or a list of
        num_hidden_layers such dicts, one per drafter layer. A later drafter layer
        is a plain Llama layer and takes its target layer whole.
        aux_index: which of the fused aux states fc passes on (e.g. the last).
        input_scale: [num_aux*H] factors the aux states are multiplied by before
        fc (training's fc_input_norm), undone by fc so it still passes the state on.
        A tensor this layer has no place for (biases, q/k norms) is refused: the
        copy would silently be a different layer.

        Why: with a few hundred thousand tokens of data a random layer spends
        its first epochs learning what the target's layers already compute.
        The hidden half of q/k/v ([:, H:], what reads hidden_norm(hidden))
        gets the target's q/k/v, hidden_norm its input norm; the embedding half
        keeps its random init, so the next token's embedding is read from the
        first step. fc = [0 .. I .. 0] makes the step-0 hidden exactly the
        chosen aux state, the residual stream the target layer expects.
        """
        cfg = self.config
        H, A = cfg.hidden_size, cfg.num_aux_layers
        if not -A <= aux_index < A:
            raise ValueError(f"aux_index must be in [-{A}, {A}), got {aux_index}")
        layers = layer if isinstance(layer, list) else [layer]
        if len(layers) != cfg.num_hidden_layers:
            raise ValueError(f"got {len(layers)} target layers for a drafter of {cfg.num_hidden_layers}")
        for one in layers:
            check_target_layer(cfg, one)
        layer = layers[0]
        d = self.layers[0]
        for proj in ("q_proj", "k_proj", "v_proj"):
            getattr(d.self_attn, proj).weight[:, H:].copy_(layer[f"self_attn.{proj}.weight"])
        d.self_attn.o_proj.weight.copy_(layer["self_attn.o_proj.weight"])
        for proj in ("gate_proj", "up_proj", "down_proj"):
            getattr(d.mlp, proj).weight.copy_(layer[f"mlp.{proj}.weight"])
        d.hidden_norm.weight.copy_(layer["input_layernorm.weight"])
        d.post_attention_layernorm.weight.copy_(layer["post_attention_layernorm.weight"])
        j = aux_index % A
        block = torch.eye(H, device=self.fc.weight.device)
        if input_scale is not None:
            if tuple(input_scale.shape) != (A * H,):
                raise ValueError(f"input_scale must be [{A * H}], got {list(input_scale.shape)}")
            block = torch.diag(1.0 / input_scale[j * H:(j + 1) * H].to(block))
        self.fc.weight.zero_()
        self.fc.weight[:, j * H:(j + 1) * H].copy_(block)
        for d, src in zip(self.layers[1:], layers[1:]):
            for name, p in d.named_parameters():
                p.copy_(src[name])

    def draft_ids(self) -> torch.Tensor:
        """The target token id of every draft id, [Dv] int64."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[B, L, num_aux*H] target hidden states, concatenated in increasing
        layer order -> [B, L, H]."""
        expected = self.config.num_aux_layers * self.config.hidden_size
        if aux_hidden.shape[-1] != expected:
            raise ValueError(f"aux_hidden must have last dim {expected}, got {aux_hidden.shape[-1]}")
        return self.fc(aux_hidden)

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
        """
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if attention not in ATTENTION_PATHS:
            raise ValueError(f"attention must be one of {ATTENTION_PATHS}, got {attention!r}")
        B, L = input_ids.shape
        device = input_ids.device
        if position_ids is None:
            position_ids = torch.arange(L, device=device).expand(B, L)
        if doc_ids is None:
            doc_ids = torch.zeros(B, L, dtype=torch.long, device=device)
        if attention == "flex":
            flex_mask = FlexTTTMask(doc_ids)  # built once; its block mask grows by a diagonal per step
            return self._ttt_steps(input_ids, aux_hidden, steps, position_ids, return_hidden, lambda k: flex_mask)

        # Attention at step k for query i: step-0 keys j <= i of the same
        # document (the verified prefix) plus i's own chain at steps 1..k. Keys
        # are laid out [step0 (L) | step1 (L) | ... | stepk (L)], so the mask is
        # a causal same-document block followed by k diagonal blocks. Dense,
        # most of it is masked out (it would cost (k+1)L^2 per step, as much
        # as all the matmuls at L=2048); TTTMask skips the masked-out keys.
        idx = torch.arange(L, device=device)
        causal = idx[None, :] <= idx[:, None]  # [L, L], [i, j] = j <= i
        same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # [B, L, L]
        step0_mask = (causal & same_doc).unsqueeze(1)  # [B, 1, L, L]
        if attn_block is None:
            diag = torch.eye(L, dtype=torch.bool, device=device).expand(B, 1, L, L)
            return self._ttt_steps(input_ids, aux_hidden, steps, position_ids, return_hidden,
                                   lambda k: torch.cat([step0_mask] + [diag] * k, dim=-1))  # [B, 1, L, (k+1)L]
        blocked = TTTMask(step0_mask, attn_block, key_floors)
        return self._ttt_steps(input_ids, aux_hidden, steps, position_ids, return_hidden, lambda k: blocked)

    def _ttt_steps(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, steps: int,
                   position_ids: torch.Tensor, return_hidden: bool, mask_of) -> list[torch.Tensor]:
        """ttt_forward's unrolled steps; mask_of(k) is step k's attention mask (a tensor or a
        TTTMask / FlexTTTMask)."""
        L = input_ids.shape[1]
        hidden = self.fuse(aux_hidden)  # [B, L, H]
        # per layer: keys/values of steps 0..k-1, [B, kv_heads, kL, head_dim]
        pasts: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.layers)
        logits = []
        for k in range(steps):
            # step k reads t_{i+1+k} at index i; the tail has no token (fill 0)
            ids = torch.zeros_like(input_ids)
            if k + 1 < L:
                ids[:, : L - k - 1] = input_ids[:, k + 1:]
            cos, sin = rope_cos_sin(position_ids + k, self.config.head_dim, self.config.rope_theta)
            mask = mask_of(k)
            embeds = self.embed_tokens(ids)
            for n, layer in enumerate(self.layers):
                past = pasts[n]
                hidden, (k_new, v_new) = layer(embeds, hidden, cos, sin, mask, past)
                pasts[n] = (k_new, v_new) if past is None else (
                    torch.cat([past[0], k_new], dim=2), torch.cat([past[1], v_new], dim=2))
            logits.append(hidden if return_hidden else self.lm_head(self.norm(hidden)))
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
        [B, T, H] (the drafter's own pre-norm output fed back);
        position_ids [B, T]: the position of each hidden state (+k at draft
        step k). New tokens attend to everything in `cache` and causally among
        themselves; their keys/values are appended to it.

        Returns logits [B, T, Dv] and the pre-norm state [B, T, H] to feed back.
        """
        H = self.config.hidden_size
        if hidden.shape[-1] == self.config.num_aux_layers * H:
            hidden = self.fc(hidden)
        elif hidden.shape[-1] != H:
            raise ValueError(f"hidden must have last dim {H} or "
                             f"{self.config.num_aux_layers * H}, got {hidden.shape[-1]}")
        T = input_ids.shape[1]
        P = 0 if cache is None else cache.length
        # [T, P+T]: every cached entry, then causal among the new tokens
        j = torch.arange(P + T, device=input_ids.device)
        i = torch.arange(T, device=input_ids.device)
        mask = (j[None, :] <= (i[:, None] + P))[None, None]  # [1, 1, T, P+T]
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta)
        embeds, out, kv = self.embed_tokens(input_ids), hidden, []
        for n, layer in enumerate(self.layers):
            out, new = layer(embeds, out, cos, sin, mask, None if P == 0 else cache.past(n))
            kv.append(new)
        if cache is not None:
            cache.append(kv)
        return self.lm_head(self.norm(out)), out

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
