"""The DFlash objective (train.method=dflash): anchored blocks against the target's own distribution.

Per row, up to train.dflash_anchors anchors a are drawn among the positions whose next token is trained
(loss-masked, same document) and that have context (not a document's first token). Block a is the anchor token
and block_size - 1 mask slots (DFlashDrafter.block_forward); slot k (1 <= k < block_size) predicts t_{a+k}, and
its target is the target's distribution there, softmax(W_d @ last_hidden[a+k-1]) over the draft vocabulary, as
TTT step k-1's is. The loss is train.loss_*'s mix of distances (forward KL by default), summed per slot, weighted
gamma**(k-1) (DFlash's exponential decay: exp(-(k-1)/4) is gamma 0.78) and divided by the slot's positions over
the whole optimizer step, as TTTObjective does per step (with train.loss_chain, slot k's loss at an anchor is
weighted by prod over the slots j < k of 1 - TV_j there, held fixed: a block is accepted as a chain, ChainWeights as
TTT's steps); accuracy per slot is what TTT reports per step, so the logs, the manifest and `status` read alike for
every kind.

The anchors are drawn from a generator seeded by the micro-batch's tokens, so the draw is the same after a resume.
The loop draws them once per micro-batch in its data thread, on the host (`layouts`: the seed is read from host
tensors, no device sync), and `counts` and `forward` read that draw from batch.layout; a batch without a layout is
drawn where it is. Where a row has fewer candidates, every candidate is an anchor.
"""

from dataclasses import dataclass, fields

import torch
import torch.nn as nn

from draftsmith.train.data import Batch
from draftsmith.train.objective import ChainWeights, LossMix, mix_terms, overlap


@dataclass
class Blocks:
    """One micro-batch's anchors and trained slots."""

    anchors: torch.Tensor  # [R, M] int64 row indices (0 where the row has fewer: not valid)
    anchor_ok: torch.Tensor  # [R, M] bool
    masked: torch.Tensor  # [R, M, S-1] bool: slot k's token t_{a+k} is trained (loss mask, document, row)
    valid: torch.Tensor  # [R, M, S-1] bool: ... and in the draft vocabulary (where the loss is taken)

    def to(self, device) -> "Blocks":
        return Blocks(*(getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)))


def draw_blocks(input_ids, loss_mask, doc_ids, t2d, block_size: int, max_anchors: int) -> Blocks:
    """The anchors and slots of a micro-batch ([R, T] tensors, t2d [V] bool), drawn reproducibly (module doc)."""
    R, T = input_ids.shape
    device = input_ids.device
    cand = torch.zeros(R, T, dtype=torch.bool, device=device)
    if T > 1:  # a: has context (not a document's first token) and its next token is trained
        cand[:, 1:T - 1] = (loss_mask[:, 2:] & (doc_ids[:, 2:] == doc_ids[:, 1:T - 1])
                            & (doc_ids[:, 1:T - 1] == doc_ids[:, :T - 2]))
    gen = torch.Generator().manual_seed(int(input_ids.sum()) * 1000003 + T)
    keys = torch.rand(R, T, generator=gen).to(device)  # a random order of the candidates, the others last
    keys = torch.where(cand, keys, 2.0)
    M = max(1, min(max_anchors, T))
    order = keys.argsort(dim=1)[:, :M]
    anchors = order.sort(dim=1).values  # [R, M] ascending
    anchor_ok = cand.gather(1, anchors)
    k = torch.arange(1, block_size, device=device)
    at = anchors[:, :, None] + k  # [R, M, S-1] the predicted token's index
    inside = at < T
    at_c = at.clamp(max=T - 1)
    rows = torch.arange(R, device=device)[:, None, None]
    masked = (anchor_ok[:, :, None] & inside & loss_mask[rows, at_c].bool()
              & (doc_ids[rows, at_c] == doc_ids.gather(1, anchors)[:, :, None]))
    valid = masked & t2d[input_ids[rows, at_c]]
    return Blocks(anchors=anchors, anchor_ok=anchor_ok, masked=masked, valid=valid)


