"""The drafter before its first step: its config from the target's, its weights from the target's
(embeddings, the LM head's rows at the draft ids, the final norm; with train.init_layer also
decoder layers), and with train.fc_input_norm the factor its fc input is scaled by. A run that starts from a
released drafter (train.init_from: draftsmith/released.py) takes its config and every weight but the embeddings
from it (with train.init_vocab=remap the LM head's rows of the tokens both vocabularies hold)."""

from dataclasses import replace
from pathlib import Path

import torch

from draftsmith import DraftsmithError, kinds
from draftsmith.model.config import DrafterConfig
from draftsmith.model.init import check_target_layer, init_from_target, init_layer_from_target
from draftsmith.released import Released, load as load_released
from draftsmith.target import language_model_names, load_target, read_tensor
from draftsmith.train.distributed import Ranks, from_rank0, on_rank0
from draftsmith.train.objective import fc_input_scale

# -------------------------------------------------------------------------------------------------
# Target weights


def read_target_weights(info, log=print, ranks: Ranks | None = None):
    """(embed [V, H], lm_head [V, H], final norm [H] or None) of the target, read from its
    safetensors files without building the model; loads the model only when they are absent.

    With several ranks only rank 0 reads them (N ranks reading a [V, H] table each would multiply
    the disk traffic by N) and broadcasts them in their stored dtype; a read error is every rank's."""
    if ranks is None or ranks.world == 1:
        return _read_target_weights(info, log)
    read: list = []
    on_rank0(lambda: read.extend(_read_target_weights(info, log)), ranks)
    embed, head, norm = from_rank0(read if ranks.rank == 0 else None, ranks)
    return embed, head, norm


def _read_target_weights(info, log):
    folder = Path(info.path)
    names = language_model_names(info)
    if names is None:
        log(f"{folder}: no safetensors files; loading the model to read its embeddings and LM head")
        t = load_target(str(folder), device="cpu", dtype="auto")
        norm = t.final_norm_weight()
        return (t.embed_weight().detach().clone(), t.lm_head_weight().detach().clone(),
                None if norm is None else norm.detach().clone())
    embed = read_tensor(folder, names, names.embed)
    head = embed if names.head == names.embed else read_tensor(folder, names, names.head)
    norm = read_tensor(folder, names, names.norm) if names.norm else None
    V = info.vocab_size
    if embed.shape[0] != V or head.shape[0] != V:
        # some checkpoints pad the embedding matrix beyond config.vocab_size; a tied head stays
        # the same tensor (sent once to the other ranks)
        tied = head is embed
        embed = embed[:V]
        head = embed if tied else head[:V]
    return embed, head, norm


def read_target_layer(info, n: int) -> dict:
    """The target's decoder layer n as {name inside a Llama layer: tensor}, read from its safetensors (its family's
    names mapped by its layout, layout.py)."""
    folder = Path(info.path)
    names = language_model_names(info)
    if names is None:
        raise DraftsmithError(f"train.init_layer: {folder} has no safetensors weights to read layer {n} from")
    prefix = names.layer_prefix(n)
    out = {key[len(prefix):]: read_tensor(folder, names, key) for key in names.files if key.startswith(prefix)}
    if not out:
        raise DraftsmithError(f"train.init_layer: {folder} has no tensors named {prefix}*")
    return info.layout.llama_layer(out, info.identity.text)


# -------------------------------------------------------------------------------------------------
# The drafter


def drafter_config(info, cfg, draft_vocab_size: int, num_aux_layers: int,
                   rel: Released | None = None) -> DrafterConfig:
    """The drafter's shape from the target's (text) config, with train.num_layers decoder layers and fc over
    num_aux_layers target states (the store's layers), and what its kind (train.method) sets
    (kinds/<kind>/__init__.py: Kind.config_options); from a released drafter `rel`, its own config (released.py
    checked it against the target and the train settings) with the run's draft vocabulary."""
    if rel is not None:
        return replace(rel.config, draft_vocab_size=draft_vocab_size)
    hf_cfg = info.identity.view()
    tc = cfg.train
    attention, options = kinds.get(tc.method).config_options(tc, hf_cfg, tc.drafter_attention)
    try:
        return DrafterConfig.from_target_config(hf_cfg, draft_vocab_size=draft_vocab_size,
                                                num_hidden_layers=tc.num_layers, num_aux_layers=num_aux_layers,
                                                attention=attention, **options)
    except ValueError as e:
        raise DraftsmithError(f"train: {e}") from None


def drafter_record(tc) -> dict:
    """How the drafter was built, as every checkpoint's drafter.json says it beside its config: the kind, the drafts
    a step proposes as trained, and the build settings export reads back (fc_input_norm's scale to fold)."""
    return {"fc_input_norm": tc.fc_input_norm, "init_layer": tc.init_layer, "freeze_lm_head": tc.freeze_lm_head,
            "method": tc.method, "drafts": kinds.get(tc.method).drafts(tc)}


def first_init_layer(tc) -> int:
    """train.init_layer: drafter layer n starts from target layer init_layer - (num_layers - 1) + n,
    so the last from init_layer; this is the target layer of drafter layer 0."""
    return tc.init_layer - (tc.num_layers - 1)


