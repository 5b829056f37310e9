"""EAGLE-3 (arXiv:2503.01840) with EAGLE-3.1's norms: a chain drafter. Each draft step reads the next token's
embedding beside a state (the target's fused aux states at the first step, its own output after), so K drafts
take K passes; trained with training-time test over train.ttt_steps unrolled steps (train/objective.py).

Attention: Llama (gqa), served by vLLM's llama_eagle3 from the speculators format (speculators_model_type
"eagle3"); or, beside an MLA target (DeepSeek-V3, Kimi-K2/K2.5), multi-head latent attention, served as
Eagle3DeepseekV3ForCausalLM from a native config.json (vLLM 0.32's speculators loader maps no MLA layer).

export.format=eagle3 writes a Llama drafter in the EAGLE-3 layout instead: the EAGLE authors' and SpecForge's
LlamaForCausalLMEagle3 folder, which SGLang loads (python/sglang/srt/models/llama_eagle3.py) and vLLM too (its
registry maps the architecture to llama_eagle3.Eagle3LlamaForCausalLM, which renames midlayer.* to layers.0.*). It
holds one decoder layer, three aux states and no EAGLE-3.1 norm (SGLang builds none of them and skips any tensor
it does not know without a word). The aux ids are stated twice, since the two engines count them differently:
eagle_config's as SGLang reads them (it captures the output of decoder layer id, i.e. the input of id + 1), the
top-level key as vLLM does (the input of decoder layer id), which vLLM reads before eagle_config. An MLA drafter
is written as its native folder under either format: that folder is already the EAGLE-3 layout vLLM reads for it.

Options: none of its own; EAGLE-3.1's norms are DrafterConfig fields (train.norm_before_fc, fc_norm,
norm_output), which P-EAGLE shares. The model is model/eagle3.py (and model/mla.py for its MLA attention).
"""

from __future__ import annotations

from draftsmith import DraftsmithError
from draftsmith.kinds import Kind
from draftsmith.kinds.speculators import (aux_list, build, envelope, layer_config, layer_shape, position_keys,
                                          read_envelope, read_layer)
from draftsmith.model.config import DrafterConfig, drafter_attention

# the architecture vLLM 0.32 serves an MLA EAGLE-3 drafter with (vllm/model_executor/models/deepseek_eagle3.py)
MLA_ARCHITECTURE = "Eagle3DeepseekV3ForCausalLM"
# the EAGLE-3 layout's architecture: SGLang's class name (its only one), and vLLM's registry maps it too; the second
# name is vLLM's own for the same folder, read back as well
EAGLE_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# the one decoder layer, under its name in the EAGLE-3 layout (SGLang's LlamaModel.midlayer)
MIDLAYER = "midlayer."
# the target states SGLang's fc fuses: Linear(target_hidden_size * 3, hidden_size), whatever the config says
EAGLE_AUX = 3
NORMS = ("norm_before_fc", "fc_norm", "norm_output")