class DFlashObjective(nn.Module):
    """The DFlash drafter plus the frozen target head: forward() is one micro-batch's loss (TTTObjective's
    interface: `steps` = block_size - 1 slots, `counts`, `layouts`)."""

    def __init__(self, drafter, target_head, gamma: float, max_anchors: int, fc_input_scale=None,
                 teacher_temperature: float = 1.0, feature_noise: float = 0.0, mix: LossMix = LossMix(),
                 chain_weights: bool = False):
        super().__init__()
        self.drafter = drafter
        self.register_buffer("target_head", target_head, persistent=False)
        self.register_buffer("fc_input_scale", fc_input_scale, persistent=False)
        self.steps = drafter.config.block_size - 1
        self.gamma, self.max_anchors = gamma, max_anchors
        self.teacher_temperature, self.feature_noise, self.mix = teacher_temperature, feature_noise, mix
        self.chain_weights = chain_weights  # train.loss_chain: slot k's loss weighted as TTT step k-1's (ChainWeights)
        # validation sets keep_runs: every candidate is an anchor, and forward keeps (starts, runs) [R, T] in `runs`
        self.keep_runs, self.runs = False, None

    def _blocks(self, batch: Batch) -> Blocks:
        if self.keep_runs:  # all anchors: serving drafts a block after every emitted token it visits
            return draw_blocks(batch.input_ids, batch.loss_mask, batch.doc_ids, self.drafter.t2d,
                               self.drafter.config.block_size, batch.input_ids.shape[1])
        if isinstance(batch.layout, Blocks):  # drawn in the data thread (layouts)
            return batch.layout.to(batch.input_ids.device)
        return draw_blocks(batch.input_ids, batch.loss_mask, batch.doc_ids, self.drafter.t2d,
                           self.drafter.config.block_size, self.max_anchors)

    def layouts(self):
        """draw_blocks as a function of (input_ids, loss_mask, doc_ids) on the host, for the data thread (the draft
        vocabulary read to the host once, here)."""
        t2d, S, M = self.drafter.t2d.cpu(), self.drafter.config.block_size, self.max_anchors
        return lambda input_ids, loss_mask, doc_ids: draw_blocks(input_ids, loss_mask, doc_ids, t2d, S, M)

    def counts(self, batch: Batch):
        """[steps] float64: positions where slot k+1's loss is taken in this micro-batch (the denominators; on the
        host when the draw was made there)."""
        blocks = batch.layout if isinstance(batch.layout, Blocks) else self._blocks(batch)
        return blocks.valid.sum(dim=(0, 1)).double()

    def slot_logits(self, x: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Draft logits [n, Dv] of slots whose normed states are x [n, H]; prev [n]: the true token before each
        (a kind that conditions on it overrides this)."""
        return self.drafter.lm_head(x)

    def slot_extra(self, x: torch.Tensor, logits: torch.Tensor, prev: torch.Tensor, targets: torch.Tensor):
        """(a loss term per position [n] added to the slot's, the drafts as target ids [n]) for a kind that drafts
        otherwise than by the argmax of its logits; (None, None): DFlash's (no term, the argmax)."""
        return None, None

    def forward(self, batch: Batch, denom, scale: float = 1.0):
        """(loss, stats [steps, 5] float64: the loss's KL sum, valid positions, correct, masked per slot, and chain:
        anchors whose slots 1..k+1 are all right, among the anchors whose slot 1 is trained); denom, scale as
        TTTObjective.forward's."""
        d = self.drafter
        blocks = self._blocks(batch)
        aux = batch.aux_hidden
        if self.feature_noise > 0 and self.training:
            H = d.config.hidden_size
            a = aux.float().unflatten(-1, (-1, H))
            aux = (a + self.feature_noise * a.pow(2).mean(-1, keepdim=True).sqrt() * torch.randn_like(a)).flatten(
                -2).to(aux.dtype)
        if self.fc_input_scale is not None:
            aux = aux * self.fc_input_scale.to(aux.dtype)
        states = d.block_forward(batch.input_ids, aux, blocks.anchors, batch.position_ids, batch.doc_ids)
        R, M, S, H = states.shape
        T = batch.input_ids.shape[1]
        k = torch.arange(1, S, device=states.device)
        at = (blocks.anchors[:, :, None] + k).clamp(max=T - 1)  # [R, M, S-1] the predicted token's index
        rows = torch.arange(R, device=states.device)[:, None, None]
        targets = batch.input_ids[rows, at]
        prev = batch.input_ids[rows, at - 1]  # the token before each predicted one (slot 1's: the anchor)
        teacher_h = batch.last_hidden[rows, at - 1]  # the target's state before the predicted token
        losses, kls, correct = [], [], []
        # train.loss_chain: a block's slots are a chain at its anchor; positions: [R*M] flat anchors (boolean
        # indexing's order), the valid ones of each slot
        cw = (ChainWeights([blocks.valid[:, :, j].flatten().nonzero().squeeze(1) for j in range(S - 1)], R * M,
                           states.device) if self.chain_weights else None)
        hits = torch.zeros_like(blocks.valid)  # [R, M, S-1] slot j's draft is right (valid slots only)
        for j in range(S - 1):
            v = blocks.valid[:, :, j]
            x = d.norm(states[:, :, j + 1][v])  # [n, H]
            with torch.no_grad():
                t_logp = torch.log_softmax((teacher_h[:, :, j][v].float() @ self.target_head.float().t())
                                           / self.teacher_temperature, dim=-1)
                p = t_logp.exp()
            logits = self.slot_logits(x, prev[:, :, j][v])
            logq = torch.log_softmax(logits.float(), dim=-1)
            kl_pos = (p * (t_logp - logq)).sum(-1)  # [n]
            obj = kl_pos * self.mix.kl
            if not self.mix.pure_kl:
                obj = obj + mix_terms(self.mix, p, t_logp, logq)
            extra, drafted = self.slot_extra(x, logits, prev[:, :, j][v], targets[:, :, j][v])
            if extra is not None:
                obj = obj + extra
            if cw is not None:  # the slot's alpha from the distribution its loss trains, held fixed
                obj = obj * cw.take(j, overlap(p, logq.detach().exp()))
            w = scale * self.gamma ** j / denom[j] if denom[j] > 0 else 0.0
            losses.append(obj.sum() * w)
            kls.append(kl_pos.detach().sum().double())
            if drafted is None:
                pred = logits.detach().argmax(-1)
                drafted = pred + d.d2t[pred]
            hit = drafted == targets[:, :, j][v]
            hits[:, :, j][v] = hit
            correct.append(hit.sum().double())
        loss = torch.stack(losses).sum()
        valid = blocks.valid.sum(dim=(0, 1)).double()
        masked = blocks.masked.sum(dim=(0, 1)).double()
        # a block's draft of slot k counts when slots 1..k are all right (TTTObjective's chain, per anchor)
        alive = (hits & blocks.masked[:, :, :1]).cumprod(dim=2)  # [R, M, S-1]
        chain = alive.sum(dim=(0, 1)).double()
        if self.keep_runs:  # per anchor position: whether a block starts there, and its drafts right in a row
            starts = torch.zeros_like(batch.loss_mask, dtype=torch.bool)
            runs = torch.zeros_like(batch.input_ids)
            ok = blocks.anchor_ok
            starts[rows[:, :, 0].expand_as(blocks.anchors)[ok], blocks.anchors[ok]] = blocks.masked[:, :, 0][ok]
            runs[rows[:, :, 0].expand_as(blocks.anchors)[ok], blocks.anchors[ok]] = alive.sum(-1)[ok]
            self.runs = (starts, runs)
        return loss, torch.stack([torch.stack(kls), valid, torch.stack(correct), masked, chain], dim=1)