def read_init_layers(info, tc, dcfg: DrafterConfig) -> list[dict] | None:
    """train.init_layer: the target layers the drafter's decoder layers start from (float32),
    checked against the drafter's config; None without it."""
    if tc.init_layer is None:
        return None
    if dcfg.attention == "mla":
        raise DraftsmithError("train.init_layer: starting an MLA drafter from the target's layers is not supported; "
                              "unset it, or set train.drafter_attention=gqa")
    first = first_init_layer(tc)
    if not 0 <= tc.init_layer < info.num_layers:
        raise DraftsmithError(f"train.init_layer: {tc.init_layer} is not a layer of the target "
                              f"(0..{info.num_layers - 1})")
    if first < 0:
        raise DraftsmithError(f"train.init_layer: {tc.init_layer} with train.num_layers {tc.num_layers} needs target "
                              f"layers {first}..{tc.init_layer}; the target has 0..{info.num_layers - 1}")
    out = []
    for n in range(first, tc.init_layer + 1):
        out.append({k: v.float() for k, v in read_target_layer(info, n).items()})
        try:
            check_target_layer(dcfg, out[-1])
        except ValueError as e:
            raise DraftsmithError(f"train.init_layer: layer {n} of {info.name}: {e}") from None
    return out


def build_drafter(dcfg: DrafterConfig, info, d2t, tc, first_batch, init_layers: list[dict] | None,
                  aux_layers: list[int], say, ranks: Ranks | None = None, rel: Released | None = None):
    """(drafter, target_head, fc input scale) before the first step, seeded with train.seed.

    target_head: W_d [Dv, H] float32, the target lm_head's rows at the draft ids (the objective's
    teacher). The scale ([3H], or None without train.fc_input_norm) comes from `first_batch()`,
    the first micro-batch of epoch 0: the same on every rank and after a resume. With several
    `ranks`, rank 0 alone reads the target's tensors (read_target_weights). `rel`: the released drafter whose
    weights it starts from (start_from_released).
    """
    embed, head, norm = read_target_weights(info, log=say, ranks=ranks)
    torch.manual_seed(tc.seed)
    drafter = kinds.drafter_class(dcfg)(dcfg)
    draft_ids = d2t + torch.arange(d2t.numel())
    init_from_target(drafter, embed.float(), head.float(), None if norm is None else norm.float(), draft_ids)
    target_head = head[draft_ids].float()  # W_d [Dv, H]
    del embed, head
    if rel is not None:
        start_from_released(drafter, rel, info, draft_ids, say)
    scale = None
    if tc.fc_input_norm:
        scale = fc_input_scale(first_batch())
        say(f"fc input norm: aux-state RMS per dimension {float(1 / scale.max()):.3g} to {float(1 / scale.min()):.3g}")
    if init_layers is not None:
        # after the fc input scale: fc's block is diag(1 / scale), so it passes on (aux * scale) / scale = aux
        init_layer_from_target(drafter, init_layers, aux_index=-1, input_scale=scale)
        which = f"layer {tc.init_layer}" if tc.num_layers == 1 else f"layers {first_init_layer(tc)}..{tc.init_layer}"
        say(f"decoder layers initialised from the target's {which}; fc passes aux layer {aux_layers[-1]} through")
    if tc.freeze_lm_head:
        drafter.lm_head.weight.requires_grad_(False)  # stays the target's rows; still saved and exported
        say("draft LM head frozen at the target's rows")
    return drafter, target_head, scale


def start_from_released(drafter, rel: Released, info, draft_ids, say) -> None:
    """Every weight of `drafter` (built from the target: embeddings, head rows, final norm) but embed_tokens, which
    stay the target's, from the released drafter `rel`. init_vocab keep: d2t, t2d and the LM head as released (the
    run's vocabulary must be the drafter's); remap: the run's vocabulary (draft_ids [Dv], its target ids), the LM
    head's rows of the tokens the released vocabulary also holds copied from it, the others left at the target's."""
    src, _ = load_released(rel, info)
    theirs = src.state_dict()
    own = drafter.state_dict()
    where = f"train.init_from ({rel.folder.name})"
    if rel.keeps_vocab and not torch.equal(theirs["d2t"], own["d2t"]):
        raise DraftsmithError(f"vocab/vocab.safetensors: not the draft vocabulary of {where}, which "
                              "train.init_vocab=keep trains with; rerun `draftsmith vocab`")
    vocab_part = () if rel.keeps_vocab else ("lm_head.weight", "d2t", "t2d")
    with torch.no_grad():
        for name, t in own.items():
            if name != "embed_tokens.weight" and name not in vocab_part:
                t.copy_(theirs[name])
        if rel.keeps_vocab:
            say(f"started from {where}: every weight as released but the embeddings (the target's), its draft "
                f"vocabulary of {draft_ids.numel()} tokens kept")
            return
        # remap: the released row of each run draft token it holds; [V] target id -> released row, -1 for none
        row_of = torch.full((info.vocab_size,), -1, dtype=torch.long)
        released_ids = theirs["d2t"] + torch.arange(theirs["d2t"].numel())
        row_of[released_ids] = torch.arange(released_ids.numel())
        rows = row_of[draft_ids]
        shared = rows >= 0
        own["lm_head.weight"][shared] = theirs["lm_head.weight"][rows[shared]]
    say(f"started from {where}: every weight as released but the embeddings (the target's) and the LM head, whose "
        f"rows of the {int(shared.sum())} of {draft_ids.numel()} draft tokens the released vocabulary of "
        f"{released_ids.numel()} also holds are copied from it (the others: the target's head rows)")
