"""The training objective: training-time test (TTT) against the target's own distribution.

The drafter is unrolled for `train.ttt_steps` steps (Eagle3Drafter.ttt_forward); step k at index i
predicts token t[i+2+k]. Its target is the target model's own next-token distribution there,
softmax(W_d @ last_hidden[i+1+k]) over the draft vocabulary (W_d = rows of the target's lm_head at
the draft ids, [Dv, H]). The loss is the forward KL(target || drafter), averaged over the positions
where it is defined (i+2+k inside the row and the same document, loss_mask[i+2+k] = 1, t[i+2+k] in
the draft vocabulary) across the whole optimizer step and all ranks, weighted gamma**k per step.
`LossMix` adds other distances between the same two distributions (reverse KL, total variation,
cross-entropy on the target's argmax: what greedy verification checks) to or instead of that KL;
the logged loss stays the forward KL whatever the mix, so runs with different mixes read alike.
Accuracy at step k counts the d2t-mapped argmax == t[i+2+k] over every loss-masked position
(tokens outside the draft vocabulary are misses): a marginal figure, what step k gets right whatever
steps 0..k-1 did. What a verifier accepts is a chain: the draft of step k at position i counts only
when steps 0..k-1 at i were right too (greedy verification at T=0 stops at the first miss), so the
objective also counts, per step k, the positions whose drafts 0..k are all right (`chain`, over the
positions where step 0 is trained); acceptance per position is that count over those positions and
the acceptance length 1 + their sum (`chain_acceptance`), as vLLM counts it on the target's own
greedy answers.
`train.loss_chain` trains that chain rather than each step apart: under speculative sampling the
expected accepted length at position i is sum_k prod_{j<=k} alpha_j(i), alpha_j(i) = sum_x min(p, q)
= 1 - TV at step j, so step k's loss at i is scaled by w_k(i) = prod_{j<k} alpha_j(i), taken from the
same forward's earlier steps and held fixed (ChainWeights: step k is pushed where its draft would
be reached; step 0 weighs 1, and a position weighs 0 after a step not trained there). The
denominators stay the positions counted, so the loss is the unweighted one with each position's term
scaled (the logged loss stays the unweighted forward KL); the weights are [positions] scalars per
step, built by scatters and gathers (no [tokens, Dv] block, no host read).

Memory at the recipes' scale (docs/scaling.md): the loss is taken a chunk of teacher positions at
a time (ChunkedKL), so no [tokens, draft vocab] float32 block of a whole micro-batch lives at once;
TTT attention runs through flex attention on CUDA (resolve_attention).

Host syncs: every size the loss takes from the data (positions per step, teacher rows, chunk
bounds, the SDPA path's key blocks) is a TTTLayout computed where the batch is still on the host
(the data thread, ttt_layout); with it, forward and backward read nothing back from the device
(fixed-shape gathers instead of nonzero()), so a micro-batch queues its kernels without waiting.
"""

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from draftsmith import DraftsmithError
from draftsmith.model.config import LOSS_CHUNK_ELEMENTS
from draftsmith.model.ttt import FlexShape, flex_attention, key_floors
from draftsmith.train.data import Batch, Packing


def ttt_masks(input_ids, loss_mask, doc_ids, t2d, steps: int) -> list[tuple[Any, Any]]:
    """Per TTT step k: (masked [R, T], valid [R, T]) bool, indexed by the drafting position i.

    masked: t[i+2+k] is a loss-masked token of the same document inside the row (accuracy's
    denominator); valid: masked and t[i+2+k] is in the draft vocabulary (where the KL is taken).
    """
    R, T = input_ids.shape
    in_vocab = t2d[input_ids]
    out = []
    for k in range(steps):
        s = k + 2
        masked = torch.zeros(R, T, dtype=torch.bool, device=input_ids.device)
        valid = torch.zeros_like(masked)
        if s < T:
            masked[:, :T - s] = loss_mask[:, s:] & (doc_ids[:, s:] == doc_ids[:, :T - s])
            valid[:, :T - s] = masked[:, :T - s] & in_vocab[:, s:]
        out.append((masked, valid))
    return out


def teacher_need(masks: list[tuple[Any, Any]]):
    """[R, T] bool: the teacher rows, every position j = i+1+k some step needs (its next token is
    step k's target at index i), each once for all steps; masks as ttt_masks returns them."""
    valid0 = masks[0][1]
    T = valid0.shape[1]
    need = torch.zeros_like(valid0)
    for k, (_, valid) in enumerate(masks):
        need[:, 1 + k:] |= valid[:, :T - 1 - k]
    return need


