"""`export`: turn a training checkpoint into a drafter folder that vLLM serves as is.

The output, RUN/export/, is in the speculators format that vLLM's `eagle3` method reads
(vllm/transformers_utils/configs/speculators/ and vllm/model_executor/models/llama_eagle3.py) for a
Llama-attention drafter; an MLA drafter (train.drafter_attention) is the native EAGLE-3 folder vLLM
serves as Eagle3DeepseekV3ForCausalLM (`native_mla_config`: vLLM's speculators loader knows no MLA layer):

    config.json        speculators config: `speculators_model_type: "eagle3"`,
                       `transformer_layer_config` (a Llama of train.num_layers layers, one by
                       default: shapes, eps, plain RoPE),
                       `draft_vocab_size`, `norm_before_residual: false`, `target_hidden_size`,
                       `eagle_aux_hidden_state_layer_ids`, `speculators_config` (proposal method
                       and verifier = the target's Hub id or its name in the config, never this
                       machine's path), plus a `draftsmith` block (target name as given, architecture,
                       config.json sha256 and folder fingerprint, checkpoint, step)
    model.safetensors  fc, layers.N.*, norm, lm_head, d2t, t2d (no embed_tokens: vLLM then
                       shares the target's embeddings, which is what the drafter trained with)

    vllm serve TARGET --speculative-config '{"model": "RUN/export", "method": "eagle3", "num_speculative_tokens": 3}'

The folder is built beside RUN/export/ and renamed into place, so RUN/export/ always holds a
complete export or none. `load_exported(folder)` reads it back with every file and key checked.

Gotchas that decide whether vLLM computes the same function as training:
- vLLM's speculators loader defaults `norm_before_residual` to True for eagle3; draftsmith's
  layer keeps the raw incoming state as the residual, so the config must say false.
- vLLM builds RoPE from `transformer_layer_config.rope_parameters` (theta 10000 when absent):
  we write the target's theta with `rope_type: default`, the RoPE the drafter trained with.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from draftsmith import DraftsmithError, __version__
from draftsmith.bounds import check_model_numbers
from draftsmith.card import CARD, PROVENANCE, write_card
from draftsmith.checkpoint_format import CKPT_META, CKPT_STATE, CKPT_WEIGHTS, FC_INPUT_SCALE
from draftsmith.model.config import Eagle3Config
from draftsmith.model.drafters import drafter_class, drafter_method
from draftsmith.progress import Progress, journal_failures, log
from draftsmith.rundir import RunDir, file_sha256, read_json_object, replace_dir
from draftsmith.stage import StageBook, one_process
from draftsmith.target import config_sha256, target_info, verifier_name

STAGE = "export"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# the stage's bookkeeping files, carried over when the built folder replaces RUN/export/
BOOKKEEPING = ("config.yaml", "progress.jsonl", "progress.prev.jsonl", "stage.log")


def export_keys(config: "Eagle3Config | int" = 1) -> dict[str, str]:
    """Model parameter name -> name in the exported safetensors, for a drafter config (an int: a Llama-attention
    drafter of that many layers). One-to-one today (model/eagle3.py and model/mla.py name their parameters
    after vLLM's), but spelled out so that a rename on either side is one edit here and so that the exported
    key set is fixed: embed_tokens is left out on purpose (see module doc). Layers after the first have no
    hidden_norm (vLLM builds one there but never uses it, and its eagle3 loader leaves it at ones)."""
    if isinstance(config, int):
        num_layers, attention, q_lora = config, "gqa", None
    else:
        num_layers, attention, q_lora = config.num_hidden_layers, config.attention, config.q_lora_rank
        if config.block_size:
            return _dflash_keys(num_layers)
    if attention == "mla":
        attn = (["q_a_proj", "q_a_layernorm", "q_b_proj"] if q_lora else ["q_proj"]) + [
            "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
    else:
        attn = [f"{p}_proj" for p in "qkvo"]
    keys = {"fc.weight": "fc.weight"}
    for n in range(num_layers):
        norms = ("input_layernorm", "hidden_norm", "post_attention_layernorm") if n == 0 else (
            "input_layernorm", "post_attention_layernorm")
        keys.update({f"layers.{n}.self_attn.{p}.weight": f"layers.{n}.self_attn.{p}.weight" for p in attn})
        keys.update({f"layers.{n}.mlp.{p}_proj.weight": f"layers.{n}.mlp.{p}_proj.weight"
                     for p in ("gate", "up", "down")})
        keys.update({f"layers.{n}.{m}.weight": f"layers.{n}.{m}.weight" for m in norms})
    keys.update({"norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight", "d2t": "d2t", "t2d": "t2d"})
    if not isinstance(config, int):
        if config.norm_before_fc:
            keys["input_norm.weight"] = "input_norm.weight"
        if config.fc_norm:
            keys.update({f"fc_norm.{j}.weight": f"fc_norm.{j}.weight" for j in range(config.num_aux_layers)})
        if config.mask_token_id is not None:
            keys["mask_hidden"] = "mask_hidden"  # P-EAGLE: vLLM's parallel drafting requires it
    return keys


def _dflash_keys(num_layers: int) -> dict[str, str]:
    """A DFlash drafter's tensors, by vLLM's qwen3_dflash names (the same as model/dflash.py's)."""
    names = ["fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"]
    for n in range(num_layers):
        names += [f"layers.{n}.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm",
                                                                 "k_norm")]
        names += [f"layers.{n}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        names += [f"layers.{n}.{m}.weight" for m in ("input_layernorm", "post_attention_layernorm")]
    return {k: k for k in names}


# optional in an export (vLLM uses the target's embeddings when it is absent)
OPTIONAL_KEYS = {"embed_tokens.weight": "embed_tokens.weight"}
# tensors that keep their integer/bool dtype; every other tensor is cast to export.dtype
INDEX_KEYS = ("d2t", "t2d")


# -------------------------------------------------------------------------------------------------
# Checkpoints


def _complete(folder: Path) -> bool:
    return all((folder / f).is_file() for f in (CKPT_WEIGHTS, CKPT_META, CKPT_STATE))


def find_checkpoint(run: RunDir, explicit: str | None = None) -> Path:
    """The checkpoint folder to export: `explicit` (a path, or relative to the run), else
    RUN/train/final, else the newest complete RUN/train/checkpoints/step_N."""
    if explicit:
        p = Path(explicit).expanduser()
        if not p.is_absolute() and not p.exists() and (run.path / p).exists():
            p = run.path / p
        if not p.is_dir():
            raise DraftsmithError(f"export.checkpoint: {p}: no such checkpoint folder")
        for f in (CKPT_WEIGHTS, CKPT_META):
            if not (p / f).is_file():
                raise DraftsmithError(f"export.checkpoint: {p / f}: missing (not a draftsmith checkpoint)")
        if not (p / CKPT_STATE).is_file():
            raise DraftsmithError(f"export.checkpoint: {p}: incomplete checkpoint (no {CKPT_STATE}; "
                                  "it was being written when training stopped)")
        return p.resolve()
    train = run.path / "train"
    if _complete(train / "final"):
        return (train / "final").resolve()
    steps = []
    ck = train / "checkpoints"
    if ck.is_dir():
        for d in ck.iterdir():
            if d.is_dir() and d.name.startswith("step_") and d.name[5:].isdigit() and _complete(d):
                steps.append((int(d.name[5:]), d))
    if not steps:
        raise DraftsmithError(f"{train}: no complete checkpoint (train/final or train/checkpoints/step_N "
                              f"with {CKPT_STATE}); run `draftsmith train --run {run.path}` first")
    return max(steps)[1].resolve()


def drafter_config_from_meta(meta: dict, where: str):
    """Eagle3Config from a checkpoint's drafter.json: its Eagle3Config fields, at the top level
    or under "config"."""
    src = meta.get("config") if isinstance(meta.get("config"), dict) else meta
    names = {f.name for f in fields(Eagle3Config)}
    kwargs = {k: v for k, v in src.items() if k in names}
    try:
        return Eagle3Config(**kwargs)
    except (TypeError, ValueError) as e:
        raise DraftsmithError(f"{where}: invalid drafter config ({e})") from None


def _meta_aux_layers(meta: dict, where: str) -> list[int]:
    layers = meta.get("aux_layers")
    if not (isinstance(layers, list) and layers and all(isinstance(x, int) for x in layers)):
        raise DraftsmithError(f"{where}: 'aux_layers' must be a list of layer ids, got {layers!r}")
    return layers


def _meta_target(meta: dict) -> tuple[str | None, str | None]:
    """(target name, target fingerprint) recorded by train, in either flat or nested form."""
    t = meta.get("target")
    if isinstance(t, dict):
        return t.get("name"), t.get("fingerprint")
    return t, meta.get("target_fingerprint")


# -------------------------------------------------------------------------------------------------
# Shapes and checks shared by export and load_exported


def expected_shapes(config) -> dict[str, tuple[tuple[int, ...], str]]:
    """Export name -> (shape, kind) for a drafter config; kind is "float", "int64" or "bool".
    Built on the meta device: no memory, always in step with model/eagle3.py."""
    with torch.device("meta"):
        model = drafter_class(config)(config)
    out, names = {}, export_keys(config)
    for name, t in model.state_dict().items():
        kind = "int64" if t.dtype == torch.long else "bool" if t.dtype == torch.bool else "float"
        out[names.get(name) or OPTIONAL_KEYS[name]] = (tuple(t.shape), kind)
    return out


def check_tensors(path: Path, shapes: dict[str, tuple[tuple[int, ...], Any]], config, *,
                  allow_extra: tuple[str, ...] = ()) -> None:
    """Check the names, shapes and dtypes of a safetensors file against `expected_shapes` without
    loading it; a missing, extra or misshapen tensor is a one-line error naming file and key."""
    if not path.is_file():
        raise DraftsmithError(f"{path}: missing")
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            found = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in keys}
    except Exception as e:  # safetensors raises its own error types for a corrupt header
        raise DraftsmithError(f"{path}: not a readable safetensors file ({e})") from None
    names = export_keys(config)
    for key in names.values():
        if key not in keys:
            raise DraftsmithError(f"{path}: missing tensor '{key}'")
    extra = sorted(keys - set(names.values()) - set(OPTIONAL_KEYS.values()) - set(allow_extra))
    if extra:
        raise DraftsmithError(f"{path}: unexpected tensor '{extra[0]}'"
                              + (f" (+{len(extra) - 1} more)" if len(extra) > 1 else ""))
    st_kind = {"I64": "int64", "BOOL": "bool", "F32": "float", "F16": "float", "BF16": "float", "F64": "float"}
    for key in [*names.values(), *OPTIONAL_KEYS.values()]:  # a fixed order: the same error every time
        if key not in found or key not in shapes:
            continue
        (shape, dtype), (want, kind) = found[key], shapes[key]
        if shape != want:
            raise DraftsmithError(f"{path}: tensor '{key}' has shape {list(shape)}, expected {list(want)} "
                                  f"(hidden {config.hidden_size}, vocab {config.vocab_size}, "
                                  f"draft vocab {config.draft_vocab_size})")
        if st_kind.get(dtype, dtype) != kind:
            raise DraftsmithError(f"{path}: tensor '{key}' has dtype {dtype}, expected {kind}")


def check_vocab_maps(d2t, t2d, where: str) -> None:
    """d2t must map draft ids to strictly increasing target ids in range, and t2d mark exactly them."""
    ids = d2t + torch.arange(d2t.numel())
    V = t2d.numel()
    if d2t.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
        raise DraftsmithError(f"{where}: 'd2t' maps a draft id outside the target vocabulary [0, {V})")
    if d2t.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise DraftsmithError(f"{where}: 'd2t' target ids are not strictly increasing")
    if int(t2d.sum()) != d2t.numel() or not bool(t2d[ids].all()):
        raise DraftsmithError(f"{where}: 't2d' does not mark exactly the target ids of 'd2t'")


# -------------------------------------------------------------------------------------------------
# The speculators config


def _layer_config(config, model_type: str, architecture: str) -> dict:
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
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rope_theta": config.rope_theta,
        "vocab_size": config.vocab_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
    }