class Eagle3(Kind):
    name = "eagle3"
    label = "EAGLE-3"
    speculators_type = "eagle3"
    attentions = ("gqa", "mla")
    formats = ("speculators", "eagle3")

    # -- config --------------------------------------------------------------------------------
    def config_options(self, tc, hf_cfg, attention):
        options = {n: getattr(tc, n) for n in NORMS}
        if any(options.values()) and drafter_attention(hf_cfg, attention) == "mla":
            # vLLM 0.32's MLA EAGLE-3 (deepseek_eagle3) is not built from the speculators config these options live in
            raise DraftsmithError(f"train.method={self.name} with EAGLE-3.1's norms: vLLM 0.32 serves them with no MLA "
                                  "drafter; set train.drafter_attention=gqa, or leave the norms off")
        return attention, {**options, "kind": self.name}

    def check_config(self, config) -> None:
        if config.block_size is not None:
            raise ValueError(f"block_size: {self.label} drafters draft a chain, not blocks")
        if config.mask_token_id is not None:
            raise ValueError(f"mask_token_id: {self.label} drafters read no mask slots")

    # -- export --------------------------------------------------------------------------------
    def export_keys(self, config) -> dict[str, str]:
        """Model parameter name -> name in the exported safetensors. One-to-one today (model/eagle3.py and
        model/mla.py name their parameters after vLLM's), but spelled out so that a rename on either side is one
        edit here and so that the exported key set is fixed: embed_tokens is left out on purpose (vLLM then shares
        the target's, which the drafter trained with). Layers after the first have no hidden_norm (vLLM builds one
        there but never uses it, and its eagle3 loader leaves it at ones)."""
        if config.attention == "mla":
            attn = (["q_a_proj", "q_a_layernorm", "q_b_proj"] if config.q_lora_rank else ["q_proj"]) + [
                "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
        else:
            attn = [f"{p}_proj" for p in "qkvo"]
        names = ["fc.weight"]
        for n in range(config.num_hidden_layers):
            norms = ("input_layernorm", "hidden_norm", "post_attention_layernorm") if n == 0 else (
                "input_layernorm", "post_attention_layernorm")
            names += [f"layers.{n}.self_attn.{p}.weight" for p in attn]
            names += [f"layers.{n}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
            names += [f"layers.{n}.{m}.weight" for m in norms]
        names += ["norm.weight", "lm_head.weight", "d2t", "t2d"]
        if config.norm_before_fc:
            names.append("input_norm.weight")
        if config.fc_norm:
            names += [f"fc_norm.{j}.weight" for j in range(config.num_aux_layers)]
        return {k: k for k in names}

    def write_config(self, config, aux_layers, *, target_name, target_arch, num_speculative_tokens, dtype,
                     draftsmith) -> dict:
        """config.json for vLLM: the speculators format (`target_name`: the verifier's name_or_path, a Hub id or the
        target as the config names it); an MLA drafter's native folder."""
        if config.attention == "mla":
            return native_mla_config(config, aux_layers, target_name=target_name, target_arch=target_arch,
                                     num_speculative_tokens=num_speculative_tokens, dtype=dtype, draftsmith=draftsmith)
        norms = {n: getattr(config, n) for n in NORMS}
        layer = {
            **layer_config(config, "llama", "LlamaForCausalLM"),
            "mlp_bias": False,
            # vLLM's Llama EAGLE-3 sizes fc for this many aux states, 3 when absent: it does not count the ids below
            "num_aux_hidden_states": len(aux_layers),
            "dtype": dtype,
            **self._layer_norms(norms),
        }
        return {
            "architectures": [self.architecture],
            "speculators_model_type": self.speculators_type,
            "transformer_layer_config": layer,
            "draft_vocab_size": config.draft_vocab_size,
            # vLLM's default for speculators eagle3 is True; model/eagle3.py's residual is the raw state
            "norm_before_residual": False,
            **norms,
            **self._extra_keys(config),
            "target_hidden_size": config.hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(aux_layers),
            "speculators_config": envelope(self.speculators_type, num_speculative_tokens, target_name, target_arch),
            "dtype": dtype,
            "draftsmith": draftsmith,
        }

    architecture = "Eagle3Speculator"

    def check_format(self, fmt, config=None, aux_layers=None) -> None:
        super().check_format(fmt, config, aux_layers)
        if fmt != "eagle3" or config is None or config.attention == "mla":
            return  # an MLA drafter's native folder is its EAGLE-3 layout under either format
        why = None
        if config.num_hidden_layers != 1:
            why = (f"the drafter has {config.num_hidden_layers} decoder layers and the layout one (SGLang's "
                   "midlayer; vLLM maps only midlayer to layers.0)")
        elif any(getattr(config, n) for n in NORMS):
            why = "the drafter has EAGLE-3.1's norms, which SGLang's LlamaForCausalLMEagle3 neither builds nor loads"
        elif config.num_aux_layers != EAGLE_AUX:
            why = f"SGLang's fc fuses {EAGLE_AUX} target states and the drafter {config.num_aux_layers}"
        elif aux_layers is not None and 0 in aux_layers:
            why = ("aux layer id 0 (the embeddings) has no id in SGLang's count (the output of decoder layer id - 1 "
                   "= -1)")
        if why:
            raise DraftsmithError(f"export.format: eagle3 cannot hold this drafter: {why}; set "
                                  "export.format=speculators")

    def layout(self, config_json: dict) -> str:
        return "eagle3" if _eagle_layout(config_json) else super().layout(config_json)

    def write_export(self, fmt, config, aux_layers, **kw) -> dict:
        if fmt == "eagle3" and config.attention != "mla":
            self.check_format(fmt, config, aux_layers)
            return eagle_layout_config(config, aux_layers, **kw)
        return super().write_export(fmt, config, aux_layers, **kw)

    def layout_keys(self, keys, config, fmt):
        if fmt != "eagle3" or config.attention == "mla":
            return keys
        return {k: MIDLAYER + v.removeprefix("layers.0.") if v.startswith("layers.0.") else v for k, v in keys.items()}

    def _layer_norms(self, norms: dict) -> dict:
        """The norms vLLM reads inside transformer_layer_config (eagle3: none; it reads them at the top level)."""
        return {}

    def _extra_keys(self, config) -> dict:
        return {}

    def _read_extra(self, config_json: dict, where: str) -> dict:
        return {}

    def reads(self, config_json: dict) -> bool:
        return (config_json.get("speculators_model_type") == self.speculators_type
                or config_json.get("architectures") == [MLA_ARCHITECTURE] or _eagle_layout(config_json))

    def format_name(self, config_json: dict) -> str:
        if config_json.get("architectures") == [MLA_ARCHITECTURE]:
            return MLA_ARCHITECTURE
        if _eagle_layout(config_json):
            return f"EAGLE-3 layout ({config_json['architectures'][0]})"
        return super().format_name(config_json)

    def aux_ids(self, config_json: dict):
        if config_json.get("architectures") == [MLA_ARCHITECTURE]:
            return (config_json.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if _eagle_layout(config_json):
            return _eagle_aux(config_json)
        return config_json.get("eagle_aux_hidden_state_layer_ids")

    def read_config(self, config_json: dict, where: str):
        if config_json.get("architectures") == [MLA_ARCHITECTURE]:
            return mla_config_from_export(config_json, where)
        if _eagle_layout(config_json):
            return eagle_layout_from_export(config_json, where)
        layer = read_layer(config_json, where)
        spec, verifier = read_envelope(config_json, where)
        num_layers = layer.get("num_hidden_layers", 1)
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
            raise DraftsmithError(f"{where}: 'transformer_layer_config.num_hidden_layers' must be an int >= 1, "
                                  f"got {num_layers!r}")
        if config_json.get("norm_before_residual", True):
            raise DraftsmithError(f"{where}: 'norm_before_residual' must be false (draftsmith's drafter keeps "
                                  "the raw hidden state as the residual; vLLM's default is true)")
        norms = {}
        for key in NORMS:
            value = self._norm_value(config_json, layer, key)
            if not isinstance(value, (bool, type(None))):
                raise DraftsmithError(f"{where}: '{key}' must be true or false, got {value!r}")
            norms[key] = bool(value)
        rope = layer.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise DraftsmithError(f"{where}: 'transformer_layer_config.rope_parameters.rope_type' must be "
                                  f"\"default\" (draftsmith trains with plain RoPE), got {rope.get('rope_type')!r}")
        theta = rope.get("rope_theta", layer.get("rope_theta"))
        if theta is None:
            raise DraftsmithError(f"{where}: missing 'transformer_layer_config.rope_parameters.rope_theta'")
        if layer.get("rope_theta") is not None and float(layer["rope_theta"]) != float(theta):
            raise DraftsmithError(f"{where}: 'rope_theta' ({layer['rope_theta']}) disagrees with rope_parameters "
                                  f"({theta})")
        aux = aux_list(config_json.get("eagle_aux_hidden_state_layer_ids"), where, "eagle_aux_hidden_state_layer_ids")
        if config_json.get("target_hidden_size") not in (None, layer["hidden_size"]):
            raise DraftsmithError(f"{where}: 'target_hidden_size' ({config_json['target_hidden_size']}) differs from "
                                  f"the drafter's hidden_size ({layer['hidden_size']}); not supported")
        config = build(DrafterConfig, where, **layer_shape(layer, config_json, aux, theta), **norms, kind=self.name,
                       **self._read_extra(config_json, where))
        return config, aux, spec, verifier

    def _norm_value(self, config_json: dict, layer: dict, key: str):
        """Where vLLM reads a norm switch: the top level for eagle3."""
        return config_json.get(key)

    # -- estimate ------------------------------------------------------------------------------
    def layer_params(self, t, num_layers: int, num_aux: int = 3) -> tuple[int, int]:
        """fc over the fused aux states, a first decoder layer (Llama, or MLA beside an MLA target) at the
        target's widths whose q/k/v read [embedding; hidden] (2h), num_layers - 1 plain ones (q/k/v read h)."""
        h, q = t.hidden_size, t.q_dim or t.hidden_size
        mlp = 3 * h * t.intermediate_size
        if t.drafter_mla:  # model/mla.py's projections (norms left out, as for the Llama layer)
            heads, q_rank, kv_rank, nope, rope, v = t.drafter_mla

            def attention(width: int) -> int:
                qk = heads * (nope + rope)
                q_params = width * q_rank + q_rank * qk if q_rank else width * qk
                return q_params + width * (kv_rank + rope) + kv_rank * heads * (nope + v) + heads * v * h

            layers = attention(2 * h) + mlp + (num_layers - 1) * (attention(h) + mlp)
        else:
            layers = (2 * h * (q + 2 * t.kv_dim) + q * h + mlp
                      + (num_layers - 1) * (h * (q + 2 * t.kv_dim) + q * h + mlp))
        return num_aux * h * h + layers, layers


def native_mla_config(config, aux_layers: list[int], *, target_name: str, target_arch: str,
                      num_speculative_tokens: int, dtype: str, draftsmith: dict) -> dict:
    """config.json of an MLA drafter: the native EAGLE-3 folder vLLM reads as Eagle3DeepseekV3ForCausalLM.
    Not the speculators format: vLLM 0.32's speculators eagle3 loader maps only llama and qwen3 layers.

    Gotcha: `model_type` is deepseek_v2, not deepseek_v3. vLLM rewrites every deepseek_v3 draft config into
    its MTP drafter (SpeculativeConfig.hf_config_override: "Eagle3DeepSeekMTPModel ... not supported"); its
    DeepseekV2Config carries the same MLA fields, and the architecture decides the model class."""
    return {
        "architectures": [MLA_ARCHITECTURE],
        "model_type": "deepseek_v2",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_attention_heads,
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        **position_keys(config),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.hidden_size,
        "norm_before_residual": False,
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layers), "use_aux_hidden_state": True},
        "dtype": dtype,
        "draftsmith": _native_record(draftsmith, num_speculative_tokens, target_name, target_arch),
    }


def _native_record(draftsmith: dict, num_speculative_tokens: int, target_name: str, target_arch: str) -> dict:
    """The draftsmith block of a folder outside the speculators format: no speculators_config there, so the proposal
    length and the verifier are draftsmith's record."""
    return {**draftsmith, "num_speculative_tokens": num_speculative_tokens, "verifier": target_name,
            "verifier_architecture": target_arch}


def _recorded(cj: dict) -> tuple[int, str]:
    """(speculative tokens, verifier) of a folder outside the speculators format (_native_record; 3 and none in a
    folder from elsewhere)."""
    record = cj.get("draftsmith") if isinstance(cj.get("draftsmith"), dict) else {}
    return int(record.get("num_speculative_tokens") or 3), str(record.get("verifier") or "")


def mla_config_from_export(cj: dict, where: str):
    """(DrafterConfig, aux ids, speculative tokens, verifier) from a native MLA export's config.json."""
    if cj.get("model_type") != "deepseek_v2":
        raise DraftsmithError(f"{where}: 'model_type' must be \"deepseek_v2\" for {MLA_ARCHITECTURE} (vLLM turns a "
                              f"deepseek_v3 draft config into its MTP drafter), got {cj.get('model_type')!r}")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "kv_lora_rank",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if key not in cj:
            raise DraftsmithError(f"{where}: missing '{key}'")
    if cj.get("norm_before_residual", False):
        raise DraftsmithError(f"{where}: 'norm_before_residual' must be false (draftsmith's drafter keeps the raw "
                              "hidden state as the residual)")
    rope = cj.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise DraftsmithError(f"{where}: 'rope_parameters.rope_type' must be \"default\", "
                              f"got {rope.get('rope_type')!r}")
    aux = aux_list((cj.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"), where,
                   "eagle_config.eagle_aux_hidden_state_layer_ids")
    shape = layer_shape(cj, cj, aux, rope.get("rope_theta", cj.get("rope_theta", 10000.0)))
    shape.update(num_key_value_heads=cj["num_attention_heads"],
                 head_dim=cj["qk_nope_head_dim"] + cj["qk_rope_head_dim"])
    config = build(DrafterConfig, where, **shape, attention="mla", q_lora_rank=cj.get("q_lora_rank"),
                   kv_lora_rank=cj["kv_lora_rank"], qk_nope_head_dim=cj["qk_nope_head_dim"],
                   qk_rope_head_dim=cj["qk_rope_head_dim"], v_head_dim=cj["v_head_dim"], kind="eagle3")
    return config, aux, *_recorded(cj)


def _eagle_layout(cj: dict) -> bool:
    """Whether a config.json is in the EAGLE-3 layout (by the architecture it names)."""
    arch = cj.get("architectures")
    return isinstance(arch, list) and len(arch) == 1 and arch[0] in EAGLE_ARCHITECTURES


def _eagle_aux(cj: dict):
    """The aux layer ids of an EAGLE-3 layout config.json in vLLM's count (the input of decoder layer id): the
    top-level key, else eagle_config's (SGLang's count, the output of decoder layer id) + 1; None when it has
    neither (the engines then read their default, which draftsmith cannot tell without the target)."""
    if (top := cj.get("eagle_aux_hidden_state_layer_ids")) is not None:
        return top
    nested = (cj.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") if isinstance(
        cj.get("eagle_config"), dict) else None
    if isinstance(nested, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in nested):
        return [x + 1 for x in nested]
    return nested


def eagle_layout_config(config, aux_layers: list[int], *, target_name: str, target_arch: str,
                        num_speculative_tokens: int, dtype: str, draftsmith: dict) -> dict:
    """config.json of a Llama drafter in the EAGLE-3 layout (module doc): the keys SGLang's LlamaForCausalLMEagle3
    reads (a LlamaConfig's shape, draft_vocab_size, target_hidden_size, tie_word_embeddings false, eagle_config's
    aux ids in its count) and those vLLM reads besides (the top-level aux ids in its count, norm_before_residual)."""
    return {
        **layer_config(config, "llama", EAGLE_ARCHITECTURES[0]),
        "mlp_bias": False,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.hidden_size,
        # both engines' default here, stated: model/eagle3.py's residual is the raw state, normed after it is kept
        "norm_before_residual": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in aux_layers], "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": list(aux_layers),
        "torch_dtype": dtype,  # what transformers 4 (SGLang's) reads; dtype what 5 does
        "dtype": dtype,
        "draftsmith": _native_record(draftsmith, num_speculative_tokens, target_name, target_arch),
    }


def eagle_layout_from_export(cj: dict, where: str):
    """(DrafterConfig, aux ids in vLLM's count, speculative tokens, verifier) from an EAGLE-3 layout config.json."""
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if key not in cj:
            raise DraftsmithError(f"{where}: missing '{key}'")
    if cj.get("num_hidden_layers", 1) != 1:
        raise DraftsmithError(f"{where}: 'num_hidden_layers' must be 1 in the EAGLE-3 layout (one midlayer), got "
                              f"{cj.get('num_hidden_layers')!r}")
    for key, why in (("norm_before_residual", "draftsmith's drafter keeps the raw hidden state as the residual"),
                     ("tie_word_embeddings", "the drafter's lm_head is its own, over the draft vocabulary")):
        if cj.get(key, False):
            raise DraftsmithError(f"{where}: '{key}' must be false ({why})")
    rope = cj.get("rope_parameters") or {}
    rope_type = rope.get("rope_type") or (cj.get("rope_scaling") or {}).get("rope_type") or "default"
    if rope_type != "default":
        raise DraftsmithError(f"{where}: the rope_type must be \"default\" (draftsmith trains with plain RoPE), "
                              f"got {rope_type!r}")
    aux = aux_list(_eagle_aux(cj), where, "eagle_aux_hidden_state_layer_ids")
    nested = (cj.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested is not None and nested != [k - 1 for k in aux]:
        raise DraftsmithError(f"{where}: 'eagle_config.eagle_aux_hidden_state_layer_ids' {nested!r} (SGLang's count: "
                              f"the output of layer id) must be 'eagle_aux_hidden_state_layer_ids' {aux!r} (vLLM's: "
                              "the input of layer id) minus 1")
    if cj.get("target_hidden_size") not in (None, cj["hidden_size"]):
        raise DraftsmithError(f"{where}: 'target_hidden_size' ({cj['target_hidden_size']}) differs from the drafter's "
                              f"hidden_size ({cj['hidden_size']}); not supported")
    norms = {}
    for key in NORMS:  # where vLLM reads them (SGLang reads none: draftsmith writes none in this layout)
        if not isinstance(cj.get(key), (bool, type(None))):
            raise DraftsmithError(f"{where}: '{key}' must be true or false, got {cj.get(key)!r}")
        norms[key] = bool(cj.get(key))
    shape = layer_shape(cj, cj, aux, rope.get("rope_theta", cj.get("rope_theta", 10000.0)))
    return build(DrafterConfig, where, **shape, **norms, kind="eagle3"), aux, *_recorded(cj)


KIND = Eagle3()
