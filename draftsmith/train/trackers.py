"""Where a training run's figures go besides metrics.jsonl: the experiment trackers a team already uses.

train.report_to lists them: `tensorboard` (RUN/train/tb), `wandb` (Weights & Biases), `mlflow`, `trackio` (the Hub's
local-first one). Each is imported only when asked for (the `wandb`, `mlflow`, `trackio` extras install them) and
configured the way its users configure it: its own environment (WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE=offline,
MLFLOW_TRACKING_URI, TRACKIO_DIR, ...), the project train.tracker_project, the run named after the run directory.

From rank 0 only: the run's resolved config once, then per log interval the figures of the train line (loss and
accuracy per step, the acceptance length and per position, tokens/s, lr, grad norm) and each validation pass's
(under `validation/`), at the optimizer step they belong to. A restarted run goes on in the same tracker run: each
tracker's run id is kept in RUN/train/trackers.json. A tracker that fails (not installed, no login, the network down,
a call raising mid-run) is one warning line and is dropped; training goes on and loses no step.

No silent wait: every tracker call (start, log, close) runs with a bound, `DRAFTSMITH_TRACKER_WAIT_S` (30 s): past 5 s
the log says it is waiting and for what, past the bound the tracker is dropped with a line (an unreachable MLflow
server held training 4 minutes in its retries, W&B with a key and no network 91 s); a tracker whose folder cannot be
written (trackio) is dropped at start instead of saying "reporting" and losing every figure. metrics.jsonl keeps the
figures whatever the trackers do.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import queue
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from draftsmith.bounds import env_number
from draftsmith.redact import redact_tree
from draftsmith.rundir import atomic_write_json

STATE = "trackers.json"
NAMES = ("tensorboard", "wandb", "mlflow", "trackio")
SAY_WAITING_S = 5.0  # a tracker call longer than this is said to be waiting


def wait_bound_s() -> float:
    """The longest one tracker call may hold training (module doc)."""
    return env_number("DRAFTSMITH_TRACKER_WAIT_S", 30.0, 0.1, 3600.0)


def scalars(metrics: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a metrics.jsonl row as flat tracker keys: `loss/step0`, `acc/step1`,
    `acceptance_per_position/1`, `acceptance_length`, `lr`, ...; under `prefix` (a validation row's `validation/`)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key in ("step", "total_steps", "split", "step_time_s", "position_mean"):
            continue
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out[prefix + key] = float(value)
        elif isinstance(value, list):
            name = "step" if key in ("loss", "acc") else ""
            for k, v in enumerate(value):
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[f"{prefix}{key}/{name}{k}"] = float(v)
    return out


class Worker:
    """The one thread that makes every call of one tracker (mlflow and trackio keep their active run per thread), each
    call waited for at most wait_bound_s() (module doc). A daemon: a call that never returns (a library's network
    retry cannot be interrupted) holds neither training nor the process's exit."""

    def __init__(self, name: str, say: Callable[[str], None]):
        self.name, self.say = name, say
        self.calls: queue.Queue = queue.Queue()
        threading.Thread(target=self._serve, daemon=True, name=f"tracker {name}").start()

    def _serve(self) -> None:
        while True:
            fn, done, box = self.calls.get()
            try:
                box["value"] = fn()
            except BaseException as e:  # handed to the caller
                box["error"] = e
            done.set()

    def call(self, fn: Callable[[], Any]) -> Any:
        """fn()'s result on this tracker's thread, or TimeoutError past the bound; past SAY_WAITING_S a line says
        it is waiting."""
        bound, done, box = wait_bound_s(), threading.Event(), {}
        out, err = sys.stdout, sys.stderr
        t0 = time.monotonic()
        self.calls.put((fn, done, box))
        if not done.wait(min(SAY_WAITING_S, bound)):
            held, (sys.stdout, sys.stderr) = (sys.stdout, sys.stderr), (out, err)  # past the call's _quiet()
            self.say(f"train.report_to {self.name}: waiting for it (at most {bound:.0f} s, DRAFTSMITH_TRACKER_WAIT_S)")
            sys.stdout, sys.stderr = held
            done.wait(max(0.0, bound - (time.monotonic() - t0)))
        if not done.is_set():
            sys.stdout, sys.stderr = out, err  # the call may hold _quiet()'s redirection: training's lines are not its
            raise TimeoutError(f"no answer in {bound:.0f} s")
        if "error" in box:
            raise box["error"]
        return box.get("value")


@contextlib.contextmanager
def _quiet():
    """Trackers print banners and hints on stdout and through logging; draftsmith's log says what matters.

    Gotcha: this runs on a Worker's thread, and a call Worker.call gave up on can end minutes later (mlflow's
    retries). By then the streams were handed back and may since have been replaced (pytest's per-test capture,
    which it closes after the test): putting back the streams seen at entry would leave a closed file as
    sys.stdout. So a stream is put back only while it is still this call's sink."""
    sink_out, sink_err = io.StringIO(), io.StringIO()
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = sink_out, sink_err
    try:
        yield
    finally:
        if sys.stdout is sink_out:
            sys.stdout = out
        if sys.stderr is sink_err:
            sys.stderr = err