def speculators_config(config, aux_layers: list[int], *, target_name: str, target_arch: str,
                       num_speculative_tokens: int, dtype: str, draftsmith: dict) -> dict:
    """config.json for vLLM (speculators format: eagle3, peagle or dflash). `target_name`: the verifier's
    name_or_path (target.verifier_name: a Hub id or the target as the config names it)."""
    method = drafter_method(config)
    if method == "dflash":
        return _dflash_config(config, aux_layers, target_name=target_name, target_arch=target_arch, dtype=dtype,
                              draftsmith=draftsmith)
    # EAGLE-3.1's norms: vLLM's eagle3 reads them at the top level, its peagle only inside transformer_layer_config
    norms = {"norm_before_fc": config.norm_before_fc, "fc_norm": config.fc_norm, "norm_output": config.norm_output}
    layer = {
        **_layer_config(config, "llama", "LlamaForCausalLM"),
        "mlp_bias": False,
        # vLLM's Llama EAGLE-3 sizes fc for this many aux states, 3 when absent: it does not count the ids below
        "num_aux_hidden_states": len(aux_layers),
        "dtype": dtype,
        **(norms if method == "peagle" else {}),
    }
    return {
        "architectures": ["PEagleSpeculator" if method == "peagle" else "Eagle3Speculator"],
        "speculators_model_type": method,
        "transformer_layer_config": layer,
        "draft_vocab_size": config.draft_vocab_size,
        # vLLM's default for speculators eagle3 is True; model/eagle3.py's residual is the raw state
        "norm_before_residual": False,
        **norms,
        **({"mask_token_id": config.mask_token_id} if method == "peagle" else {}),
        "target_hidden_size": config.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(aux_layers),
        "speculators_config": {
            "algorithm": method,
            "default_proposal_method": "greedy",
            "proposal_methods": [{
                "proposal_type": "greedy",
                "speculative_tokens": num_speculative_tokens,
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }],
            # vLLM reads name_or_path only for `vllm serve EXPORT_DIR` (it then serves that model
            # with the drafter attached); `vllm serve TARGET --speculative-config ...` uses TARGET
            "verifier": {"name_or_path": target_name, "architectures": [target_arch]},
        },
        "dtype": dtype,
        "draftsmith": draftsmith,
    }