def fixed_positions(mask, n: int):
    """[M] bool with n True entries -> [n] int64 their indices, ascending, by fixed-shape ops:
    nonzero() (and boolean indexing) would read the count back to the host, a device sync."""
    slot = torch.where(mask, mask.cumsum(0) - 1, n)  # [M] each True entry's rank; the others to slot n
    out = torch.zeros(n + 1, dtype=torch.long, device=mask.device)
    return out.scatter_(0, slot, torch.arange(mask.numel(), device=mask.device))[:n]


@dataclass
class TTTLayout:
    """The sizes one micro-batch's loss takes from its data, as host ints (so DDP/FSDP hand it on
    as is). Computed where the batch is on the host (ttt_layout, in the data thread), they let
    TTTObjective.forward use fixed-shape gathers and no device->host read."""

    counts: list[int]  # [steps] N_k: positions where step k's KL is taken
    teacher: int  # N: teacher rows (teacher_need)
    # per step: where each chunk of `chunk` teacher rows begins among its N_k positions, then N_k
    bounds: list[list[int]]
    key_floors: list[int] | None  # the SDPA path's TTTMask key blocks (model.ttt.key_floors); None for flex


def ttt_layout(input_ids, loss_mask, doc_ids, t2d, steps: int, chunk: int, attention: str) -> TTTLayout:
    """The TTTLayout of a micro-batch ([R, T] tensors; t2d [V] bool), read on the host: tensors on
    a device are copied to the host first (device syncs: for callers without a layout)."""
    input_ids, loss_mask, doc_ids, t2d = (x.cpu() for x in (input_ids, loss_mask, doc_ids, t2d))
    masks = ttt_masks(input_ids, loss_mask, doc_ids, t2d, steps)
    need = teacher_need(masks).flatten()
    row_of = need.cumsum(0) - 1  # [R*T] teacher row of each needed position
    counts, bounds = [], []
    N = int(need.sum())
    cuts = torch.tensor(list(range(0, N, chunk)) + [N]) if chunk > 0 else None
    for k, (_, valid) in enumerate(masks):
        vi = valid.flatten().nonzero().squeeze(1)
        counts.append(vi.numel())
        # the teacher row of step k's position i is that of i+1+k (ascending with i)
        bounds.append(torch.searchsorted(row_of[vi + 1 + k], cuts).tolist() if cuts is not None else [])
    floors = key_floors(doc_ids) if attention == "sdpa" else None
    return TTTLayout(counts=counts, teacher=N, bounds=bounds, key_floors=floors)


def flex_shape(tc) -> FlexShape:
    """The FlexShape of a run of train section `tc`: its micro-batches' rows and row length (Packing.rows_of)
    and its TTT steps; validation packs the same rows."""
    row_len, rows = Packing.rows_of(tc)
    return FlexShape(rows, row_len, tc.ttt_steps)


def resolve_attention(spec: str, device) -> str:
    """train.attention -> the TTT attention path of ttt_forward ("sdpa" or "flex").

    `auto`: flex on CUDA (a fused kernel over the block mask: neither per-block key copies nor
    expanded GQA heads are kept for backward, which at 8k-token rows is tens of GB), SDPA
    elsewhere: torch has no flex-attention backward on the CPU ("FlexAttention does not support
    backward on CPU", torch 2.13), and before torch 2.5 no flex attention at all.
    """
    kind = torch.device(device).type
    if spec == "auto":
        return "flex" if kind == "cuda" and flex_attention is not None else "sdpa"
    if spec == "flex" and flex_attention is None:
        raise DraftsmithError(f"train.attention: flex needs torch >= 2.5 (this is {torch.__version__}); "
                              "use sdpa or auto")
    if spec == "flex" and kind == "cpu":
        raise DraftsmithError("train.attention: flex cannot train on the CPU (torch has no flex-attention backward "
                              "there); use sdpa or auto")
    return spec


@dataclass(frozen=True)
class LossMix:
    """Weights of the distances between the target's distribution p and the drafter's q, per position:
    kl: forward KL(p || q), the EAGLE objective (mass-covering); rkl: reverse KL(q || p) (mode-seeking);
    tv: total variation 0.5 * sum |p - q|, of which 1 - tv bounds the chance a sampled draft is kept;
    top1: -log q(argmax p), the cross-entropy on the token greedy verification accepts."""

    kl: float = 1.0
    rkl: float = 0.0
    tv: float = 0.0
    top1: float = 0.0

    @property
    def pure_kl(self) -> bool:
        return self.kl == 1 and self.rkl == 0 and self.tv == 0 and self.top1 == 0


