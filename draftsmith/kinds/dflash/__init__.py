"""DFlash (block drafting, arXiv:2602.06036): one forward drafts a whole block, the bonus token then block_size - 1
mask slots, with attention both ways inside the block, Qwen3 layers whose keys and values also read the target's
states of every earlier position (through fc and hidden_norm, never through the layers). Trained on
train.dflash_anchors blocks per row, slot k's loss weighted gamma**(k-1) (train/dflash.py); served by vLLM's dflash
method (DFlashQwen3ForCausalLM) from speculators_model_type "dflash", with exactly block_size - 1 drafts. The model
is model/dflash.py. Block size: train.block_size (unset: ttt_steps + 1).
"""

from __future__ import annotations

from draftsmith import DraftsmithError
from draftsmith.kinds import Kind
from draftsmith.kinds.peagle import mask_token
from draftsmith.kinds.speculators import (aux_list, build, envelope, int_key, layer_config, layer_shape,
                                          read_envelope, read_layer)
from draftsmith.model.config import DrafterConfig


class DFlash(Kind):
    name = "dflash"
    label = "DFlash"
    speculators_type = "dflash"
    vllm_method = "dflash"
    block = True
    architecture = "DFlashDraftModel"
    not_in_eagle_layout = ("a block drafter (Qwen3 layers drafting a whole block in one non-causal pass from the "
                           "target's context states), which a causal midlayer drafting a chain cannot hold")

    # -- config --------------------------------------------------------------------------------
    def block_size(self, tc) -> int:
        return int(tc.block_size or tc.ttt_steps + 1)

    def drafts(self, tc) -> int:
        return self.block_size(tc) - 1

    def config_options(self, tc, hf_cfg, attention):
        if tc.norm_before_fc or tc.fc_norm or tc.norm_output:
            raise DraftsmithError(f"train.method={self.name}: the EAGLE-3.1 norms (norm_before_fc, fc_norm, "
                                  f"norm_output) are EAGLE-3's; {self.label} norms fc's output (hidden_norm) instead")
        if attention == "mla":
            raise DraftsmithError(f"train.method={self.name}: vLLM 0.32 serves {self.label} drafters with Qwen3 (gqa) "
                                  "attention only; set train.drafter_attention=gqa or auto")
        return "gqa", {"mask_token_id": mask_token(tc, hf_cfg), "block_size": self.block_size(tc), "kind": self.name,
                       "options": dict(tc.drafter_options)}

    def check_config(self, config) -> None:
        if config.mask_token_id is None or not config.block_size:
            raise ValueError(f"a {self.label} drafter needs mask_token_id and block_size")
        if config.norm_before_fc or config.fc_norm or config.norm_output:
            raise ValueError(f"a {self.label} drafter has none of EAGLE-3.1's norms")

    # -- export --------------------------------------------------------------------------------
    def export_keys(self, config) -> dict[str, str]:
        """vLLM's qwen3_dflash names (the same as model/dflash.py's); embed_tokens left out (the target's)."""
        names = ["fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"]
        for n in range(config.num_hidden_layers):
            names += [f"layers.{n}.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm",
                                                                     "k_norm")]
            names += [f"layers.{n}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
            names += [f"layers.{n}.{m}.weight" for m in ("input_layernorm", "post_attention_layernorm")]
        return {k: k for k in names}

    def write_config(self, config, aux_layers, *, target_name, target_arch, num_speculative_tokens, dtype,
                     draftsmith) -> dict:
        """config.json of a block drafter.

        Gotchas: vLLM reads the aux ids from `aux_hidden_state_layer_ids` (not EAGLE's key), in EAGLE's convention
        (id L: the state after L layers; it derives z-lab's `target_layer_ids` = L - 1 itself, vllm#40727); its
        attention inside the block is non-causal only with `sliding_window_non_causal` true (its default); it
        ignores `block_size`, so the drafts served must be given as speculative_tokens = block_size - 1; and it does
        not raise the drafter's max_position_embeddings to the target's, so the target's is written."""
        return {
            "architectures": [self.architecture],
            "speculators_model_type": self.speculators_type,
            "transformer_layer_config": {**layer_config(config, "qwen3", "Qwen3ForCausalLM"), "dtype": dtype},
            "draft_vocab_size": config.draft_vocab_size,
            "target_hidden_size": config.hidden_size,
            "aux_hidden_state_layer_ids": list(aux_layers),
            "mask_token_id": config.mask_token_id,
            "block_size": config.block_size,
            "sliding_window_non_causal": True,
            **self._extra_keys(config),
            "speculators_config": envelope(self.speculators_type, config.block_size - 1, target_name, target_arch),
            "dtype": dtype,
            "draftsmith": draftsmith,
        }

    def _extra_keys(self, config) -> dict:
        return {}

    def _read_extra(self, config_json: dict, where: str) -> dict:
        return {}

    def aux_ids(self, config_json: dict):
        return config_json.get("aux_hidden_state_layer_ids")

    def read_config(self, config_json: dict, where: str):
        layer = read_layer(config_json, where)
        aux = aux_list(config_json.get("aux_hidden_state_layer_ids"), where, "aux_hidden_state_layer_ids")
        if config_json.get("sliding_window_non_causal", True) is not True:
            raise DraftsmithError(f"{where}: 'sliding_window_non_causal' must be true (draftsmith's {self.label} "
                                  "attends both ways inside the block)")
        mask, block = int_key(config_json, "mask_token_id", where), int_key(config_json, "block_size", where)
        spec, verifier = read_envelope(config_json, where)
        if spec != block - 1:
            raise DraftsmithError(f"{where}: a {self.label} drafter drafts block_size - 1 = {block - 1} tokens, but "
                                  f"speculative_tokens is {spec}")
        rope = layer.get("rope_parameters") or {}
        theta = rope.get("rope_theta", layer.get("rope_theta", 1e6))  # qwen3_dflash's default
        config = build(DrafterConfig, where, **layer_shape(layer, config_json, aux, theta), mask_token_id=mask,
                       block_size=block, kind=self.name, options=self._read_extra(config_json, where))
        return config, aux, spec, verifier

    # -- estimate ------------------------------------------------------------------------------
    def layer_params(self, t, num_layers: int, num_aux: int = 3) -> tuple[int, int]:
        """fc over the fused aux states and hidden_norm; Qwen3 layers whose q/k/v read h (the block's tokens; the
        context's keys and values come from the same k/v projections), with per-head q/k norms."""
        h, q = t.hidden_size, t.q_dim or t.hidden_size
        layer = h * (q + 2 * t.kv_dim) + q * h + 3 * h * t.intermediate_size
        return num_aux * h * h + num_layers * layer, num_layers * layer

    def train_notes(self, tr) -> list[str]:
        block = self.block_size(tr)
        return [f"train.method={self.name}: memory and time are EAGLE-3's TTT over {block - 1} steps, an upper bound: "
                f"a {self.label} row holds train.dflash_anchors x block_size = {tr.dflash_anchors * block:,} block "
                f"queries against TTT's seq_len x steps = {tr.seq_len * (block - 1):,}"]


KIND = DFlash()
