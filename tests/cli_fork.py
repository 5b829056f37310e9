"""`python -m draftsmith ARGS` in a fresh process without paying its imports each time.

A CLI call that computes imports torch, transformers and the stage (~3 s here, most of a bad-input
test). The suite makes ~150 such calls, so a zygote process imports all of that once per session and
forks one child per call: the child sets the call's environment, folder, argv and stdio, runs
draftsmith/__main__.py as `python -m` does, runs the exit handlers and exits with the CLI's code. It is
still one process per call, started from a state no call has touched.

What a fork cannot give is taken to a real `python -m draftsmith` instead (run_cli decides): an
environment other than the zygote's (the libraries read some variables at import time), any
subprocess.run keyword but cwd, and a call made while another is in flight. What importing printed
is checked once: the zygote refuses to start if its imports wrote anything (a library warning every
real call would show).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from draftsmith.stages import REGISTRY

# The modules a CLI command imports when it computes (each stage's, by its record, the pipeline, the demo).
PRELOAD = ("draftsmith.cli", *(s.module for s in REGISTRY.values()), "draftsmith.pipeline",
           "draftsmith.demo")

# The zygote: imports PRELOAD, says "ready", then one JSON request per line on stdin -> forks a child
# for it, writes {"pid"} at once and {"status"} (a waitpid status) when the child ends.
ZYGOTE = r"""
import importlib, json, os, runpy, sys
for m in sys.argv[1:]:
    importlib.import_module(m)
ctl_in, ctl_out = sys.stdin.buffer, os.fdopen(os.dup(1), "w", buffering=1)
ctl_out.write("ready\n")

def child(req):
    import atexit
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(os.open(req["out"], os.O_WRONLY | os.O_TRUNC), 1)
    os.dup2(os.open(req["err"], os.O_WRONLY | os.O_TRUNC), 2)
    ctl_out.close()  # the zygote's reply pipe: the call must not hold it (its stdin and stderr pipes are replaced above)
    sys.argv = ["-m", *req["argv"]]
    code = 0
    try:
        runpy.run_module("draftsmith", run_name="__main__", alter_sys=True)
    except SystemExit as e:  # as the interpreter ends: an int is the code, None 0, anything else printed and 1
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)

for line in ctl_in:
    req = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        child(req)
    ctl_out.write(json.dumps({"pid": pid}) + "\n")
    ctl_out.write(json.dumps({"status": os.waitpid(pid, 0)[1]}) + "\n")
"""


class Zygote:
    def __init__(self, cwd: Path, env: dict):
        self.env = dict(env)
        self.lock = threading.Lock()
        # bufsize=0: the reply pipe is read without a buffer (a raw file's readline takes a byte at a time), so a
        # reply already read can never sit in a buffer while select() waits on the pipe for it: a call that ended
        # at once (its pid and status lines written together) stalled the whole timeout, then signalled a reaped pid
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE, *PRELOAD], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=self.env,
                                     bufsize=0)
        ready = self.proc.stdout.readline()
        if ready != b"ready\n":
            raise RuntimeError(f"the CLI zygote did not start: {self.proc.stderr.read().decode(errors='replace')}")
        # what the imports printed (a real call would show it): nothing, or no zygote
        if select.select([self.proc.stderr], [], [], 0.2)[0]:
            said = os.read(self.proc.stderr.fileno(), 1 << 16).decode(errors="replace")
            if said:
                self.close()
                raise RuntimeError(f"importing the CLI's stages printed: {said}")

    @staticmethod
    def same_env(a: dict, b: dict) -> bool:
        """The same environment but for what the test process sets in its own: the name of the test pytest is
        running, and the default Inductor cache folder torch records once it compiles (both passed on to the call)."""
        skip = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"}
        return {k: v for k, v in a.items() if k not in skip} == {k: v for k, v in b.items() if k not in skip}

    def fits(self, env: dict, kw: dict) -> bool:
        return not kw and self.same_env(env, self.env) and self.proc.poll() is None

    def run(self, args: list[str], env: dict, cwd: str, timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="draftsmith-cli-") as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            out.touch()
            err.touch()
            req = {"argv": args, "env": env, "cwd": str(cwd), "out": str(out), "err": str(err)}
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
            pid = json.loads(self.proc.stdout.readline())["pid"]
            if not select.select([self.proc.stdout], [], [], timeout)[0]:
                os.kill(pid, signal.SIGKILL)  # not reaped yet: the zygote reaps it only after this, in waitpid
                self.proc.stdout.readline()
                raise subprocess.TimeoutExpired(["draftsmith", *args], timeout)
            status = json.loads(self.proc.stdout.readline())["status"]
            return subprocess.CompletedProcess([sys.executable, "-m", "draftsmith", *args],
                                               os.waitstatus_to_exitcode(status),
                                               out.read_text(errors="replace"), err.read_text(errors="replace"))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