@dataclass(frozen=True)
class ObjectiveOptions:
    """What a kind's objective builder takes (kinds/<kind>/model.py: objective), made once from the train section by
    objective_options: the kinds' objectives read no config, and each train key of the objective is read here."""

    steps: int  # train.ttt_steps: a chain's unrolled draft steps (a block kind's slots come from its block_size)
    gamma: float  # train.gamma: draft step k's loss weighs gamma**k
    teacher_temperature: float  # train.teacher_temperature: the target's logits are divided by it
    feature_noise: float  # train.feature_noise: the std of the noise added to the aux states, relative to their RMS
    anchors: int  # train.dflash_anchors: blocks drawn per row (block kinds)
    chunk_tokens: int | None  # train.loss_chunk_tokens: teacher positions per chunk of the loss (TTTObjective)
    mix: LossMix  # train.loss_kl / loss_rkl / loss_tv / loss_top1
    chain_weights: bool  # train.loss_chain: step k's loss at a position weighs the chance drafts 0..k-1 are kept
    attention: str  # the TTT attention path, "sdpa" or "flex" (resolve_attention)
    flex: FlexShape | None  # with flex attention, the run's shape (flex_shape); else None


def objective_options(tc, attention: str) -> ObjectiveOptions:
    """The objective's options from train section `tc`, with the resolved TTT `attention`."""
    return ObjectiveOptions(steps=tc.ttt_steps, gamma=tc.gamma, teacher_temperature=tc.teacher_temperature,
                            feature_noise=tc.feature_noise, anchors=tc.dflash_anchors,
                            chunk_tokens=tc.loss_chunk_tokens,
                            mix=LossMix(kl=tc.loss_kl, rkl=tc.loss_rkl, tv=tc.loss_tv, top1=tc.loss_top1),
                            chain_weights=tc.loss_chain,
                            attention=attention, flex=flex_shape(tc) if attention == "flex" else None)


def mix_terms(mix: LossMix, p, logp, logq, q=None):
    """The mix at each position of a chunk ([n, Dv] float32: p, logp the teacher's (logp may be None
    when mix.rkl is 0), logq the drafter's; q = exp(logq) if already taken) -> [n] the mixed
    distance per position, without its forward-KL part (sum p log p - sum p log q, taken apart)."""
    q = logq.exp() if q is None else q
    out = logq.new_zeros(logq.shape[0])
    if mix.rkl:
        out += mix.rkl * (q * (logq - logp)).sum(-1)
    if mix.tv:
        out += mix.tv * 0.5 * (q - p).abs().sum(-1)
    if mix.top1:
        out -= mix.top1 * logq.gather(1, p.argmax(-1, keepdim=True)).squeeze(1)
    return out


def overlap(p, q):
    """[n, Dv] float32 the target's p, the drafter's q -> [n] sum_x min(p, q) = 1 - TV(p, q): the chance that
    speculative sampling keeps a draft sampled from q where the target samples from p."""
    return torch.minimum(p, q).sum(-1)


class ChainWeights:
    """train.loss_chain: the weight of step k's loss at drafting position i, w_k(i) = prod_{j<k} alpha_j(i), where
    alpha_j(i) = overlap(p, q) of step j at i (the chance its draft is kept) from the same forward, held fixed (no
    gradient flows through it: the gradient of the expected accepted length sum_k prod_{j<=k} alpha_j through
    step k's alpha, the earlier steps held). Step 0's weight is 1; a position where an earlier step is not trained
    (its target outside the draft vocabulary or the answer: a chain the drafter cannot continue) weighs 0.

    Steps are taken in order at each position (take(j) before take(k) for j < k: the chunked loss reaches step j's
    position i no later than step k's, since the teacher row of i+1+j precedes that of i+1+k, and takes the steps
    of a chunk in order), each recording alpha * its weight for the next step: scatters and gathers of fixed
    shape, no device->host read.
    positions: per step k, [N_k] int64 the flat drafting positions where its loss is taken; size: all of them."""

    def __init__(self, positions: list, size: int, device):
        self.positions = positions
        # [steps, size] float32: row k, step k's weight at each position (0 until step k-1 records it there)
        self.w = torch.zeros(len(positions), size, device=device)

    def take(self, k: int, alpha, s: int = 0, e: int | None = None):
        """alpha [n]: step k's at its positions s:e (of positions[k]) -> [n] step k's weights there."""
        pos = self.positions[k][s:e]
        w = self.w[k, pos] if k else torch.ones_like(alpha)
        if k + 1 < len(self.positions):
            self.w[k + 1].index_copy_(0, pos, w * alpha)
        return w