class TensorBoard:
    def start(self, folder: Path, project: str, run_name: str, config: dict, resume: dict | None,
              start_step: int) -> dict:
        from torch.utils.tensorboard import SummaryWriter  # only when asked for (tensorboard: the dev extra)

        self.w = SummaryWriter(str(folder / "tb"), purge_step=start_step + 1)
        self.w.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```", start_step)
        return {"logdir": "tb"}

    def log(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.w.add_scalar(k, v, step)
        self.w.flush()

    def close(self) -> None:
        self.w.close()


class WandB:
    def start(self, folder, project, run_name, config, resume, start_step) -> dict:
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb  # only when asked for (the wandb extra)

        run_id = (resume or {}).get("id") or uuid.uuid4().hex[:8]  # W&B's own shape of id: 8 lowercase hex
        argv, sys.argv = sys.argv, redact_tree(sys.argv)  # W&B records the command line (its `args`) as it reads it
        try:
            with _quiet():
                self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", project), name=run_name, id=run_id,
                                      resume="allow", config=config, dir=os.environ.get("WANDB_DIR", str(folder)),
                                      settings=wandb.Settings(init_timeout=wait_bound_s()))
        finally:
            sys.argv = argv
        return {"id": run_id}

    def log(self, step, values) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        with _quiet():
            self.run.finish()


class MLflow:
    def start(self, folder, project, run_name, config, resume, start_step) -> dict:
        # a server that does not answer: a few short tries, not mlflow's default 7 retries of up to 2 minutes each
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        import mlflow  # only when asked for (the mlflow extra)

        logging.getLogger("mlflow").setLevel(logging.ERROR)
        self.mlflow = mlflow
        with _quiet():
            mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", project))
            if resume and resume.get("run_id"):
                self.run = mlflow.start_run(run_id=resume["run_id"])
            else:
                self.run = mlflow.start_run(run_name=run_name)
                mlflow.log_params(_flat(config))
        return {"run_id": self.run.info.run_id}

    def log(self, step, values) -> None:
        self.mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        with _quiet():
            self.mlflow.end_run()


class Trackio:
    def start(self, folder, project, run_name, config, resume, start_step) -> dict:
        import trackio  # only when asked for (the trackio extra)

        # trackio writes from a thread of its own and loses every figure silently when its folder cannot be written
        home = Path(os.environ.get("TRACKIO_DIR") or Path.home() / ".cache" / "huggingface" / "trackio")
        home.mkdir(parents=True, exist_ok=True)
        probe = home / f".draftsmith-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        self.trackio = trackio
        with _quiet():
            self.run = trackio.init(project=project, name=run_name, config=config, resume="allow",
                                    auto_log_cpu=False, auto_log_gpu=False)
        return {"project": project, "name": run_name}

    def log(self, step, values) -> None:
        with _quiet():
            self.trackio.log(values, step=step)

    def close(self) -> None:
        with _quiet():
            self.trackio.finish()


BACKENDS: dict[str, Callable[[], Any]] = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow,
                                          "trackio": Trackio}


def _flat(config: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow's params: `train.lr` -> "0.002" (values cut to its 500 characters)."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)[:500]
    return out


class Trackers:
    """The trackers of a run on rank 0 (module doc); on the other ranks, and with none asked for, it does nothing."""

    def __init__(self, folder: Path, names: list[str], project: str, config: dict, start_step: int, rank: int,
                 say: Callable[[str], None]):
        self.folder, self.say = folder, say
        self.active: dict[str, Any] = {}
        self.workers: dict[str, Worker] = {}
        if rank != 0 or not names:
            return
        state = self._state()
        config = redact_tree(config)  # the trackers' files are published as they are: no secret of the config
        for name in names:
            tracker, self.workers[name] = BACKENDS[name](), Worker(name, say)
            try:
                state[name] = self.workers[name].call(lambda: tracker.start(  # noqa: B023
                    folder, project, folder.parent.name, config, state.get(name), start_step))
            except Exception as e:  # not installed, no login, no network: training goes on without it
                self._drop(name, "cannot start", e)
                continue
            self.active[name] = tracker
        if self.active:
            atomic_write_json(folder / STATE, state)
            say(f"reporting to {', '.join(self.active)} (run ids in {folder / STATE})")

    def _state(self) -> dict:
        try:
            state = json.loads((self.folder / STATE).read_text())
        except (OSError, ValueError):
            return {}
        return state if isinstance(state, dict) else {}

    def _drop(self, name: str, what: str, e: BaseException) -> None:
        self.active.pop(name, None)
        self.say(f"warning: train.report_to {name}: {what} ({type(e).__name__}: {' '.join(str(e).split())[:200]}); "
                 "training goes on without it")

    def log(self, step: int, metrics: dict, prefix: str = "") -> None:
        values = scalars(metrics, prefix)
        for name, tracker in list(self.active.items()):
            try:
                self.workers[name].call(lambda: tracker.log(step, values))  # noqa: B023
            except Exception as e:
                self._drop(name, "a call failed", e)

    def close(self) -> None:
        for name, tracker in list(self.active.items()):
            try:
                self.workers[name].call(tracker.close)
            except Exception as e:
                self._drop(name, "cannot close", e)
        self.active.clear()
