"""DFlash2's runtime (the kind's description: __init__.py beside this file).

    DFlash2Drafter  DFlashDrafter (model/dflash.py) whose layers wrap attention and MLP in GroupedConv, plus
                    candidate_selector (codebooks [V, r], hidden_projection [r, H])
    objective       DFlash's anchored blocks, plus per slot the selector's cross-entropy over the lm_head's top-k
                    candidates given the true token before it (rows whose true token is not a candidate add none)
    propose         the block's states once, then its slots left to right: the top-k candidates of each, rescored
                    by the draft before it (the bonus token for the first), as vLLM's DFlash2Speculator walks them
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from draftsmith.kinds.dflash.model import objective as dflash_objective
from draftsmith.model.dflash import DFlashDrafter, DFlashLayer
from draftsmith.train.dflash import DFlashObjective

__all__ = ["Drafter", "objective", "propose"]


class GroupedConv(nn.Module):
    """vLLM's DFlashGroupedConv: along each block's slots, out[s] = sum_t (base[side, t] + delta[s, t, group]) *
    x[s - t] over taps t with s - t in the block; delta is predicted per slot by kernel_projection from the layer's
    input. Starts as the identity (base tap 0 ones, the rest and the projection zeros): the drafter starts as
    DFlash's."""

    def __init__(self, hidden_size: int, taps: int, group_size: int, block_size: int) -> None:
        super().__init__()
        self.taps, self.group_size, self.block_size = taps, group_size, block_size
        self.groups = hidden_size // group_size
        base = torch.zeros(2, taps, hidden_size)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def _convolve(self, x: torch.Tensor, delta: torch.Tensor, side: int) -> torch.Tensor:
        """x [B, T, H] (T: whole blocks of block_size slots), delta [B, T, taps, G] -> [B, T, H]."""
        B, T, H = x.shape
        S, G = self.block_size, self.groups
        xb = x.reshape(B, T // S, S, G, self.group_size)
        d = delta.reshape(B, T // S, S, self.taps, G, 1)
        base = self.base_kernel[side].view(self.taps, G, self.group_size)
        out = (base[0] + d[:, :, :, 0]) * xb
        for t in range(1, self.taps):  # slot s reads slot s - t of its own block; the first t read nothing
            shifted = F.pad(xb[:, :, :S - t], (0, 0, 0, 0, t, 0))
            out = out + (base[t] + d[:, :, :, t]) * shifted
        return out.reshape(B, T, H)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The input side: (convolved x, the output side's per-slot kernels [B, T, taps, G])."""
        coef = self.kernel_projection(x).unflatten(-1, (2, self.taps, self.groups))
        return self._convolve(x, coef[:, :, 0], 0), coef[:, :, 1]

    def finish(self, y: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
        return self._convolve(y, coef, 1)


class DFlash2Layer(DFlashLayer):
    def __init__(self, config) -> None:
        super().__init__(config)
        o = config.options
        args = (config.hidden_size, o["conv_kernel_size"], o["conv_group_size"], config.block_size)
        self.attention_conv = GroupedConv(*args)
        self.mlp_conv = GroupedConv(*args)

    def forward(self, x, cos, sin, context, mask):
        a, coef = self.attention_conv.prepare(self.input_layernorm(x))
        h = x + self.attention_conv.finish(self.self_attn(a, cos, sin, context, mask), coef)
        m, coef = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(m), coef)


class CandidateSelector(nn.Module):
    """vLLM's DFlash2 selector, by its parameter names: edge scores of each slot's candidates given a predecessor."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * rank ** -0.5)
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))  # scores start as the logits
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def scores(self, h: torch.Tensor, candidates: torch.Tensor, unary: torch.Tensor, prev: torch.Tensor):
        """h [n, H] a slot's normed states; candidates [n, k] token ids; unary [n, k] their logits; prev [n, P]
        predecessor ids -> [n, P, k]: unary + <predecessor[prev] * hidden_projection(h), successor[candidate]>."""
        hid = self.hidden_projection(h)
        pred = self.predecessor_codebook[prev] * hid[:, None]  # [n, P, r]
        return unary[:, None] + torch.einsum("npr,nkr->npk", pred, self.successor_codebook[candidates])


class DFlash2Drafter(DFlashDrafter):
    def __init__(self, config) -> None:
        super().__init__(config)
        self.layers = nn.ModuleList([DFlash2Layer(config) for _ in range(config.num_hidden_layers)])
        o = config.options
        self.candidate_selector = CandidateSelector(config.hidden_size, config.vocab_size, o["selector_rank"],
                                                    o["selector_top_k"])

    def candidates(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [n, H] normed states -> (the lm_head's top-k ids [n, k] (target ids: the whole vocabulary), logits)."""
        logits, ids = self.lm_head(h).topk(self.candidate_selector.top_k, dim=-1)
        return ids, logits


Drafter = DFlash2Drafter


class Objective(DFlashObjective):
    def slot_extra(self, x, logits, prev, targets):
        """The selector's cross-entropy over the slot's candidates (the logits' top-k, not trained through here)
        given the true token before it, where the true token is a candidate; the draft: the best-scored one."""
        sel = self.drafter.candidate_selector
        with torch.no_grad():
            unary, cand = logits.detach().topk(sel.top_k, dim=-1)  # [n, k]
        scores = sel.scores(x, cand, unary.to(x.dtype), prev[:, None])[:, 0].float()  # [n, k]
        right = cand == targets[:, None]
        ce = F.cross_entropy(scores, right.float().argmax(-1), reduction="none")
        return ce * right.any(-1), cand.gather(1, scores.detach().argmax(-1, keepdim=True))[:, 0]


def objective(drafter, target_head, scale, o):
    return dflash_objective(drafter, target_head, scale, o, cls=Objective)


def propose(dec, unread_ids: list[int], unread_aux, first_pos: int, cache, gen):
    d = dec.drafter
    pos = torch.arange(first_pos, first_pos + len(unread_ids), device=dec.device)[None]
    d.add_context(unread_aux.to(d.fc.weight.dtype), pos, cache)
    anchor = torch.tensor([[unread_ids[-1]]], device=dec.device)
    h = d.draft_states(anchor, first_pos + len(unread_ids), cache)[0]  # [K, H]
    cand, unary = d.candidates(h)
    picked, prev = [], unread_ids[-1]
    for j in range(h.shape[0]):
        s = d.candidate_selector.scores(h[j:j + 1], cand[j:j + 1], unary[j:j + 1],
                                        torch.tensor([[prev]], device=dec.device))[0, 0]  # [k]
        row = unary.new_full((d.config.draft_vocab_size,), float("-inf"))
        row[cand[j]] = s  # the walk's distribution: the candidates' scores, nothing else
        picked.append(dec.sample_draft(row, gen))
        prev = picked[-1][0]
    return dec.collect(picked)
