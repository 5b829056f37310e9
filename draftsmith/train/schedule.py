"""How fast and for how long: the optimizer (AdamW, or Muon beside AdamW), the learning-rate schedule
(linear warm-up, then cosine or warm-up-stable-decay), the weights' moving average (train.ema), and
train.max_minutes' time budget (TimeBudget)."""

import math
import time
from dataclasses import dataclass

import torch

from draftsmith import DraftsmithError

ADAM_BETAS = (0.9, 0.95)


# Muon's step is scaled per matrix to the RMS of an AdamW step (Moonshot, "Muon is Scalable", arXiv:2502.16982), so
# that one train.lr serves both groups, as the peer toolkit (speculators) runs it
MUON_ADJUST_LR = "match_rms_adamw"


def muon_eligible(name: str, p: torch.Tensor) -> bool:
    """Whether Muon updates parameter `name`: a trainable matrix of at least 2 x 2 other than the LM head
    (orthogonalising a [vocabulary, H] head's update throws away the per-token scale it learns). The rest
    (norms, the 1-D or 3-D parameters, the head) go to AdamW."""
    return p.requires_grad and p.ndim == 2 and min(p.shape) > 1 and "lm_head" not in name


class MuonAdamW(torch.optim.Optimizer):
    """torch's own Muon (momentum 0.95, Nesterov, 5 Newton-Schulz steps) on the matrices, torch's AdamW on
    everything else, as one optimizer: one set of param groups for the schedule to scale, one state (keyed by
    parameter; the two never share one) for checkpoints and train.ema.

    Why one object: checkpoints, the scheduler and the moving average all take a single optimizer. The two
    inner optimizers keep their own step code; this class hands them their groups and one state dict, and
    points them at the new ones after load_state_dict (which replaces both)."""

    def __init__(self, named: list, lr: float, weight_decay: float, fused: bool) -> None:
        muon = [p for n, p in named if muon_eligible(n, p)]
        adam = [p for n, p in named if not muon_eligible(n, p)]
        if not muon:
            raise ValueError("train.optimizer=muon: the drafter has no trainable matrix for Muon")
        groups = [{"params": muon, "algo": "muon"}] + ([{"params": adam, "algo": "adamw"}] if adam else [])
        super().__init__(groups, {"lr": lr})
        self._muon = torch.optim.Muon(groups[:1], lr=lr, weight_decay=weight_decay, adjust_lr_fn=MUON_ADJUST_LR)
        self._adamw = (torch.optim.AdamW(groups[1:], lr=lr, betas=ADAM_BETAS, weight_decay=weight_decay, fused=fused)
                       if adam else None)
        self._share()

    def _share(self) -> None:
        """Point the inner optimizers at this one's groups (the same dicts: the schedule's lr reaches them) and
        its state."""
        self._muon.param_groups = [g for g in self.param_groups if g["algo"] == "muon"]
        self._muon.state = self.state
        if self._adamw is not None:
            self._adamw.param_groups = [g for g in self.param_groups if g["algo"] == "adamw"]
            self._adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._share()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._muon.step()
        if self._adamw is not None:
            self._adamw.step()
        return loss


def make_optimizer(named: list, tc, fused: bool) -> torch.optim.Optimizer:
    """The optimizer of train.optimizer over `named` [(name, parameter)], the trainable parameters."""
    if tc.optimizer == "muon":
        if not hasattr(torch.optim, "Muon"):
            raise DraftsmithError(f"train.optimizer: muon needs torch >= 2.9 (torch.optim.Muon); this is "
                                  f"{torch.__version__}")
        return MuonAdamW(named, lr=tc.lr, weight_decay=tc.weight_decay, fused=fused)
    return torch.optim.AdamW([p for _, p in named], lr=tc.lr, betas=ADAM_BETAS, weight_decay=tc.weight_decay,
                             fused=fused)


EMA_KEY = "ema"  # the average's entry in each parameter's optimizer state: saved, sharded and restored with it


def ema_decay(ema: float, step: int) -> float:
    """The average's decay after optimizer step `step` (1-based): ramped in, so that the first steps
    are not averaged with the initial weights for long."""
    return min(ema, (1 + step) / (10 + step))


@torch.no_grad()
def update_ema(optimizer, params: list, ema: float, step: int) -> None:
    """After optimizer step `step`: each parameter's average moves towards it (created as a copy at
    the first update). Kept in the optimizer's per-parameter state, so checkpoints save and resume
    it (and FSDP shards it) as they do the Adam moments."""
    decay = ema_decay(ema, step)
    for p in params:
        st = optimizer.state[p]
        if EMA_KEY not in st:
            st[EMA_KEY] = p.detach().clone()
        else:
            st[EMA_KEY].lerp_(p.detach(), 1.0 - decay)