def _dflash_config(config, aux_layers: list[int], *, target_name: str, target_arch: str, dtype: str,
                   draftsmith: dict) -> dict:
    """config.json of a DFlash drafter (speculators_model_type dflash: vLLM's DFlashQwen3ForCausalLM).

    Gotchas: vLLM reads the aux ids from `aux_hidden_state_layer_ids` (not EAGLE's key), in EAGLE's convention (id L:
    the state after L layers; it derives z-lab's `target_layer_ids` = L - 1 itself, vllm#40727); its attention
    inside the block is non-causal only with `sliding_window_non_causal` true (its default); it ignores
    `block_size`, so the drafts served must be given as speculative_tokens = block_size - 1; and it does not raise
    the drafter's max_position_embeddings to the target's, so the target's is written."""
    layer = {**_layer_config(config, "qwen3", "Qwen3ForCausalLM"), "dtype": dtype}
    return {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": "dflash",
        "transformer_layer_config": layer,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.hidden_size,
        "aux_hidden_state_layer_ids": list(aux_layers),
        "mask_token_id": config.mask_token_id,
        "block_size": config.block_size,
        "sliding_window_non_causal": True,
        "speculators_config": {
            "algorithm": "dflash",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.block_size - 1,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": target_name, "architectures": [target_arch]},
        },
        "dtype": dtype,
        "draftsmith": draftsmith,
    }