def mix_grad(mix: LossMix, p, logp, logq, q):
    """d (sum over positions of mix_terms + mix.kl * KL) / d logits, [n, Dv] float32 (the softmax's
    Jacobian applied: for f(q), df/dz = q * (df/dq - sum q df/dq))."""
    g = mix.kl * (q - p)
    if mix.rkl:
        d = logq - logp  # d/dq of sum q (log q - log p) is (log q - log p) + 1; the 1 cancels in the Jacobian
        g += mix.rkl * q * (d - (q * d).sum(-1, keepdim=True))
    if mix.tv:
        s = 0.5 * torch.sign(q - p)
        g += mix.tv * q * (s - (q * s).sum(-1, keepdim=True))
    if mix.top1:
        g += mix.top1 * q
        g.scatter_add_(1, p.argmax(-1, keepdim=True), torch.full_like(q[:, :1], -mix.top1))
    return g


@dataclass
class KLPlan:
    """What ChunkedKL needs besides the tensors it differentiates. Per TTT step k, over its trained
    positions (ascending): rows[k] [N_k] int64 the teacher row of each (ascending too: row of
    position i is that of i+1+k), targets[k] [N_k] int64 the token t[i+2+k]; weights[k] the
    factor of step k's KL sum in the loss."""

    rows: list
    targets: list
    weights: list[float]
    bounds: list[list[int]]  # TTTLayout.bounds: per step, where each chunk's positions begin (then N_k)
    d2t: Any  # [Dv] int64
    temperature: float
    chunk: int  # teacher rows per chunk
    grad_weight: bool  # compute the gradient of the drafter's head
    grad_states: bool  # ... and of the states it reads
    mix: LossMix = LossMix()  # the loss's distances; its forward KL is what `kl` reports either way
    chain: ChainWeights | None = None  # train.loss_chain: scales each position's loss and gradient; None: all 1


