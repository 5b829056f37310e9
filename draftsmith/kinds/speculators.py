"""The speculators format's parts every kind shares (vllm/transformers_utils/configs/speculators/): the drafter's
shape as `transformer_layer_config`, and the `speculators_config` envelope naming the proposal length and the
verifier; written and read back here, so that the kinds differ only in their own keys. No torch."""

from __future__ import annotations

from draftsmith import DraftsmithError


def position_keys(config) -> dict:
    """The activation, norm epsilon, context and plain RoPE every drafter config.json states (speculators' and the
    native MLA one)."""
    return {
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rope_theta": config.rope_theta,
        "vocab_size": config.vocab_size,
    }


def layer_config(config, model_type: str, architecture: str) -> dict:
    """The transformer_layer_config keys every kind shares: the drafter's shape, plain RoPE with the target's theta
    as in training (never the target's scaling; rope_theta also beside rope_parameters, since qwen3_dflash reads
    it there and defaults to 1e6 when absent), no biases, an untied head."""
    return {
        "model_type": model_type,
        "architectures": [architecture],
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        **position_keys(config),
        "attention_bias": False,
        "tie_word_embeddings": False,
    }


def envelope(algorithm: str, speculative_tokens: int, target_name: str, target_arch: str) -> dict:
    """speculators_config: the proposal length and the verifier. vLLM reads name_or_path only for
    `vllm serve EXPORT_DIR` (it then serves that model with the drafter attached); `vllm serve TARGET
    --speculative-config ...` uses TARGET."""
    return {
        "algorithm": algorithm,
        "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                              "verifier_accept_k": 1, "accept_tolerance": 0.0}],
        "verifier": {"name_or_path": target_name, "architectures": [target_arch]},
    }


def read_envelope(config_json: dict, where: str) -> tuple[int, str]:
    """(speculative tokens, verifier name) of an export's speculators_config."""
    sc = config_json.get("speculators_config")
    try:
        return int(sc["proposal_methods"][0]["speculative_tokens"]), str(sc["verifier"]["name_or_path"])
    except (KeyError, IndexError, TypeError, ValueError):
        raise DraftsmithError(f"{where}: 'speculators_config' needs proposal_methods[0].speculative_tokens "
                              "and verifier.name_or_path") from None


def read_layer(config_json: dict, where: str) -> dict:
    """transformer_layer_config, with the keys every kind needs present."""
    layer = config_json.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DraftsmithError(f"{where}: missing 'transformer_layer_config'")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if key not in layer:
            raise DraftsmithError(f"{where}: missing 'transformer_layer_config.{key}'")
    return layer


def aux_list(value, where: str, key: str) -> list[int]:
    if not (isinstance(value, list) and value and all(isinstance(x, int) and not isinstance(x, bool)
                                                      for x in value)):
        raise DraftsmithError(f"{where}: '{key}' must be a list of layer ids, got {value!r}")
    return value


def int_key(config_json: dict, key: str, where: str) -> int:
    value = config_json.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise DraftsmithError(f"{where}: '{key}' must be an int, got {value!r}")
    return value


# what vLLM builds when a config leaves rms_norm_eps out (transformers' LlamaConfig, Qwen3Config, DeepseekV2Config)
EPS_DEFAULT = 1e-6


def layer_shape(layer: dict, config_json: dict, aux: list[int], theta: float) -> dict:
    """The DrafterConfig size fields of a transformer_layer_config (the kind adds its own)."""
    return dict(
        hidden_size=layer["hidden_size"], intermediate_size=layer["intermediate_size"],
        num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer.get("num_key_value_heads") or layer["num_attention_heads"],
        head_dim=layer.get("head_dim"), rms_norm_eps=float(layer.get("rms_norm_eps", EPS_DEFAULT)),
        rope_theta=float(theta), max_position_embeddings=layer.get("max_position_embeddings", 8192),
        vocab_size=layer["vocab_size"], draft_vocab_size=config_json.get("draft_vocab_size") or layer["vocab_size"],
        num_aux_layers=len(aux), hidden_act=layer.get("hidden_act", "silu"),
        num_hidden_layers=layer.get("num_hidden_layers", 1))


def build(config_cls, where: str, **kwargs):
    """A DrafterConfig, its ValueError as the one-line error of the file it was read from."""
    try:
        return config_cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise DraftsmithError(f"{where}: invalid drafter config ({e})") from None