def _dflash_config_from_export(cj: dict, where: str):
    """(Eagle3Config, aux ids, speculative tokens, verifier) from a DFlash export's config.json."""
    layer = cj.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DraftsmithError(f"{where}: missing 'transformer_layer_config'")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if key not in layer:
            raise DraftsmithError(f"{where}: missing 'transformer_layer_config.{key}'")
    aux = cj.get("aux_hidden_state_layer_ids")
    if not (isinstance(aux, list) and aux and all(isinstance(x, int) for x in aux)):
        raise DraftsmithError(f"{where}: 'aux_hidden_state_layer_ids' must be a list of layer ids, got {aux!r}")
    if cj.get("sliding_window_non_causal", True) is not True:
        raise DraftsmithError(f"{where}: 'sliding_window_non_causal' must be true (draftsmith's DFlash attends both "
                              "ways inside the block)")
    for key in ("mask_token_id", "block_size"):
        if not isinstance(cj.get(key), int) or isinstance(cj.get(key), bool):
            raise DraftsmithError(f"{where}: '{key}' must be an int, got {cj.get(key)!r}")
    sc = cj.get("speculators_config")
    try:
        spec = int(sc["proposal_methods"][0]["speculative_tokens"])
        verifier = str(sc["verifier"]["name_or_path"])
    except (KeyError, IndexError, TypeError, ValueError):
        raise DraftsmithError(f"{where}: 'speculators_config' needs proposal_methods[0].speculative_tokens "
                              "and verifier.name_or_path") from None
    if spec != cj["block_size"] - 1:
        raise DraftsmithError(f"{where}: a DFlash drafter drafts block_size - 1 = {cj['block_size'] - 1} tokens, but "
                              f"speculative_tokens is {spec}")
    rope = layer.get("rope_parameters") or {}
    try:
        config = Eagle3Config(
            hidden_size=layer["hidden_size"], intermediate_size=layer["intermediate_size"],
            num_attention_heads=layer["num_attention_heads"],
            num_key_value_heads=layer.get("num_key_value_heads") or layer["num_attention_heads"],
            head_dim=layer.get("head_dim"), rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", layer.get("rope_theta", 1e6))),
            max_position_embeddings=layer.get("max_position_embeddings", 8192), vocab_size=layer["vocab_size"],
            draft_vocab_size=cj.get("draft_vocab_size") or layer["vocab_size"], num_aux_layers=len(aux),
            hidden_act=layer.get("hidden_act", "silu"), num_hidden_layers=layer.get("num_hidden_layers", 1),
            mask_token_id=cj["mask_token_id"], block_size=cj["block_size"])
    except (TypeError, ValueError) as e:
        raise DraftsmithError(f"{where}: invalid drafter config ({e})") from None
    return config, aux, spec, verifier


# the architecture vLLM 0.32 serves an MLA EAGLE-3 drafter with (vllm/model_executor/models/deepseek_eagle3.py)
MLA_ARCHITECTURE = "Eagle3DeepseekV3ForCausalLM"


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
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rope_theta": config.rope_theta,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.hidden_size,
        "norm_before_residual": False,
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layers), "use_aux_hidden_state": True},
        "dtype": dtype,
        # no speculators_config here: the proposal length and the verifier are draftsmith's record
        "draftsmith": {**draftsmith, "num_speculative_tokens": num_speculative_tokens, "verifier": target_name,
                       "verifier_architecture": target_arch},
    }


