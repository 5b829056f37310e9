"""P-EAGLE's runtime: the drafter (model/peagle.py), trained as EAGLE-3 with TTT (its later steps read the mask
slot: PEagleDrafter.step_inputs), drafting all K in the local engine in two passes as vLLM's parallel drafting
does: the one over the verified tokens gives draft 1, one over K-1 mask slots the rest."""

from __future__ import annotations

from draftsmith.kinds.eagle3.model import objective, read_verified
from draftsmith.model.peagle import PEagleDrafter as Drafter

__all__ = ["Drafter", "objective", "propose"]


def propose(dec, unread_ids: list[int], unread_aux, first_pos: int, cache, gen):
    logits, _, p = read_verified(dec, unread_ids, unread_aux, first_pos, cache)
    rest = dec.drafter.mask_slots(dec.K - 1, p + 1, cache)[0] if dec.K > 1 else []  # [K-1, Dv]
    return dec.collect([dec.sample_draft(x, gen) for x in [logits, *rest]])