class ChunkedKL(torch.autograd.Function):
    """The loss sum_k weights[k] * KL_k and its gradient, a chunk of teacher rows at a time (with
    plan.mix other than pure KL, KL_k is that mix of distances summed over step k's positions; with
    plan.chain, each position's term and its row of d/dlogits scaled by its chain weight [n]).

    KL_k sums, over step k's positions, KL(p || q): p = softmax(teacher_hidden[row] @ teacher_head^T
    / T) the teacher's distribution, q = softmax(x_k @ weight^T) the drafter's. Each chunk's
    teacher distribution is computed once and serves every step (a teacher row is at most one
    position of each step), and each chunk's gradients (d/dlogits = weights[k] * (q - p)) are
    taken in the same pass and accumulated into [N_k, H] and [Dv, H] tensors: no [tokens, Dv]
    block outlives its chunk, and no head matmul runs twice. Under autocast every matmul runs as
    the unchunked loss's does (bf16 in, the gradients of the logits cast to bf16 as its backward
    casts them), the head's gradient is accumulated in float32.

    forward(plan, weight [Dv, H], teacher_head [Dv, H], teacher_hidden [N, H], *xs [N_k, H]) ->
    (loss [], kl [steps] float64 (unweighted sums), correct [steps] float64 (argmax mapped
    through d2t == target), *hits [N_k] bool (that test per position, for the chain counts)).
    The graph is used once: backward scales the saved gradients in place.
    """

    @staticmethod
    def forward(ctx, plan: KLPlan, weight, teacher_head, teacher_hidden, *xs):
        steps, N = len(xs), teacher_hidden.shape[0]
        kl = weight.new_zeros(steps, dtype=torch.float64)
        # pure KL unweighted: the chunk's sum is one dot product; else the loss is summed per position
        per_pos = plan.chain is not None or not plan.mix.pure_kl
        mixed = weight.new_zeros(steps, dtype=torch.float64) if per_pos else kl  # the objective's sums
        correct = weight.new_zeros(steps, dtype=torch.float64)
        hits = [torch.zeros(x.shape[0], dtype=torch.bool, device=x.device) for x in xs]
        gw = torch.zeros_like(weight, dtype=torch.float32) if plan.grad_weight else None
        gxs = [torch.zeros_like(x) for x in xs] if plan.grad_states else []
        starts = list(range(0, N, plan.chunk))
        bounds = plan.bounds  # per step: where each chunk's positions begin and end (host ints)
        for c, a in enumerate(starts):
            t_logits = teacher_hidden[a:a + plan.chunk] @ teacher_head.t()  # [C, Dv]
            t_logp = torch.log_softmax(t_logits.float() / plan.temperature, dim=-1)
            del t_logits
            t_p = t_logp.exp()
            t_negent = (t_p * t_logp).sum(-1)  # [C] sum p log p, the KL's constant part
            if not plan.mix.rkl:
                del t_logp
            for k, x in enumerate(xs):
                s, e = bounds[k][c], bounds[k][c + 1]
                if s == e:
                    continue
                r = plan.rows[k][s:e] - a
                xc = x[s:e]
                logits = F.linear(xc, weight)  # [n, Dv]
                logq = torch.log_softmax(logits.float(), dim=-1)
                p = t_p[r]
                # KL(p || q) summed over the chunk's positions = sum p log p - sum p log q; a mix
                # needs it per position, pure KL only the chunk's sum (one dot product)
                if not per_pos:
                    kl[k] += t_negent[r].sum().double() - torch.dot(p.flatten(), logq.flatten()).double()
                else:
                    kl_pos = t_negent[r] - (p * logq).sum(-1)  # [n]
                    kl[k] += kl_pos.sum().double()
                    logp = t_logp[r] if plan.mix.rkl else None
                    q = logq.exp()
                    obj = plan.mix.kl * kl_pos + mix_terms(plan.mix, p, logp, logq, q)  # [n]
                    if plan.chain is not None:
                        cw = plan.chain.take(k, overlap(p, q), s, e)  # [n] chain weights
                        obj = obj * cw
                    mixed[k] += obj.sum().double()
                pred = logits.argmax(-1)
                hit = (pred + plan.d2t[pred]) == plan.targets[k][s:e]
                hits[k][s:e] = hit
                correct[k] += hit.sum().double()
                if gw is None and not gxs:
                    continue
                # d loss / d logits (pure KL: weights[k] * (q - p), p sums to 1, in place), then in the
                # logits' dtype as the unchunked backward casts it (under autocast: the same bf16 values)
                if not per_pos:
                    g = logq.exp_().sub_(p).mul_(plan.weights[k]).to(logits.dtype)
                else:
                    g = mix_grad(plan.mix, p, logp, logq, q).mul_(plan.weights[k])
                    if plan.chain is not None:
                        g.mul_(cw[:, None])  # each position's row scaled by its chain weight
                    g = g.to(logits.dtype)
                    del q, logp
                del logq, p
                if gxs:
                    gxs[k][s:e] = (g @ weight).to(x.dtype)
                if gw is not None and g.dtype == gw.dtype:
                    gw.addmm_(g.t(), xc)
                elif gw is not None:  # autocast: a bf16 product, accumulated in float32
                    # added element by element in float32 (the same values as .float() then +=) without a float32
                    # copy of the [Dv, H] product: at Kimi's widths that copy was 0.9 GB beside the bf16 one
                    gw.add_(g.t() @ xc)
        ctx.save_for_backward(*([gw] if gw is not None else []), *gxs)
        ctx.has_gw, ctx.steps, ctx.w_dtype = gw is not None, steps, weight.dtype
        ctx.mark_non_differentiable(kl, correct, *hits)
        # weighted by Python floats: a tensor of the weights would be a host->device copy (a sync)
        loss = torch.stack([mixed[k] * w for k, w in enumerate(plan.weights)]).sum()
        return (loss.to(torch.float32), kl, correct, *hits)

    @staticmethod
    def backward(ctx, g_loss, _g_kl, _g_correct, *_g_hits):
        saved = list(ctx.saved_tensors)
        gw = saved.pop(0).mul_(g_loss).to(ctx.w_dtype) if ctx.has_gw else None
        gxs = [gx.mul_(g_loss.to(gx.dtype)) for gx in saved] or [None] * ctx.steps
        return (None, gw, None, None, *gxs)


