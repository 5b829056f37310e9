"""What a run shows while it trains, once per log interval (train.log_every_s): a line of
metrics.jsonl, the same figures to the experiment trackers of train.report_to (trackers.py), and the step line in
the log;
all summing up the window of steps since the previous one. After each validation pass
(train/validation.py), a row of its own in metrics.jsonl (`"split": "validation"`) and a log line; the
step line shows the last validation figure beside the training one.

The training tau is the chain acceptance (objective.chain_acceptance) on the batches being fitted: it runs
ahead of what the drafter does on unseen answers; the validation tau is the one that predicts serving."""

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from draftsmith.acceptance import fmt as fmt_tau
from draftsmith.journal import fmt_duration
from draftsmith.rundir import append_text, atomic_write_text
from draftsmith.train.objective import chain_acceptance

METRICS = "metrics.jsonl"
STEP_PARTS = ("data", "forward", "backward", "optimizer")  # where a step's time goes


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _json_step(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def trim_metrics(path: Path, last_step: int) -> None:
    """Drop the lines past the checkpoint a run resumes from (step `last_step`), so that the
    file's steps stay increasing and unique."""
    if path.exists():
        keep = [ln for ln in path.read_text().splitlines()
                if ln.strip() and _json_step(ln) is not None and _json_step(ln) <= last_step]
        atomic_write_text(path, "".join(ln + "\n" for ln in keep))


class Window:
    """The steps since the last log line, on every rank: TTT statistics, seconds per part of a
    step, tokens and steps; on rank 0 also where the lines go (`folder`: train/)."""

    def __init__(self, folder: Path, interval_s: float, steps: int, rank: int, device, start_step: int, say,
                 trackers=None):
        self.interval_s, self.rank, self.say = interval_s, rank, say  # interval_s: train.log_every_s
        self.metrics_path = folder / METRICS
        self.trackers = trackers
        if rank == 0:
            trim_metrics(self.metrics_path, start_step)
        # per draft step (`steps`: the objective's, TTT steps or a block's slots): KL sum (nats), valid positions,
        # correct drafts, loss-masked positions, chain (drafts 0..k all right); on the device, summed there every
        # micro-batch and read only at log time (summary)
        self.stats = torch.zeros(steps, 5, dtype=torch.float64, device=device)
        self._read: list | None = None
        self.reset()

    def reset(self) -> None:
        self.stats.zero_()
        self.times = dict.fromkeys(STEP_PARTS, 0.0)  # seconds
        self.tokens, self.steps = 0, 0
        self.t0 = time.perf_counter()
        self.last_log = time.time()

    def due(self, step: int, total_steps: int, last: bool) -> bool:
        """Rank 0: log after step `step` (0-based)? Every train.log_every_s, at the last step, and
        when the time budget makes this step the last (`last`)."""
        return time.time() - self.last_log >= self.interval_s or step + 1 == total_steps or last

    def summary(self, world: int) -> tuple[list[float | None], list[float | None], float]:
        """(loss per TTT step in nats, accuracy per TTT step, seconds of the window) over all ranks
        (every rank must call it); None for a step without positions (JSON has no NaN)."""
        if world > 1:
            dist.all_reduce(self.stats)
        # the window's statistics accumulate on the device (no read per step); this is their one read
        s = self._read = self.stats.tolist()
        loss_k = [kl / n if n > 0 else None for kl, n, _, _, _ in s]
        acc_k = [c / m if m > 0 else None for _, _, c, m, _ in s]
        return loss_k, acc_k, time.perf_counter() - self.t0

    def chain(self) -> tuple[float | None, list[float | None]]:
        """The window's chain acceptance (acceptance length, per position), from the statistics summary read."""
        s = self._read or []
        return chain_acceptance([row[4] for row in s], s[0][3] if s else 0.0)

    def write(self, metrics: dict, eta_s: float, validation: dict | None = None) -> None:
        """Rank 0: the metrics line, the trackers' scalars, the step line in the log (with the last validation
        pass's tau when there is one)."""
        step, loss_k, acc_k = metrics["step"], metrics["loss"], metrics["acc"]
        append_text(self.metrics_path, json.dumps(metrics) + "\n")
        if self.trackers is not None:
            self.trackers.log(step, metrics)
        tau = metrics["acceptance_length"]
        val = validation or {}
        self.say(f"step {step}/{metrics['total_steps']} | loss " + " ".join(_fmt(x, ".3f") for x in loss_k)
                 + " nats | acc " + " ".join(_fmt(x, ".1%") for x in acc_k)
                 + f" | tau train {_fmt(tau, '.2f')}"
                 + (f", val {val['acceptance_length']:.2f} (step {val['step']})"
                    if val.get("acceptance_length") is not None else "")
                 + f" | {metrics['tokens_per_s']:,.0f} tok/s | lr {metrics['lr']:.2e} "
                   f"| gnorm {metrics['grad_norm']:.2f}"
                 + f" | ETA {fmt_duration(eta_s)}")

    @staticmethod
    def write_validation(folder: Path, row: dict, say, trackers=None) -> None:
        """Rank 0: a validation pass's row in metrics.jsonl and the trackers, and its line in the log."""
        append_text(folder / METRICS, json.dumps({"split": "validation", **row}) + "\n")
        if trackers is not None:
            trackers.log(row["step"], row, prefix="validation/")
        tau, per_pos = row["acceptance_length"], row["acceptance_per_position"]
        say(f"validation at step {row['step']}: tau {fmt_tau(tau, row.get('acceptance_length_se'), '.3f')} "
            f"(acceptance per position {' '.join(_fmt(a, '.3f') for a in per_pos)}) over "
            f"{row['samples']} held-out samples, {row['positions']:,} drafting positions; loss "
            + " ".join(_fmt(x, ".3f") for x in row["loss"]) + f" nats; {row['seconds']:.1f}s")
