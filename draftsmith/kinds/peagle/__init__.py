"""P-EAGLE (parallel EAGLE, arXiv:2602.01469): the EAGLE-3 drafter whose draft steps after the first read a mask
slot (the mask token's embedding beside a learned stand-in for the target's states, `mask_hidden` [A*H]) instead
of their own output, so one pass proposes all K: the bonus token, then K-1 mask slots. Trained as TTT whose later
steps read the mask slot; served by vLLM's eagle3 method with parallel_drafting (vLLM 0.32 has no method "peagle";
its speculators loader maps the type), from speculators_model_type "peagle", which takes EAGLE-3.1's norms inside
transformer_layer_config. Gqa attention only. The model is model/peagle.py.
"""

from __future__ import annotations

from draftsmith import DraftsmithError
from draftsmith.kinds.eagle3 import NORMS, Eagle3
from draftsmith.model.config import drafter_attention


def default_mask_token(hf_cfg) -> int:
    """train.mask_token_id unset: the target config's pad token, else its (first) end-of-sequence token, else the
    vocabulary's last id. Any id in the vocabulary serves: a slot is told apart by what the drafter learns of it."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(hf_cfg, name, None)
        value = value[0] if isinstance(value, (list, tuple)) and value else value
        if isinstance(value, int) and 0 <= value < hf_cfg.vocab_size:
            return value
    return int(hf_cfg.vocab_size) - 1


def mask_token(tc, hf_cfg) -> int:
    return tc.mask_token_id if tc.mask_token_id is not None else default_mask_token(hf_cfg)


class PEagle(Eagle3):
    name = "peagle"
    label = "P-EAGLE"
    speculators_type = "peagle"
    formats = ("speculators",)
    not_in_eagle_layout = ("its later drafts read mask slots (mask_hidden, parallel drafting), which SGLang's "
                           "LlamaForCausalLMEagle3 neither loads nor runs")
    parallel_drafting = True
    attentions = ("gqa",)
    architecture = "PEagleSpeculator"

    def config_options(self, tc, hf_cfg, attention):
        if drafter_attention(hf_cfg, attention) == "mla":
            raise DraftsmithError("train.method=peagle: vLLM 0.32 serves P-EAGLE with no MLA drafter; set "
                                  "train.drafter_attention=gqa, or train eagle3")
        options = {n: getattr(tc, n) for n in NORMS}
        return "gqa", {**options, "mask_token_id": mask_token(tc, hf_cfg), "kind": self.name}

    def check_config(self, config) -> None:
        if config.block_size is not None:
            raise ValueError(f"block_size: {self.label} drafters draft a chain, not blocks")
        if config.mask_token_id is None:
            raise ValueError(f"mask_token_id: {self.label} drafters need the token their mask slots read")

    def export_keys(self, config) -> dict[str, str]:
        return {**super().export_keys(config), "mask_hidden": "mask_hidden"}  # vLLM's parallel drafting needs it

    def _layer_norms(self, norms: dict) -> dict:
        return norms  # vLLM's peagle reads them inside transformer_layer_config (norm_before_fc: both places)

    def _extra_keys(self, config) -> dict:
        return {"mask_token_id": config.mask_token_id}

    def _norm_value(self, config_json: dict, layer: dict, key: str):
        return config_json.get(key) if key == "norm_before_fc" else layer.get(key)

    def _read_extra(self, config_json: dict, where: str) -> dict:
        mask = config_json.get("mask_token_id")
        if not isinstance(mask, int) or isinstance(mask, bool):
            raise DraftsmithError(f"{where}: 'mask_token_id' must be a token id for peagle, got {mask!r}")
        return {"mask_token_id": mask}

    def reads(self, config_json: dict) -> bool:
        return config_json.get("speculators_model_type") == self.speculators_type

    def fold_fc_scale(self, state_dict: dict, scale) -> None:
        # training fed mask_hidden to fc unscaled, so fc(m) = (W diag(s)) (m / s)
        state_dict["mask_hidden"] = state_dict["mask_hidden"].float() / scale

    def layer_params(self, t, num_layers: int, num_aux: int = 3) -> tuple[int, int]:
        layers_fc, per_step = super().layer_params(t, num_layers, num_aux)
        return layers_fc + num_aux * t.hidden_size, per_step  # + mask_hidden [A*H]


KIND = PEagle()