def _mla_config_from_export(cj: dict, where: str):
    """(Eagle3Config, aux ids, speculative tokens, verifier) from a native MLA export's config.json."""
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
    aux = (cj.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not (isinstance(aux, list) and aux and all(isinstance(x, int) for x in aux)):
        raise DraftsmithError(f"{where}: 'eagle_config.eagle_aux_hidden_state_layer_ids' must be a list of layer "
                              f"ids, got {aux!r}")
    record = cj.get("draftsmith") or {}
    try:
        config = Eagle3Config(
            attention="mla", hidden_size=cj["hidden_size"], intermediate_size=cj["intermediate_size"],
            num_attention_heads=cj["num_attention_heads"], num_key_value_heads=cj["num_attention_heads"],
            head_dim=cj["qk_nope_head_dim"] + cj["qk_rope_head_dim"], q_lora_rank=cj.get("q_lora_rank"),
            kv_lora_rank=cj["kv_lora_rank"], qk_nope_head_dim=cj["qk_nope_head_dim"],
            qk_rope_head_dim=cj["qk_rope_head_dim"], v_head_dim=cj["v_head_dim"],
            rms_norm_eps=float(cj.get("rms_norm_eps", 1e-6)), rope_theta=float(rope.get("rope_theta",
                                                                                      cj.get("rope_theta", 10000.0))),
            max_position_embeddings=cj.get("max_position_embeddings", 8192), vocab_size=cj["vocab_size"],
            draft_vocab_size=cj.get("draft_vocab_size") or cj["vocab_size"], num_aux_layers=len(aux),
            hidden_act=cj.get("hidden_act", "silu"), num_hidden_layers=cj.get("num_hidden_layers", 1))
    except (TypeError, ValueError) as e:
        raise DraftsmithError(f"{where}: invalid drafter config ({e})") from None
    return config, aux, int(record.get("num_speculative_tokens") or 3), str(record.get("verifier") or "")


def _config_from_export(config_json: dict, where: str):
    """(Eagle3Config, aux ids, speculative tokens, verifier) from an exported config.json, checking what
    vLLM and draftsmith need."""
    # every size within what a model has, whatever the kind (bounds.py): an edited config.json is refused here
    check_model_numbers(config_json, where, drafter=True)
    if isinstance(config_json.get("transformer_layer_config"), dict):
        check_model_numbers(config_json["transformer_layer_config"], f"{where}: transformer_layer_config", drafter=True)
    if config_json.get("architectures") == [MLA_ARCHITECTURE]:
        return _mla_config_from_export(config_json, where)
    if config_json.get("speculators_model_type") == "dflash":
        return _dflash_config_from_export(config_json, where)
    method = config_json.get("speculators_model_type")
    if method not in ("eagle3", "peagle"):
        raise DraftsmithError(f"{where}: 'speculators_model_type' must be \"eagle3\" or \"peagle\", got {method!r}")
    layer = config_json.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DraftsmithError(f"{where}: missing 'transformer_layer_config'")
    sc = config_json.get("speculators_config")
    try:
        int(sc["proposal_methods"][0]["speculative_tokens"])
        str(sc["verifier"]["name_or_path"])
    except (KeyError, IndexError, TypeError, ValueError):
        raise DraftsmithError(f"{where}: 'speculators_config' needs proposal_methods[0].speculative_tokens "
                              "and verifier.name_or_path") from None
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if key not in layer:
            raise DraftsmithError(f"{where}: missing 'transformer_layer_config.{key}'")
    num_layers = layer.get("num_hidden_layers", 1)
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
        raise DraftsmithError(f"{where}: 'transformer_layer_config.num_hidden_layers' must be an int >= 1, "
                              f"got {num_layers!r}")
    if config_json.get("norm_before_residual", True):
        raise DraftsmithError(f"{where}: 'norm_before_residual' must be false (draftsmith's drafter keeps "
                              "the raw hidden state as the residual; vLLM's default is true)")
    norms = {}
    for key in ("norm_before_fc", "fc_norm", "norm_output"):
        # where vLLM reads them: the top level for eagle3, transformer_layer_config for peagle (norm_before_fc: both)
        value = layer.get(key) if method == "peagle" and key != "norm_before_fc" else config_json.get(key)
        if not isinstance(value, (bool, type(None))):
            raise DraftsmithError(f"{where}: '{key}' must be true or false, got {value!r}")
        norms[key] = bool(value)
    mask_token_id = None
    if method == "peagle":
        mask_token_id = config_json.get("mask_token_id")
        if not isinstance(mask_token_id, int) or isinstance(mask_token_id, bool):
            raise DraftsmithError(f"{where}: 'mask_token_id' must be a token id for peagle, got {mask_token_id!r}")
    rope = layer.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise DraftsmithError(f"{where}: 'transformer_layer_config.rope_parameters.rope_type' must be "
                              f"\"default\" (draftsmith trains with plain RoPE), got {rope.get('rope_type')!r}")
    theta = rope.get("rope_theta", layer.get("rope_theta"))
    if theta is None:
        raise DraftsmithError(f"{where}: missing 'transformer_layer_config.rope_parameters.rope_theta'")
    if layer.get("rope_theta") is not None and float(layer["rope_theta"]) != float(theta):
        raise DraftsmithError(f"{where}: 'rope_theta' ({layer['rope_theta']}) disagrees with rope_parameters ({theta})")
    aux = config_json.get("eagle_aux_hidden_state_layer_ids")
    if not (isinstance(aux, list) and aux and all(isinstance(x, int) for x in aux)):
        raise DraftsmithError(f"{where}: 'eagle_aux_hidden_state_layer_ids' must be a list of layer ids, got {aux!r}")
    if config_json.get("target_hidden_size") not in (None, layer["hidden_size"]):
        raise DraftsmithError(f"{where}: 'target_hidden_size' ({config_json['target_hidden_size']}) differs from the "
                              f"drafter's hidden_size ({layer['hidden_size']}); not supported")
    try:
        config = Eagle3Config(
            hidden_size=layer["hidden_size"],
            intermediate_size=layer["intermediate_size"],
            num_attention_heads=layer["num_attention_heads"],
            num_key_value_heads=layer.get("num_key_value_heads") or layer["num_attention_heads"],
            head_dim=layer.get("head_dim"),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-5)),
            rope_theta=float(theta),
            max_position_embeddings=layer.get("max_position_embeddings", 8192),
            vocab_size=layer["vocab_size"],
            draft_vocab_size=config_json.get("draft_vocab_size") or layer["vocab_size"],
            num_aux_layers=len(aux),
            hidden_act=layer.get("hidden_act", "silu"),
            num_hidden_layers=num_layers,
            mask_token_id=mask_token_id,
            **norms,
        )
    except (TypeError, ValueError) as e:
        raise DraftsmithError(f"{where}: invalid drafter config ({e})") from None
    return (config, aux, int(sc["proposal_methods"][0]["speculative_tokens"]),
            str(sc["verifier"]["name_or_path"]))


