"""The validation split and its pass: what a drafter's acceptance is on samples it never trained on.

Split: draftsmith/heldout.py (whole groups, a conversation or a prompt with its resampled answers, by a hash of
the group; the same split vocab leaves out of the draft vocabulary). The held-out samples get length 0 in the
training packing (train/data.py skips them), so no step ever reads them; train writes them with their groups to
train/validation.json. Offline they are read from the extract store,
online from the same source as training (the target in process, or the vLLM servers).

Pass (`Validation.run`). Every train.validate_every optimizer steps and after the last: the drafter in eval mode
(no feature noise), no gradient, under the training precision, the validation micro-batches through the
objective's own forward (TTT for eagle3/peagle, the anchored blocks for DFlash: exactly the numbers training
computes), each rank its share of the micro-batches (FSDP needs every rank in every forward, so the shares are
padded to equal counts with passes whose numbers are dropped), the statistics summed over the ranks.
The figures (`figures`): per step the loss and marginal accuracy; the acceptance length and acceptance per position
a greedy verifier gets on these answers at K = the trained steps, counted as serving counts them
(objective.serving_walk: drafts from the positions serving visits, each step r + 1 tokens on) — the prediction of
vLLM's tau; and, as `position_mean`, the chain's mean over every position (objective.chain_acceptance, what the
train line shows for the batches it fits), which runs ahead of serving where easy and hard stretches alternate.
They are taken where serving drafts: on the answers (the assistant tokens, whatever train.loss_on and
loss_skip_tokens train on), and on the target's greedy answers only: a held-out prompt's
resampled answers (generate.answers_per_prompt) stay out of training but are not measured, since served at T=0
the target's greedy answer is what is verified. When every answer was sampled (generate.temperature > 0) the
chain is taken on sampled continuations and predicts greedy serving less closely (the train log says so).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from draftsmith.acceptance import acceptance
from draftsmith.heldout import is_greedy
from draftsmith.train.data import pack_epoch
from draftsmith.train.objective import chain_acceptance, walk_answers


def figures(stats: list[list[float]], walk: list[float], per_sample: list[tuple[float, float]] = ()) -> dict:
    """Figures of summed statistics [steps][5] (KL sum, valid, correct, masked, chain; objective.forward) and of the
    serving walk [drafts, accepted, accepted per position] (objective.serving_walk): loss and marginal accuracy per
    step (None where a step has no position), the acceptance length and per position as served (the walk) with the
    acceptance length's standard error over the measured samples' (drafts, accepted) (draftsmith/acceptance.py),
    the drafts it made and the positions chains start at, and the chain's mean over every position
    (`position_mean`)."""
    loss = [kl / n if n > 0 else None for kl, n, _, _, _ in stats]
    acc = [c / m if m > 0 else None for _, _, c, m, _ in stats]
    starts = stats[0][3] if stats else 0.0
    mean_tau, mean_pos = chain_acceptance([row[4] for row in stats], starts)
    drafts = walk[0] if walk else 0.0
    tau, per_pos = chain_acceptance(walk[2:], drafts) if walk else (None, [])
    _, se = acceptance(per_sample)
    return {"loss": loss, "acc": acc, "acceptance_length": tau, "acceptance_length_se": se,
            "acceptance_per_position": per_pos, "error": "delta method over the measured samples",
            "drafts": int(drafts), "positions": int(starts),
            "position_mean": {"acceptance_length": mean_tau, "acceptance_per_position": mean_pos}}


class Validation:
    """The held-out samples of a run and the pass over them (module doc)."""

    def __init__(self, indices: list[int], ids: list[str], lengths: list[int], row_len: int, rows_per_batch: int,
                 rank: int, world: int):
        self.indices = indices  # held out of training
        greedy = [i for i in indices if is_greedy(ids[i])]
        self.measured = greedy or indices  # what the pass reads (module doc)
        keep = set(self.measured)
        only = [n if i in keep else 0 for i, n in enumerate(lengths)]
        self.tokens = sum(min(only[i], row_len) for i in self.measured)
        # fixed micro-batches (seed and epoch 0): every pass reads the same rows
        plan = pack_epoch(only, row_len, rows_per_batch, seed=0, epoch=0) if self.measured else []
        per_rank = -(-len(plan) // world) if plan else 0
        # rank r's share, padded to per_rank with its first batch (or the run's first) whose numbers are dropped
        mine = plan[rank::world]
        self.batches = [(rows, True) for rows in mine] + [((mine or plan)[0], False)] * (per_rank - len(mine))
        self.row_len = row_len

    def __len__(self) -> int:
        return len(self.indices)

    def run(self, objective, source, prepare, device, act_dtype, precision: str, ranks, say, log_every_s: float,
            busy) -> dict:
        """One pass (every rank calls it): the figures over all ranks' shares, with the samples, tokens and
        seconds it took. `prepare`: the loop's host-side step (loss mask, layout); `busy`: the stage's
        Progress.busy, so `status` shows the phase."""
        t0 = last = time.perf_counter()
        stats, walk = None, [0] * (objective.steps + 2)
        # per measured sample (in self.measured's order): [drafts, accepted], summed over ranks for the error
        slot = {i: j for j, i in enumerate(self.measured)}
        per_sample = torch.zeros(len(self.measured), 2, dtype=torch.float64)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
        objective.eval()
        objective.keep_runs = True
        try:
            with busy("validation"), torch.no_grad(), autocast:
                for j, (rows, counted) in enumerate(self.batches):
                    b = prepare(source.batch(rows, self.row_len)).to(device, act_dtype)
                    _, s = objective(b, [1.0] * objective.steps)
                    stats = torch.zeros_like(s) if stats is None else stats
                    if counted:
                        stats += s
                        starts, runs = objective.runs
                        docs = b.doc_ids.cpu()
                        for r, first, walked in walk_answers(starts.cpu(), runs.cpu(), objective.steps):
                            walk = [x + y for x, y in zip(walk, walked)]
                            j = slot.get(rows[r][int(docs[r, first])])
                            if j is not None:  # an answer of a measured sample (doc d of row r is rows[r][d])
                                per_sample[j, 0] += walked[0]
                                per_sample[j, 1] += walked[1]
                    if time.perf_counter() - last >= log_every_s and ranks.rank == 0:
                        last = time.perf_counter()
                        say(f"validation: {j + 1}/{len(self.batches)} micro-batches, {last - t0:.0f}s")
        finally:
            objective.train()
            objective.keep_runs, objective.runs = False, None
        if stats is None:  # no batch on any rank (an empty split never gets here)
            stats = torch.zeros(objective.steps, 5, dtype=torch.float64, device=device)
        walked = torch.tensor(walk, dtype=torch.float64, device=device)
        per_sample = per_sample.to(device)
        if ranks.world > 1:
            dist.all_reduce(stats)
            dist.all_reduce(walked)
            dist.all_reduce(per_sample)
        out = figures(stats.tolist(), walked.tolist(), [tuple(x) for x in per_sample.tolist()])
        out.update(samples=len(self.measured), tokens=self.tokens, seconds=round(time.perf_counter() - t0, 3))
        return out