@torch.no_grad()
def load_ema(optimizer, params: list) -> None:
    """Copy each parameter's average into it (for final/: the weights that get exported)."""
    for p in params:
        st = optimizer.state.get(p, {})
        if EMA_KEY in st:
            p.copy_(st[EMA_KEY])


def lr_lambda(warmup: int, total: int, min_ratio: float, time_share=None, schedule: str = "cosine",
              cooldown: float = 0.2):
    """LR multiplier at optimizer step s (0-based): linear warm-up, then `cosine` to min_ratio, or
    `wsd`: 1 until the last `cooldown` share of the run after warm-up, then linearly to min_ratio.

    `time_share()`, when given, returns the share of a time budget spent (0..1); the decay then
    follows whichever of steps and time is further along.
    """
    def f(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        progress = min(1.0, (s - warmup) / max(1, total - warmup))
        if time_share is not None:
            progress = max(progress, min(1.0, time_share()))
        if schedule == "wsd":
            if cooldown <= 0 or progress < 1 - cooldown:
                return 1.0
            return 1 - (1 - min_ratio) * (progress - (1 - cooldown)) / cooldown
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


@dataclass
class TimeBudget:
    """train.max_minutes: seconds of training steps, summed over attempts (a resumed run goes on
    from its checkpoint's `train_s`). Rank 0's clock decides: once per step its reading is shared
    with every rank (`clock_s`), so that all ranks take the same learning rate and stop at the
    same step.

    The time share counts from the end of warm-up, as the step share does: at a steady pace that
    ends the steps inside the budget the clock never leads, and the schedule is the step-count one.
    """

    budget_s: float | None  # None: no budget
    warmup_steps: int = 0  # train.warmup_steps: the share of time counts from the end of the last of them
    done_s: float = 0.0  # seconds of steps in earlier attempts
    warmup_end_s: float | None = None  # the shared clock when warm-up ended; None until then
    clock_s: float = 0.0  # rank 0's seconds of steps, as shared at the last step
    loop_t0: float = 0.0  # perf_counter() when this attempt's loop began (start())

    @classmethod
    def resume(cls, tc, state: dict) -> "TimeBudget":
        """The budget of train config `tc`, going on from a checkpoint's state.json ({} if none)."""
        done = float(state.get("train_s", 0.0))
        return cls(budget_s=None if tc.max_minutes is None else tc.max_minutes * 60.0, warmup_steps=tc.warmup_steps,
                   done_s=done, warmup_end_s=state.get("warmup_end_s", 0.0 if tc.warmup_steps == 0 else None),
                   clock_s=done)

    def start(self) -> None:
        self.loop_t0 = time.perf_counter()

    def stepped(self, step: int) -> None:
        """After optimizer step `step` (0-based), before the scheduler computes the next rate: the shared clock at
        the end of warm-up is kept."""
        if step + 1 == self.warmup_steps:
            self.warmup_end_s = self.clock_s

    def trained_s(self) -> float:
        """This rank's seconds of training steps so far, earlier attempts included."""
        return self.done_s + time.perf_counter() - self.loop_t0

    def share(self) -> float:
        """The share of the budget after warm-up that the shared clock has spent (0 during warm-up)."""
        if self.warmup_end_s is None:
            return 0.0
        left = self.budget_s - self.warmup_end_s
        return 1.0 if left <= 0 else (self.clock_s - self.warmup_end_s) / left

    def should_stop(self, now_s: float, steps: int) -> bool:
        """Rank 0's decision before a step, at its clock `now_s` after `steps` steps of this attempt:
        make this step the last when the next would not fit, by the mean step time so far (a
        resume whose checkpoint already spent the budget still takes one step)."""
        if self.budget_s is None:
            return False
        step_s = (now_s - self.done_s) / steps if steps > 0 else 0.0
        return now_s + 2 * step_s > self.budget_s or now_s >= self.budget_s

    def left_s(self) -> float:
        """Seconds of the budget the shared clock has left."""
        return max(0.0, self.budget_s - self.clock_s)


def make_scheduler(optimizer, tc, total_steps: int, budget: TimeBudget) -> torch.optim.lr_scheduler.LambdaLR:
    share = None if budget.budget_s is None else budget.share
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(tc.warmup_steps, total_steps, tc.min_lr_ratio, share,
                                                                  tc.lr_schedule, tc.cooldown_share))
