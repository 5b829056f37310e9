"""Starting a drafter from the target's weights instead of random ones.

init_from_target: the embeddings (frozen), the draft vocabulary's rows of the LM head, the final
norm and the vocabulary maps; init_layer_from_target (train.init_layer): the decoder layers from
the target's own, fc as a pass-through of one aux state; check_target_layer: whether a target
layer fits a drafter layer at all. The tensors are handed in: reading them from the target's files
is train/drafter.py's.
"""

from __future__ import annotations

import torch

from draftsmith.model.config import DrafterConfig
from draftsmith.model.eagle3 import Eagle3Drafter


def check_target_layer(cfg: DrafterConfig, layer: dict[str, torch.Tensor]) -> None:
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


@torch.no_grad()
def init_from_target(
    drafter: Eagle3Drafter,
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    final_norm_weight: torch.Tensor | None,
    draft_ids: torch.Tensor,
) -> None:
    """Copy into `drafter` the target's embeddings (frozen), the draft vocabulary's rows
    of its lm_head and its final norm weight, and set the vocab mapping.

    embed_weight, lm_head_weight [V, H]; final_norm_weight [H] or None
    (keep ones); draft_ids [Dv] strictly increasing target token ids.
    """
    cfg = drafter.config
    V, H, Dv = cfg.vocab_size, cfg.hidden_size, cfg.draft_vocab_size
    if tuple(embed_weight.shape) != (V, H):
        raise ValueError(f"embed_weight must be [{V}, {H}], got {list(embed_weight.shape)}")
    if tuple(lm_head_weight.shape) != (V, H):
        raise ValueError(f"lm_head_weight must be [{V}, {H}], got {list(lm_head_weight.shape)}")
    if final_norm_weight is not None and tuple(final_norm_weight.shape) != (H,):
        raise ValueError(f"final_norm_weight must be [{H}], got {list(final_norm_weight.shape)}")
    draft_ids = draft_ids.to(device=drafter.d2t.device, dtype=torch.long)
    if tuple(draft_ids.shape) != (Dv,):
        raise ValueError(f"draft_ids must be [{Dv}], got {list(draft_ids.shape)}")
    if Dv > 1 and not bool((draft_ids[1:] > draft_ids[:-1]).all()):
        raise ValueError("draft_ids must be strictly increasing (sorted, no duplicates)")
    if int(draft_ids[0]) < 0 or int(draft_ids[-1]) >= V:
        raise ValueError(f"draft_ids must lie in [0, {V})")

    drafter.embed_tokens.weight.copy_(embed_weight)
    drafter.lm_head.weight.copy_(lm_head_weight[draft_ids.to(lm_head_weight.device)])
    if final_norm_weight is not None:
        drafter.norm.weight.copy_(final_norm_weight)
    # offsets, not ids: this is the format vLLM's loader expects
    drafter.d2t.copy_(draft_ids - torch.arange(Dv, device=draft_ids.device))
    drafter.t2d.zero_()
    drafter.t2d[draft_ids] = True


@torch.no_grad()
def init_layer_from_target(drafter: Eagle3Drafter, layer: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]],
                           aux_index: int, input_scale: torch.Tensor | None = None) -> None:
    """Start the drafter's decoder layers from consecutive decoder layers of the target and
    its `fc` as a pass-through of one aux state, instead of from random weights.

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
    cfg = drafter.config
    H, A = cfg.hidden_size, cfg.num_aux_layers
    if not -A <= aux_index < A:
        raise ValueError(f"aux_index must be in [-{A}, {A}), got {aux_index}")
    layers = layer if isinstance(layer, list) else [layer]
    if len(layers) != cfg.num_hidden_layers:
        raise ValueError(f"got {len(layers)} target layers for a drafter of {cfg.num_hidden_layers}")
    for one in layers:
        check_target_layer(cfg, one)
    _fc_pass_through(drafter, aux_index, input_scale)
    if cfg.block_size:
        _init_dflash_layers(drafter, layers)
        return
    layer = layers[0]
    d = drafter.layers[0]
    for proj in ("q_proj", "k_proj", "v_proj"):
        getattr(d.self_attn, proj).weight[:, H:].copy_(layer[f"self_attn.{proj}.weight"])
    d.self_attn.o_proj.weight.copy_(layer["self_attn.o_proj.weight"])
    for proj in ("gate_proj", "up_proj", "down_proj"):
        getattr(d.mlp, proj).weight.copy_(layer[f"mlp.{proj}.weight"])
    d.hidden_norm.weight.copy_(layer["input_layernorm.weight"])
    d.post_attention_layernorm.weight.copy_(layer["post_attention_layernorm.weight"])
    for d, src in zip(drafter.layers[1:], layers[1:]):
        for name, p in d.named_parameters():
            p.copy_(src[name])


def _fc_pass_through(drafter, aux_index: int, input_scale: torch.Tensor | None) -> None:
    """fc = [0 .. I .. 0]: its output is aux state `aux_index` (undoing input_scale, which training multiplies
    the aux states by before fc)."""
    cfg = drafter.config
    H, A = cfg.hidden_size, cfg.num_aux_layers
    j = aux_index % A
    block = torch.eye(H, device=drafter.fc.weight.device)
    if input_scale is not None:
        if tuple(input_scale.shape) != (A * H,):
            raise ValueError(f"input_scale must be [{A * H}], got {list(input_scale.shape)}")
        block = torch.diag(1.0 / input_scale[j * H:(j + 1) * H].to(block))
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, j * H:(j + 1) * H].copy_(block)


def _init_dflash_layers(drafter, layers: list[dict[str, torch.Tensor]]) -> None:
    """A DFlash drafter (model/dflash.py) from target layers: each layer whole (its q/k norms stay ones: a Llama
    layer has none), hidden_norm the first layer's input norm, so that with fc passing an aux state on, layer 0
    reads the context's keys and values as the target layer would read that state."""
    for d, src in zip(drafter.layers, layers):
        for name, p in d.named_parameters():
            if name in src:
                p.copy_(src[name])
    drafter.hidden_norm.weight.copy_(layers[0]["input_layernorm.weight"])
