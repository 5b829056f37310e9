"""train.processes = N > 1 outside torchrun: the train stage runs itself as N local ranks under
torchrun (DDP, gloo on the CPU) and hands back the manifest rank 0 writes.

Why on a CPU: two single-threaded ranks keep both cores busy through the whole step, where one
process with two threads leaves one idle in every small or sequential op (measured here: ~930
against ~700 tokens/s). Each rank gets its share of the cores other work leaves free now
(host.threads_per_rank), or `threads`, unless OMP_NUM_THREADS is set.
"""

import contextlib
import os
import subprocess
import sys
import tempfile
import time

import torch

from draftsmith import DraftsmithError
from draftsmith.journal import pid_alive
from draftsmith.progress import log
from draftsmith.rundir import RunDir
from draftsmith.host import pick_device, threads_per_rank
from draftsmith.train.distributed import COLLECTIVE_TIMEOUT
from draftsmith.vllm_server import die_with_parent

ERROR_PREFIX = "draftsmith: error: "  # how a rank's one-line error starts on its output
RANK_CONFIG_PREFIX = ".train-ranks-"  # RUN/.train-ranks-<launcher pid>-<random>.yaml: the config the ranks read
# How long the ranks may take, after a stop signal, to end their step and write its checkpoint before torchrun (and
# this launcher) kill them. torchrun's own grace is 30 s: at Kimi-K2.5's widths a step plus an ~11 GB checkpoint
# takes longer, and the SIGKILL lost every step since the last checkpoint without a word. Whoever sent the signal
# keeps the real limit (a scheduler's SIGKILL after its grace period); ours is the collectives' own timeout.
STOP_GRACE_S = int(COLLECTIVE_TIMEOUT.total_seconds())


def remove_stale_rank_configs(run: RunDir) -> None:
    """The ranks' config files of launchers that are gone (a SIGKILL leaves its file behind): removed at the next
    start, so that a run holds none but a live launcher's."""
    for path in run.path.glob(f"{RANK_CONFIG_PREFIX}*.yaml"):
        pid = path.name[len(RANK_CONFIG_PREFIX):].split("-", 1)[0]
        if not (pid.isdigit() and pid_alive(int(pid))) or int(pid) == os.getpid():
            with contextlib.suppress(OSError):
                path.unlink()


def launches(cfg) -> bool:
    """Whether this process starts the ranks itself: train.processes > 1 and not already a rank of a torchrun."""
    return cfg.train.processes > 1 and "WORLD_SIZE" not in os.environ


def launch_ranks(run, cfg, stage: str) -> dict:
    """Run stage `stage` (train) as cfg.train.processes local ranks under torchrun; returns the
    manifest rank 0 wrote. A rank's one-line error is raised as ours."""
    rd = run if isinstance(run, RunDir) else RunDir(run)
    n = cfg.train.processes
    device = pick_device(cfg.device)
    if device.type == "cuda" and n > torch.cuda.device_count():
        raise DraftsmithError(f"train.processes: {n} ranks need {n} GPUs, this node has {torch.cuda.device_count()}")
    env = dict(os.environ)
    remove_stale_rank_configs(rd)
    # torchrun would set OMP_NUM_THREADS=1 itself; each rank gets its share of the free cores instead
    env.setdefault("OMP_NUM_THREADS", str(threads_per_rank(cfg.threads, n)[0]))
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(STOP_GRACE_S))
    # the ranks read the resolved config from a file: --set overrides are already applied in it
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix=f"{RANK_CONFIG_PREFIX}{os.getpid()}-", dir=rd.path,
                                     delete=False) as f:
        f.write(cfg.to_yaml())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           "-m", "draftsmith", "--", stage, "--run", str(rd.path), "--config", f.name]
    log(f"{n} ranks under torchrun, {env['OMP_NUM_THREADS']} thread(s) each", stage=stage)
    # torchrun dies with us (PR_SET_PDEATHSIG) and takes its ranks with it
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=die_with_parent)
    errors: list[str] = []
    try:
        rc = _forward(proc, errors)
    except BaseException:
        # A stop signal: torchrun passes it on to the ranks, which end their step and write its checkpoint; their
        # lines ("checkpoint of step N written") still go on, and a full pipe would block them. A second signal
        # here stops waiting (torchrun gets SIGTERM again as we die).
        proc.terminate()
        try:
            _forward(proc, errors, timeout_s=STOP_GRACE_S + 60)  # torchrun's grace, then its SIGKILL of the ranks
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(f.name)
    if rc != 0:
        raise DraftsmithError(errors[0] if errors else f"train: {n} ranks under torchrun exited with status "
                                                       f"{rc} (see {rd.path / stage / 'stage.log'})")
    manifest = rd.read_manifest(stage)
    if manifest is None:
        raise DraftsmithError(f"train: the ranks exited without writing {rd.path / stage / 'manifest.json'}")
    return manifest


def _forward(proc: subprocess.Popen, errors: list[str], timeout_s: float | None = None) -> int:
    """Rank 0's lines (the log) on to our stdout until torchrun ends, the ranks' final summary print left for us
    to make; a rank's one-line error appended to `errors`. torchrun's exit status."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for line in proc.stdout:
        if line.startswith(ERROR_PREFIX):
            errors.append(line.strip()[len(ERROR_PREFIX):])  # the first is the first rank's, one line
        if not line.startswith("trained "):
            with contextlib.suppress(OSError, ValueError):  # our stdout gone (`| head`): the ranks still drain
                print(line, end="", flush=True)
        if deadline is not None and time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(proc.args, timeout_s)
    return proc.wait(timeout=None if deadline is None else max(1.0, deadline - time.monotonic()))
