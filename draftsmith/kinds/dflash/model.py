"""DFlash's runtime: the block drafter (model/dflash.py), its anchored-block objective (train/dflash.py), and the
local engine's proposal as vLLM's dflash proposer makes it: the verified states join the drafter's context keys,
and one forward over the block (the bonus token, then K mask tokens) gives all K drafts."""

from __future__ import annotations

import torch

from draftsmith.model.dflash import DFlashDrafter as Drafter
from draftsmith.train.dflash import DFlashObjective
from draftsmith.train.objective import ObjectiveOptions

__all__ = ["Drafter", "objective", "propose", "block_logits"]


def objective(drafter, target_head, scale, o: ObjectiveOptions, cls=DFlashObjective):
    """The anchored-block objective (its own attention mask: o.attention and o.flex are the chain's)."""
    return cls(drafter, target_head, o.gamma, o.anchors, scale, o.teacher_temperature, o.feature_noise, o.mix,
               o.chain_weights)


def block_logits(dec, unread_ids: list[int], unread_aux, first_pos: int, cache):
    """The verified states join the context; the bonus token anchors the block at the next position ->
    (logits [K, Dv], the bonus token)."""
    pos = torch.arange(first_pos, first_pos + len(unread_ids), device=dec.device)[None]
    dec.drafter.add_context(unread_aux.to(dec.drafter.fc.weight.dtype), pos, cache)
    anchor = torch.tensor([[unread_ids[-1]]], device=dec.device)
    return dec.drafter.draft(anchor, first_pos + len(unread_ids), cache)[0], unread_ids[-1]


def propose(dec, unread_ids: list[int], unread_aux, first_pos: int, cache, gen):
    rows, _ = block_logits(dec, unread_ids, unread_aux, first_pos, cache)
    return dec.collect([dec.sample_draft(x, gen) for x in rows])
