"""EAGLE-3's runtime: the drafter (model/eagle3.py; its MLA attention model/mla.py), trained with training-time
test (train/objective.py), drafting a chain in the local engine as vLLM's eagle3 proposer does."""

from __future__ import annotations

import torch

from draftsmith.model.eagle3 import Eagle3Drafter as Drafter
from draftsmith.train.objective import ObjectiveOptions, TTTObjective

__all__ = ["Drafter", "objective", "propose"]


def objective(drafter, target_head, scale, o: ObjectiveOptions):
    """The TTT objective over o.steps unrolled draft steps (flex attention over the run's FlexShape)."""
    return TTTObjective(drafter, target_head, o.steps, o.gamma, scale, o.teacher_temperature, o.feature_noise,
                        o.attention, o.chunk_tokens, o.mix, o.flex, o.chain_weights)


def read_verified(dec, unread_ids: list[int], unread_aux, first_pos: int, cache):
    """The drafter's pass over the verified tokens it has not read: (logits of the last [Dv], its state [1, 1, H],
    its position)."""
    pos = torch.arange(first_pos, first_pos + len(unread_ids), device=dec.device)[None]
    logits, h = dec.drafter(torch.tensor([unread_ids], device=dec.device),
                            unread_aux.to(dec.drafter.fc.weight.dtype), pos, cache)
    return logits[0, -1], h[:, -1:], first_pos + len(unread_ids) - 1


def propose(dec, unread_ids: list[int], unread_aux, first_pos: int, cache, gen):
    """K drafts, each pass reading the draft before it and the drafter's own state (SpecDecoder._draft's
    contract: unread_ids at positions first_pos+1.., unread_aux at first_pos..)."""
    logits, h, p = read_verified(dec, unread_ids, unread_aux, first_pos, cache)
    picked = []
    for k in range(dec.K):
        picked.append(dec.sample_draft(logits, gen))
        if k == dec.K - 1:
            break
        p += 1  # draft step k+1 reads draft k at the next position, with the drafter's own state
        out, h = dec.drafter(torch.tensor([[picked[-1][0]]], device=dec.device), h,
                             torch.tensor([[p]], device=dec.device), cache)
        logits = out[0, -1]
    return dec.collect(picked)
