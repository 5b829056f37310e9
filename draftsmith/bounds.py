"""Every input from outside is bounded where it enters: the one module that owns what a number may be.

- Environment variables draftsmith reads (`env_number`, `env_int`): a value that is not a number, not finite or
  outside its range is a one-line error naming the variable, never a traceback or a silent oddity.
- Model configs (`model_config`, `check_model_numbers`): a target's config.json (its text config, for a multimodal
  wrapper) and an exported drafter's, checked the same way wherever they are read: each size a positive whole
  number within what any real model has (MODEL_INTS), each float finite and in range (MODEL_FLOATS), the file a
  JSON object whose `text_config` is one too. `estimate`, target loading and export's readers call it, so that
  `hidden_size: -1` or `num_hidden_layers: 1e9` is refused in one line naming the file and field instead of
  printing negative memory, 36 million hours, or allocating until the machine gives out.

No torch, nothing of draftsmith but the error type.
"""

from __future__ import annotations

import math
import os
from typing import Any

from draftsmith import DraftsmithError

# (lowest, highest) whole numbers any real model has; the highest are generous: a 1T-parameter MoE is far inside
MODEL_INTS: dict[str, tuple[int, int]] = {
    "hidden_size": (1, 1 << 17), "num_hidden_layers": (1, 1 << 11), "vocab_size": (2, 1 << 23),
    "intermediate_size": (1, 1 << 20), "num_attention_heads": (1, 1 << 12), "num_key_value_heads": (1, 1 << 12),
    "head_dim": (1, 1 << 13), "max_position_embeddings": (1, 1 << 26), "kv_lora_rank": (1, 1 << 16),
    "q_lora_rank": (1, 1 << 16), "qk_nope_head_dim": (1, 1 << 13), "qk_rope_head_dim": (1, 1 << 13),
    "v_head_dim": (1, 1 << 13), "moe_intermediate_size": (1, 1 << 20), "n_routed_experts": (1, 1 << 14),
    "num_local_experts": (1, 1 << 14), "num_experts": (1, 1 << 14), "num_experts_per_tok": (1, 1 << 10),
    "n_shared_experts": (0, 1 << 10), "first_k_dense_replace": (0, 1 << 11),
    "shared_expert_intermediate_size": (0, 1 << 20), "draft_vocab_size": (2, 1 << 23), "block_size": (2, 1 << 10),
    "target_hidden_size": (1, 1 << 17), "num_aux_hidden_states": (1, 64),
}
# (lowest exclusive, highest inclusive) floats
MODEL_FLOATS: dict[str, tuple[float, float]] = {"rms_norm_eps": (0.0, 1.0), "rope_theta": (0.0, 1e12),
                                                "layer_norm_eps": (0.0, 1.0)}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# a drafter is a few layers: more than this is a corrupt or edited config.json, not a drafter (1e9 layers would
# allocate until the machine gives out)
DRAFTER_MAX_LAYERS = 64


def check_model_numbers(c: dict, where: str, required: tuple[str, ...] = (), drafter: bool = False) -> dict:
    """`c` (a model config as a dict) with every known size and float checked (module doc); `required` fields must
    be present; `drafter`: a drafter's config (at most DRAFTER_MAX_LAYERS layers). Returns `c`; raises
    DraftsmithError naming `where` and the field."""
    if drafter and _is_int(c.get("num_hidden_layers")) and c["num_hidden_layers"] > DRAFTER_MAX_LAYERS:
        raise DraftsmithError(f"{where}: 'num_hidden_layers' is {c['num_hidden_layers']}, more than any drafter has "
                              f"(at most {DRAFTER_MAX_LAYERS})")
    for key in required:
        if key not in c:
            raise DraftsmithError(f"{where}: no '{key}' in the model config")
    for key, (lo, hi) in MODEL_INTS.items():
        v = c.get(key)
        if v is None and key not in required:
            continue
        if isinstance(v, float) and v.is_integer() and math.isfinite(v):
            v = int(v)  # 4096.0: a whole number written as a float
        if not _is_int(v):
            raise DraftsmithError(f"{where}: '{key}' must be a whole number, got {v!r}")
        if not lo <= v <= hi:
            raise DraftsmithError(f"{where}: '{key}' is {v}, outside what any model has ({lo}..{hi})")
    for key, (lo, hi) in MODEL_FLOATS.items():
        v = c.get(key)
        if v is None:
            continue
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or not lo < v <= hi:
            raise DraftsmithError(f"{where}: '{key}' must be a finite number in ({lo:g}, {hi:g}], got {v!r}")
    return c


def model_config(data: Any, where: str, required: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """(the whole config, its text config) of a parsed config.json, checked (module doc): a multimodal wrapper keeps
    its language model's config under `text_config`."""
    if not isinstance(data, dict):
        raise DraftsmithError(f"{where}: a model config must be a JSON object, got {type(data).__name__}")
    text = data.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise DraftsmithError(f"{where}: 'text_config' must be a JSON object, got {type(text).__name__}")
    text = text or data
    return data, check_model_numbers(text, where, required)


def _env(name: str, default, lo, hi, parse, kind: str, hint: str):
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        v = parse(raw)
    except ValueError:
        raise DraftsmithError(f"${name}={raw[:40]!r}: not {kind}{hint}") from None
    if not (math.isfinite(v) and lo <= v <= hi):
        span = f"{lo}..{hi}" if parse is int else f"{lo:g}..{hi:g}"
        raise DraftsmithError(f"${name}={raw[:40]!r}: must be in {span}{hint}")
    return v


def env_number(name: str, default: float, lo: float, hi: float) -> float:
    """$name as a finite number in [lo, hi], or `default` when unset or empty; anything else is a one-line error."""
    return _env(name, default, lo, hi, float, "a number", "")


def env_int(name: str, default: int, lo: int, hi: int, hint: str = "") -> int:
    """$name as a whole number in [lo, hi], or `default` when unset or empty; anything else is a one-line error
    (`hint`: what to do about it, e.g. who sets the variable)."""
    return _env(name, default, lo, hi, int, "a whole number", hint)