def speculative_config(folder: str | os.PathLike, num_speculative_tokens: int) -> dict:
    """The --speculative-config that serves the export in `folder` beside its target: method eagle3 for EAGLE-3,
    with parallel_drafting for a P-EAGLE export (vLLM 0.32 knows no method "peagle"; only its speculators loader,
    used when the export folder itself is served, maps the type), method dflash for DFlash."""
    cj = read_json_object(Path(folder) / CONFIG_FILE)
    kind = cj.get("speculators_model_type")
    spec = {"model": str(folder), "method": "dflash" if kind == "dflash" else "eagle3",
            "num_speculative_tokens": int(num_speculative_tokens)}
    if kind == "peagle":
        spec["parallel_drafting"] = True
    if kind == "dflash" and num_speculative_tokens != cj.get("block_size", 0) - 1:
        raise DraftsmithError(f"{folder}: a DFlash drafter is served with block_size - 1 = "
                              f"{cj.get('block_size', 0) - 1} drafts (it was trained on whole blocks), not "
                              f"{num_speculative_tokens}")
    return spec


# -------------------------------------------------------------------------------------------------
# Loading an export


def load_exported(folder: str | os.PathLike, *, target_info=None, embed_weight=None,
                  device: str = "cpu", dtype=None):
    """Read an exported drafter folder, checking it the way vLLM would use it.

    target_info (draftsmith.target.TargetInfo, optional): also check that the drafter fits this
    target (hidden size, vocabulary, aux layer ids in range). embed_weight [V, H] (optional): the
    target's input embeddings, copied into the drafter (an export carries none by default).

    Returns (the drafter in eval mode: Eagle3Drafter or PEagleDrafter, info dict: config, aux_layers,
    num_speculative_tokens, has_embed_tokens, dtype, draftsmith block, path). Every problem is a DraftsmithError naming
    the file and the key.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise DraftsmithError(f"{folder}: no such export folder")
    cpath, wpath = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    config_json = read_json_object(cpath)
    config, aux, spec_tokens, verifier = _config_from_export(config_json, str(cpath))
    if target_info is not None:
        where = f"{cpath}: eagle_aux_hidden_state_layer_ids"
        target_info.check_layers(aux, field=where)
        for name, mine, theirs in (("hidden_size", config.hidden_size, target_info.hidden_size),
                                   ("vocab_size", config.vocab_size, target_info.vocab_size)):
            if mine != theirs:
                raise DraftsmithError(f"{cpath}: the drafter's {name} is {mine} but the target "
                                      f"{target_info.name} has {theirs}")
    shapes = expected_shapes(config)
    check_tensors(wpath, shapes, config)
    sd = load_file(str(wpath))
    check_vocab_maps(sd["d2t"], sd["t2d"], str(wpath))

    model = drafter_class(config)(config)
    has_embed = "embed_tokens.weight" in sd
    if not has_embed:
        if embed_weight is not None:
            if tuple(embed_weight.shape) != (config.vocab_size, config.hidden_size):
                raise DraftsmithError(f"{folder}: target embeddings are {list(embed_weight.shape)}, the drafter "
                                      f"needs [{config.vocab_size}, {config.hidden_size}]")
            sd["embed_tokens.weight"] = embed_weight.detach().to("cpu", torch.float32)
        else:
            sd["embed_tokens.weight"] = model.embed_tokens.weight.detach().zero_()
    param_sd = {name: sd[export] for name, export in {**export_keys(config), **OPTIONAL_KEYS}.items()}
    model.load_state_dict(param_sd, strict=True)
    model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    # to(dtype) casts floating tensors only: d2t (int64) and t2d (bool) keep theirs
    model.eval().requires_grad_(False)
    stored_dtype = next((str(t.dtype).removeprefix("torch.") for k, t in sd.items()
                         if k not in INDEX_KEYS and k != "embed_tokens.weight"), None)
    info = {
        "path": str(folder.resolve()),
        "config": config,
        "aux_layers": list(aux),
        "num_speculative_tokens": spec_tokens,
        "verifier": verifier,
        "has_embed_tokens": has_embed,
        "dtype": stored_dtype,
        "draftsmith": config_json.get("draftsmith") or {},
    }
    return model, info


# -------------------------------------------------------------------------------------------------
# The stage


def _served_tokens(meta: dict) -> int:
    """The drafts per step a checkpoint was trained for (its TTT steps; a DFlash block's slots)."""
    return int(meta.get("ttt_steps") or 3)


def _relative(path: Path, root: Path) -> str:
    """`path` relative to `root` when inside it, else its last two parts: what an export may record of a
    local path (never the absolute one: the folder is published)."""
    try:
        return str(Path(path).resolve().relative_to(Path(root).resolve()))
    except ValueError:
        return str(Path(*Path(path).parts[-2:]))


def _swap_into_place(built: Path, dest: Path) -> None:
    """Replace `dest` by the folder `built` (same parent): the stage's bookkeeping files move over
    first, then two renames; `dest` is never a mix of old and new exported files."""
    if dest.is_dir():
        for name in BOOKKEEPING:
            if (dest / name).exists():
                os.replace(dest / name, built / name)
    replace_dir(built, dest)


@one_process(STAGE)
@journal_failures(STAGE)
def run_export(run: RunDir, cfg, checkpoint: str | None = None) -> dict:
    """Export a checkpoint (export.checkpoint, else train/final, else the newest complete one)
    to RUN/export/. Returns the manifest."""
    run.ensure()
    ckpt = find_checkpoint(run, checkpoint or cfg.export.checkpoint)
    meta_path, weights_path = ckpt / CKPT_META, ckpt / CKPT_WEIGHTS
    meta = read_json_object(meta_path)
    state = read_json_object(ckpt / CKPT_STATE)
    config = drafter_config_from_meta(meta, str(meta_path))
    aux = _meta_aux_layers(meta, str(meta_path))
    if len(aux) != config.num_aux_layers:
        raise DraftsmithError(f"{meta_path}: {len(aux)} aux_layers but the drafter's fc fuses {config.num_aux_layers}")

    info = target_info(cfg.target, cfg.trust_remote_code)
    ck_name, ck_fp = _meta_target(meta)
    if ck_fp is not None and ck_fp != info.fingerprint:
        raise DraftsmithError(f"{meta_path}: the checkpoint was trained for target {ck_name or '?'} "
                              f"(fingerprint {ck_fp}), but target is {info.name} (fingerprint {info.fingerprint}); "
                              "set target to the model it was trained on")
    info.check_layers(aux, field=f"{meta_path}: aux_layers")
    if (config.hidden_size, config.vocab_size) != (info.hidden_size, info.vocab_size):
        raise DraftsmithError(f"{meta_path}: drafter hidden/vocab sizes {config.hidden_size}/{config.vocab_size} "
                              f"do not match target {info.name} ({info.hidden_size}/{info.vocab_size})")

    ck_sha = file_sha256(weights_path)
    train_manifest = run.read_manifest("train")
    settings = {**cfg.section(STAGE), "target_id": cfg.target_id}
    settings[STAGE] = {k: v for k, v in settings[STAGE].items() if k != "repo_id"}  # the card's alone: rewritten below
    # the checkpoint relative to the run: a moved run stays up to date (and its manifest names no path of the move)
    inputs = {"checkpoint": _relative(ckpt, run.path), "checkpoint_sha256": ck_sha,
              "drafter_json_sha256": file_sha256(meta_path),
              "train": (train_manifest or {}).get("fingerprint"), "target_fingerprint": info.fingerprint}
    # No upstream manifest in the print: the checkpoint itself (its path and hashes) is the input.
    book = StageBook(run, STAGE, cfg, settings=settings, fingerprint_extra={"inputs": inputs})
    dest = run.path / STAGE
    if (old := book.up_to_date(outputs_ok=all((dest / f).is_file() for f in (CONFIG_FILE, WEIGHTS_FILE)))) is not None:
        if why := write_card(run, dest, speculative_config(dest, _served_tokens(meta)), cfg.export.repo_id):
            log(f"warning: {why}", stage=STAGE)  # (export.repo_id may have changed: the card is rewritten here)
        log(f"up to date (step {old['counts'].get('step')}); nothing to do", stage=STAGE)
        return old  # up to date: same checkpoint, target and settings (`run` skips it)
    book.begin()

    dtype_name = cfg.export.dtype
    out_dtype = getattr(torch, dtype_name)
    # RUN/export may be a link to another disk: the folder is built beside where it points (a rename stays on one
    # file system) and swapped in there, so the link is kept and the export lands where the user put it
    home = dest.resolve() if dest.is_symlink() else dest
    for stale in [*run.path.glob(f".{STAGE}.*.tmp"), *home.parent.glob(f".{home.name}.*.tmp")]:  # a crash's
        shutil.rmtree(stale, ignore_errors=True)

    with Progress(run, STAGE, total=1, unit="exports", stall_after_s=cfg.stall_after_s) as prog:
        prog.log(f"exporting {ckpt} (step {state.get('step', '?')}) for {info.name}, aux layers {aux}, "
                 f"dtype {dtype_name}")
        check_tensors(weights_path, expected_shapes(config), config, allow_extra=(FC_INPUT_SCALE,))
        sd = load_file(str(weights_path))
        check_vocab_maps(sd["d2t"], sd["t2d"], str(weights_path))
        if FC_INPUT_SCALE in sd:  # train.fc_input_norm: fc(x * s) = (W diag(s)) x, a plain fc for vLLM
            s = sd.pop(FC_INPUT_SCALE).float()
            if tuple(s.shape) != (sd["fc.weight"].shape[1],):
                raise DraftsmithError(f"{weights_path}: tensor '{FC_INPUT_SCALE}' has shape {list(s.shape)}, "
                                      f"expected [{sd['fc.weight'].shape[1]}]")
            sd["fc.weight"] = sd["fc.weight"].float() * s[None, :]
            if "mask_hidden" in sd:  # P-EAGLE: training fed it to fc unscaled, so fc(m) = (W diag(s)) (m / s)
                sd["mask_hidden"] = sd["mask_hidden"].float() / s
        tensors = {}
        for name, export_name in export_keys(config).items():
            t = sd[name]
            tensors[export_name] = (t if name in INDEX_KEYS else t.to(out_dtype)).contiguous()
        write_config = native_mla_config if config.attention == "mla" else speculators_config
        published = verifier_name(cfg.target, info, cfg.target_id)
        config_json = write_config(
            config, aux, target_name=published, target_arch=info.architecture,
            num_speculative_tokens=int(meta.get("ttt_steps") or 3), dtype=dtype_name,
            # what identifies the target wherever the drafter is deployed: the name it is published as, its
            # architecture, the hash of its config.json, and the folder print training checked; what training
            # left (the kind, the steps it drafts, its validation figures: eval holds them against serving);
            # no path of this machine (the checkpoint relative to the run)
            draftsmith={"version": __version__, "kind": meta.get("method") or "eagle3", "target": info.name,
                        "target_id": published, "target_architecture": info.architecture,
                        "target_config_sha256": config_sha256(info), "target_fingerprint": info.fingerprint,
                        "checkpoint": _relative(ckpt, run.path), "step": state.get("step"),
                        "ttt_steps": meta.get("ttt_steps"), "aux_layers_trained": aux,
                        "vocab_fingerprint": meta.get("vocab_fingerprint"), "validation": state.get("validation"),
                        "exported": time.time()},
        )
        home.parent.mkdir(parents=True, exist_ok=True)
        built = Path(tempfile.mkdtemp(prefix=f".{home.name}.", suffix=".tmp", dir=home.parent))
        try:
            save_file(tensors, str(built / WEIGHTS_FILE), metadata={"format": "pt"})
            (built / CONFIG_FILE).write_text(json.dumps(config_json, indent=2) + "\n", encoding="utf-8")
            for name in (WEIGHTS_FILE, CONFIG_FILE):
                with open(built / name, "rb") as f:
                    os.fsync(f.fileno())
            # read back through the same checks a user's load goes through
            load_exported(built, target_info=info)
            if why := write_card(run, built, speculative_config(built, _served_tokens(meta)), cfg.export.repo_id,
                                 reports=False):
                prog.log(f"warning: {why}")
        except BaseException:
            shutil.rmtree(built, ignore_errors=True)
            raise
        prog.advance(1)
        size = (built / WEIGHTS_FILE).stat().st_size
        prog.end(checkpoint=str(ckpt), bytes=size)
    # after the journal is closed: its file moves with the other bookkeeping into the new folder
    _swap_into_place(built, home)
    return book.finish(counts={"done": 1, "total": 1, "unit": "exports", "bytes": size, "step": state.get("step")},
                       outputs=[CONFIG_FILE, WEIGHTS_FILE, CARD, PROVENANCE], inputs=inputs,
                       extra={"checkpoint": _relative(ckpt, run.path), "aux_layers": aux, "dtype": dtype_name},
                       checked=[CONFIG_FILE, WEIGHTS_FILE])  # the card is rewritten by eval: not the drafter
