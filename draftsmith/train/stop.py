"""SIGTERM and SIGINT while the training loop runs: a stop at the end of the step in progress.

A preemption (SLURM, Kubernetes) sends SIGTERM and waits a grace period before SIGKILL. Raising at
once, wherever the signal lands, would lose every step since the last checkpoint (up to
train.checkpoint_every - 1 of them). Instead the signal is noted; the loop finishes its step, every
rank learns of it in the step's one all-reduce (a rank cannot save alone: FSDP gathers shards
across ranks), all save a checkpoint of that step, and then the stage raises what the signal would
have raised (SIGTERM: Terminated, exit 143; SIGINT: KeyboardInterrupt, exit 130). A second signal
changes nothing (torchrun forwards a Ctrl-C as SIGTERM to ranks that already had the SIGINT);
SIGKILL still stops at once.
"""

from __future__ import annotations

import signal
import threading
from typing import Callable

from draftsmith import Terminated

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class DeferredStop:
    """Within the context, SIGTERM/SIGINT are noted (`requested`), not raised; `raise_now()` raises
    what the first one would have. Outside the main thread (where handlers cannot be set) a no-op."""

    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _note(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            self.say(f"{signal.Signals(signum).name}: stopping after this step, with a checkpoint of it")

    def __enter__(self) -> "DeferredStop":
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._note)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def raise_now(self) -> None:
        """Raise as the noted signal would have: through the handler that was there before (the CLI's
        SIGTERM handler records that it was a SIGTERM, for exit 143), else Terminated / KeyboardInterrupt."""
        handler = self._previous.get(self.signum)
        self.__exit__()
        if callable(handler):
            handler(self.signum, None)
        raise Terminated() if self.signum == signal.SIGTERM else KeyboardInterrupt()
