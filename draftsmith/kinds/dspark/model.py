"""DSpark's runtime (the kind's description: __init__.py beside this file).

    DSparkDrafter   DFlashDrafter (model/dflash.py) + markov_head: markov_w1 [V, r] (an embedding of the previous
                    token, by target id), markov_w2 [Dv, r] (a bias head): bias(prev) = markov_w2 @ markov_w1[prev]
    objective       DFlash's anchored blocks, each slot's logits + bias(the true token before it)
    propose         the block's backbone once, then its K slots left to right, each biased by the draft before it
                    (the bonus token for the first), as vLLM's DSparkSpeculator samples them
"""

from __future__ import annotations

import torch
import torch.nn as nn

from draftsmith.kinds.dflash.model import block_logits
from draftsmith.kinds.dflash.model import objective as dflash_objective
from draftsmith.model.dflash import DFlashDrafter
from draftsmith.train.dflash import DFlashObjective

__all__ = ["Drafter", "objective", "propose"]


class MarkovHead(nn.Module):
    """vLLM's vanilla DSpark Markov head, by its parameter names."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=rank ** -0.5)
        nn.init.zeros_(self.markov_w2.weight)  # no bias before it learns one: the drafter starts as DFlash's

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        """prev [...] target token ids -> the logit bias [..., Dv]."""
        return self.markov_w2(self.markov_w1(prev))


class DSparkDrafter(DFlashDrafter):
    def __init__(self, config) -> None:
        super().__init__(config)
        self.markov_head = MarkovHead(config.vocab_size, config.draft_vocab_size, config.options["markov_rank"])


Drafter = DSparkDrafter


class Objective(DFlashObjective):
    def slot_logits(self, x: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        return self.drafter.lm_head(x) + self.drafter.markov_head(prev).to(x.dtype)


def objective(drafter, target_head, scale, o):
    return dflash_objective(drafter, target_head, scale, o, cls=Objective)


def propose(dec, unread_ids: list[int], unread_aux, first_pos: int, cache, gen):
    rows, prev = block_logits(dec, unread_ids, unread_aux, first_pos, cache)  # [K, Dv], the bonus token
    picked = []
    for row in rows:
        bias = dec.drafter.markov_head(torch.tensor([prev], device=dec.device))[0]
        picked.append(dec.sample_draft(row + bias.to(row.dtype), gen))
        prev = picked[-1][0]  # a target id: markov_w1 is indexed by the target's vocabulary
    return dec.collect(picked)
