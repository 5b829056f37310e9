"""Run `speculators train` (speculators 0.9.0) with a CPU-only torch.

    python bench/peer/train_cpu.py <the arguments of `speculators train`>

speculators' Trainer is written for an accelerator and trips over its absence in three places;
this script patches exactly those, at run time, and leaves the training itself stock:

1. Device. The Trainer places the model and every batch on `get_local_rank()`, the integer 0,
   which torch reads as `cuda:0`. It is patched to return "cpu".
2. Autocast. The Trainer takes its autocast device type from `torch.accelerator`, falling back to
   "cuda" when there is none; a "cuda" autocast on a CPU build is disabled with a warning, so the
   step would silently run in float32 instead of the `--hidden-states-dtype` (bfloat16 by
   default) that speculators autocasts to on an accelerator. It is set to "cpu" right before
   `setup_trainer`, so the CPU autocast uses the same dtype.
3. Step timer. Every profiled step calls `torch.accelerator.synchronize()`, which has nothing to
   synchronise on a CPU build; CPU kernels are synchronous, so it becomes a no-op.

One observer is added, changing nothing: when PEER_METRICS_JSONL names a file, each metrics record
that speculators logs (a dict per step: loss, epoch, global_step, profile with tokens/s and step
milliseconds; one per validation) is appended to it as a JSON line with a wall-clock time `t`.
speculators itself only prints them, formatted, to the console.

Env: TORCH_THREADS (intra-op threads; default: all cores), PEER_METRICS_JSONL.
A wall-clock limit is the caller's: SIGTERM makes speculators' own graceful-shutdown handler save
the current weights to `<save-path>/interrupted/` and return.
"""

import json
import logging
import os
import sys
import time

import torch

torch.set_num_threads(int(os.environ.get("TORCH_THREADS", os.cpu_count() or 1)))

# (3) the step timer's synchronize: nothing to wait for on the CPU
if not torch.accelerator.is_available():
    torch.accelerator.synchronize = lambda *args, **kwargs: None

import speculators.train.cli as train_cli  # noqa: E402  (after the torch patch, which it imports)
import speculators.train.trainer as trainer_mod  # noqa: E402

# (1) model and batches on the CPU instead of local rank 0 (= cuda:0)
trainer_mod.get_local_rank = lambda: "cpu"

# (2) autocast on the CPU with the configured dtype instead of a disabled "cuda" autocast
_stock_setup_trainer = trainer_mod.Trainer.setup_trainer


def _setup_trainer_on_cpu(self):
    self.device_type = "cpu"
    return _stock_setup_trainer(self)


trainer_mod.Trainer.setup_trainer = _setup_trainer_on_cpu


class _JsonlMetrics(logging.Handler):
    """Appends speculators' metric dicts to a JSONL file (observation only)."""

    def __init__(self, path: str):
        super().__init__()
        self._file = open(path, "a", buffering=1)  # line-buffered: readable while training runs

    def emit(self, record: logging.LogRecord) -> None:
        # Skip the run-config record (hparams); keep per-step train and per-epoch val records.
        # This handler sits on "speculators.metrics" itself, so it sees the dict before the
        # console handler's filter formats it into a string.
        if isinstance(record.msg, dict) and ("train" in record.msg or "val" in record.msg):
            self._file.write(json.dumps({"t": time.time(), **record.msg}, default=str) + "\n")


_stock_setup_metric_logger = train_cli.setup_metric_logger


def _setup_metric_logger_with_jsonl(*args, **kwargs):
    # speculators configures its metric loggers with dictConfig, which would drop a handler
    # attached earlier, so ours is attached right after.
    _stock_setup_metric_logger(*args, **kwargs)
    path = os.environ.get("PEER_METRICS_JSONL")
    if path:
        logging.getLogger("speculators.metrics").addHandler(_JsonlMetrics(path))


train_cli.setup_metric_logger = _setup_metric_logger_with_jsonl

if __name__ == "__main__":  # dataloader workers are spawned and re-import this file: train only here
    from speculators.train.config import TrainConfig

    train_cli.main(TrainConfig.resolve(sys.argv[1:]))