class TTTObjective(nn.Module):
    """The drafter plus the frozen target head: forward() is one micro-batch's loss.

    A module (not a function) so that DDP/FSDP wrap it and see every parameter used.
    target_head: W_d [Dv, H], the target lm_head's rows at the draft ids.
    attention: ttt_forward's path ("sdpa" or "flex", resolve_attention).
    chunk_tokens: teacher positions per chunk of the loss (ChunkedKL); None: LOSS_CHUNK_ELEMENTS // Dv;
    0: the whole micro-batch as one autograd graph (the loss before chunks: [N, Dv] float32
    blocks kept for backward; the reference the chunked loss is tested against).
    flex_shape: with flex attention, the rows and length buckets every micro-batch is padded to in
    it (flex_shape(tc)); None: each micro-batch's own (one-off use).
    chain_weights: train.loss_chain, each step's loss at a position weighted by ChainWeights.
    """

    def __init__(self, drafter, target_head, steps: int, gamma: float, fc_input_scale=None,
                 teacher_temperature: float = 1.0, feature_noise: float = 0.0, attention: str = "sdpa",
                 chunk_tokens: int | None = None, mix: LossMix = LossMix(), flex_shape: FlexShape | None = None,
                 chain_weights: bool = False):
        super().__init__()
        self.drafter = drafter
        self.register_buffer("target_head", target_head, persistent=False)
        # [3H] or None: aux states are multiplied by it before fc (train.fc_input_norm)
        self.register_buffer("fc_input_scale", fc_input_scale, persistent=False)
        self.steps, self.gamma = steps, gamma
        self.teacher_temperature = teacher_temperature
        self.feature_noise = feature_noise
        self.attention = attention
        self.flex_shape = flex_shape
        self.mix = mix
        self.chain_weights = chain_weights
        self.chunk_tokens = (max(1, LOSS_CHUNK_ELEMENTS // target_head.shape[0]) if chunk_tokens is None
                             else chunk_tokens)
        # validation sets keep_runs: forward then keeps (starts [R, T] bool, runs [R, T] int64) in `runs`
        self.keep_runs, self.runs = False, None

    def counts(self, batch: Batch):
        """[steps] float64: positions where step k's loss is taken in this micro-batch (the denominators)."""
        return step_counts(batch, self.drafter.t2d, self.steps)

    def layouts(self) -> Callable[..., TTTLayout]:
        """ttt_layout for this objective: a function of (input_ids, loss_mask, doc_ids) on the host,
        for the data thread (the draft vocabulary read to the host once, here)."""
        t2d = self.drafter.t2d.cpu()
        return lambda input_ids, loss_mask, doc_ids: ttt_layout(input_ids, loss_mask, doc_ids, t2d, self.steps,
                                                               self.chunk_tokens, self.attention)

    def forward(self, batch: Batch, denom, scale: float = 1.0):
        """The loss of micro-batch `batch` (its tensors and layout; on the training device):
        returns (loss, stats [steps, 5] float64: KL sum, valid positions, correct, masked, chain: positions
        whose drafts 0..k are all right, among the positions where step 0 is trained; chain_acceptance).

        loss = scale * sum_k gamma^k * KL_sum_k / denom[k] (KL_sum_k: the LossMix's sum); denom [steps] = valid
        positions of step k over the whole optimizer step (all micro-batches, all ranks), so that the
        accumulated gradient is the token mean of the step whatever the micro-batching.
        denom is a list of floats (no device sync); scale = number of ranks, which undoes the
        gradient averaging of DDP/FSDP. batch.layout: its TTTLayout (self.layouts()), read on
        the host; None: computed here from the device tensors (device->host reads).
        """
        d = self.drafter
        input_ids, loss_mask, doc_ids, aux_hidden = batch.input_ids, batch.loss_mask, batch.doc_ids, batch.aux_hidden
        layout = batch.layout
        R, T = input_ids.shape
        H = d.config.hidden_size
        masks = ttt_masks(input_ids, loss_mask, doc_ids, d.t2d, self.steps)
        if layout is None:
            layout = ttt_layout(input_ids, loss_mask, doc_ids, d.t2d, self.steps, self.chunk_tokens, self.attention)
        if self.feature_noise > 0 and self.training:
            # train.feature_noise: Gaussian noise of std feature_noise x each state's own RMS
            # (per token and aux layer), so the noise follows the residual stream's scale
            A = aux_hidden.shape[-1] // H
            a = aux_hidden.float().reshape(R, T, A, H)
            rms = a.pow(2).mean(-1, keepdim=True).sqrt()  # [R, T, A, 1]
            aux_hidden = (a + self.feature_noise * rms * torch.randn_like(a)).reshape(R, T, A * H).to(aux_hidden.dtype)
        if self.fc_input_scale is not None:
            aux_hidden = aux_hidden * self.fc_input_scale.to(aux_hidden.dtype)
        states = d.ttt_forward(input_ids, aux_hidden, self.steps, position_ids=batch.position_ids,
                               doc_ids=doc_ids, return_hidden=True, attention=self.attention,
                               key_floors=layout.key_floors, flex_shape=self.flex_shape)  # steps x [R, T, H]

        # The teacher rows, each once for all steps; sizes from the layout, so no nonzero()
        need_idx = fixed_positions(teacher_need(masks).flatten(), layout.teacher)  # [N]
        row_of = torch.full((R * T,), -1, dtype=torch.long, device=input_ids.device)
        row_of[need_idx] = torch.arange(layout.teacher, device=input_ids.device)
        weights = [scale * self.gamma ** k / denom[k] if denom[k] > 0 else 0.0 for k in range(self.steps)]
        # [N_k] flat drafting positions of each step
        vis = [fixed_positions(valid.flatten(), n) for (_, valid), n in zip(masks, layout.counts)]
        xs = [d.norm(states[k].reshape(-1, H)[vi]) for k, vi in enumerate(vis)]  # [N_k, H]
        teacher = batch.last_hidden.reshape(-1, H)[need_idx]  # [N, H]
        cw = ChainWeights(vis, R * T, input_ids.device) if self.chain_weights else None
        if self.chunk_tokens == 0:
            kl, correct, loss, hits = self._unchunked(xs, vis, row_of, teacher, input_ids.flatten(), weights, cw)
        else:
            plan = KLPlan(rows=[row_of[vi + 1 + k] for k, vi in enumerate(vis)],
                          targets=[input_ids.flatten()[vi + 2 + k] for k, vi in enumerate(vis)], weights=weights,
                          bounds=layout.bounds, d2t=d.d2t, temperature=self.teacher_temperature,
                          chunk=self.chunk_tokens,
                          grad_weight=torch.is_grad_enabled() and d.lm_head.weight.requires_grad,
                          grad_states=torch.is_grad_enabled() and any(x.requires_grad for x in xs), mix=self.mix,
                          chain=cw)
            loss, kl, correct, *hits = ChunkedKL.apply(plan, d.lm_head.weight, self.target_head, teacher, *xs)
        counts = torch.stack([valid.sum() for _, valid in masks]).double()  # on the device: no host->device copy
        masked = torch.stack([m.sum() for m, _ in masks]).double()
        # the chain: step k's hits scattered back to their drafting positions [R*T], and-ed over steps 0..k
        alive = masks[0][0].flatten()
        chain, run = [], torch.zeros(R * T, dtype=torch.long, device=input_ids.device)
        for vi, hit in zip(vis, hits):
            at = torch.zeros(R * T, dtype=torch.bool, device=input_ids.device)
            alive = alive & at.index_put_((vi,), hit)
            chain.append(alive.sum())
            run += alive
        chain = torch.stack(chain).double()
        if self.keep_runs:  # validation: where chains start and how many drafts each gets right (serving_walk)
            self.runs = (masks[0][0], run.view(R, T))
        return loss, torch.stack([kl.detach().double(), counts, correct.double(), masked, chain], dim=1)

    def _unchunked(self, xs, vis, row_of, teacher, flat_ids, weights, chain=None):
        """The loss as one autograd graph over the whole micro-batch: (kl [steps], correct [steps], loss,
        hits: per step [N_k] bool); chain: the ChainWeights that scale each position's term, or None."""
        d = self.drafter
        with torch.no_grad():
            t_logits = teacher @ self.target_head.t()  # [N, Dv]
            t_logp = torch.log_softmax(t_logits.float() / self.teacher_temperature, dim=-1)
            t_p = t_logp.exp()
            t_negent = (t_p * t_logp).sum(-1)  # [N] sum p log p, the KL's constant part
        loss, kls, correct, hits = 0.0, [], [], []
        for k, (x, vi) in enumerate(zip(xs, vis)):
            logits = d.lm_head(x)  # [N_k, Dv]
            logq = torch.log_softmax(logits.float(), dim=-1)
            rows = row_of[vi + 1 + k]
            # forward KL(p || q) summed over positions = sum p log p - sum p log q; the
            # cross term as one dot product (no [N_k, Dv] temporary in the forward)
            kl = t_negent[rows].sum() - torch.dot(t_p[rows].flatten(), logq.flatten())
            if chain is None:
                obj = (kl if self.mix.pure_kl
                       else self.mix.kl * kl + mix_terms(self.mix, t_p[rows], t_logp[rows], logq).sum())
            else:  # per position [N_k], each scaled by its (detached) chain weight
                p = t_p[rows]
                kl_pos = t_negent[rows] - (p * logq).sum(-1)
                w = chain.take(k, overlap(p, logq.detach().exp()))
                obj = ((self.mix.kl * kl_pos + mix_terms(self.mix, p, t_logp[rows], logq)) * w).sum()
            # every step's term stays in the graph (weight 0 when it has no position anywhere),
            # so every parameter gets a gradient on every rank
            loss = loss + weights[k] * obj
            kls.append(kl)
            with torch.no_grad():
                pred = logits.argmax(-1)
                hits.append((pred + d.d2t[pred]) == flat_ids[vi + 2 + k])
                correct.append(hits[-1].sum().double())
        return torch.stack(kls), torch.stack(correct), loss, hits


def step_counts(batch: Batch, t2d, steps: int):
    """[steps] float64: positions where step k's KL is defined in this micro-batch."""
    masks = ttt_masks(batch.input_ids, batch.loss_mask, batch.doc_ids, t2d, steps)
    return torch.stack([v.sum() for _, v in masks]).double()


def fc_input_scale(batch: Batch, eps: float = 1e-3):
    """[3H] float32: 1 / the RMS of each aux-state dimension over the batch's real tokens, leaving
    out each document's first token (an attention sink whose states are orders of magnitude larger:
    24,832 in SmolLM2's layers 15 and 27)."""
    keep = (batch.doc_ids >= 0) & (batch.position_ids > 0)
    if not bool(keep.any()):
        keep = batch.doc_ids >= 0
    x = batch.aux_hidden[keep].float()  # [N, 3H]
    return 1.0 / x.pow(2).mean(0).sqrt().clamp_min(eps)


def serving_walk(starts, runs, K: int) -> list[int]:
    """[drafts, accepted, accepted at position 0..K-1]: how a greedy verifier (vLLM at T=0) counts on these answers.
    starts [R, T] bool: positions where a chain of K drafts can start (the drafted token is an answer token), each
    answer a contiguous span of them; runs [R, T] int: the drafts right in a row from there (the objective's chain).
    Serving visits positions, not all of them: the first answer token comes from the prefill (the span's first start
    is never drafted from), then each step drafts at the position after the last emitted token and emits the run of
    accepted drafts plus one more, so the next step is r + 1 positions on. Visited positions are biased toward where
    drafts fail (a long run skips what follows it), which is why this, not the mean over all positions
    (chain_acceptance), is what serving reaches."""
    out = [0] * (K + 2)
    for _, _, walked in walk_answers(starts, runs, K):
        for k, x in enumerate(walked):
            out[k] += x
    return out


def walk_answers(starts, runs, K: int):
    """serving_walk's count of each answer apart: (row, its first position, [drafts, accepted, accepted at position
    0..K-1]) for every contiguous span of starts (an answer), so a caller can attribute them to samples (the
    validation's standard error, draftsmith/acceptance.py)."""
    starts, runs = np.asarray(starts, dtype=bool), np.asarray(runs, dtype=np.int64)
    for r in range(starts.shape[0]):
        pos = np.flatnonzero(starts[r])
        if pos.size == 0:
            continue
        breaks = np.flatnonzero(np.diff(pos) != 1) + 1
        for seg in np.split(pos, breaks):
            out = [0] * (K + 2)
            i, end = int(seg[0]) + 1, int(seg[-1])
            while i <= end:
                n = min(int(runs[r, i]), K)
                out[0] += 1
                out[1] += n
                for k in range(n):
                    out[2 + k] += 1
                i += n + 1
            yield r, int(seg[0]), out


def chain_acceptance(chain: list[float], starts: float) -> tuple[float | None, list[float | None]]:
    """(acceptance length, acceptance per position) from chain counts: chain[k] = positions whose
    drafts 0..k were all right, out of `starts` positions where a chain of drafts starts (step 0
    trained). Acceptance at position k is chain[k] / starts: the share of drafts whose first k+1
    tokens a greedy verifier accepts; the acceptance length is 1 + their sum = the mean over positions
    of 1 + the length of the run of consecutive right drafts there, capped at K = len(chain): what
    vLLM reports as 1 + accepted / drafts at T=0 when the target's answers are its own greedy ones.
    (None, [None] * K) when no chain starts."""
    if starts <= 0:
        return None, [None] * len(chain)
    per_pos = [c / starts for c in chain]
    return 1.0 + sum(per_pos), per_pos
