"""The suite's own rules: it fails past its time budget, naming its slowest tests, and it gives the same result
however its runner was started (a background job or `nohup` inherits SIGINT ignored)."""

import os
import signal
import subprocess
import sys

import pytest

import conftest
from conftest import REPO


def pytest_run(*args: str, env: dict | None = None, preexec_fn=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})},
                          preexec_fn=preexec_fn)


def test_the_suite_fails_past_its_budget_and_names_its_slowest_tests():
    node = "tests/test_validation.py::test_the_split_depends_on_groups_alone"
    p = pytest_run(node, env={"DRAFTSMITH_SUITE_BUDGET_S": "0", "DRAFTSMITH_SUITE_BUDGET_ALWAYS": "1"})
    assert p.returncode == 1, p.stdout + p.stderr
    assert "past its budget of 0 min" in p.stdout and node in p.stdout.split("past its budget")[1]
    # a selection of the suite is not held to the whole suite's budget
    p = pytest_run(node, env={"DRAFTSMITH_SUITE_BUDGET_S": "0"})
    assert p.returncode == 0 and "past its budget" not in p.stdout, p.stdout + p.stderr
    # in the README's two workers the controller times the suite and names the slowest once; the workers do not
    p = pytest_run("-n", "2", "--dist", "loadfile", node, env={"DRAFTSMITH_SUITE_BUDGET_S": "0",
                                                                "DRAFTSMITH_SUITE_BUDGET_ALWAYS": "1"})
    assert p.returncode == 1 and p.stdout.count("past its budget of 0 min") == 1, p.stdout + p.stderr
    assert node in p.stdout.split("past its budget")[1]


def test_ctrl_c_tests_pass_when_the_runner_ignores_sigint():
    """As under `nohup cmd &`: the runner starts with SIGINT ignored; the children the tests stop with Ctrl-C still
    see it (tests/conftest.py stop_signals_default)."""
    p = pytest_run("tests/test_signals.py::test_stopped_command_exits_nonzero_and_status_says_interrupted",
                   "-k", "Ctrl-C", preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert p.returncode == 0 and "1 passed" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]


def test_a_forked_cli_call_is_the_same_as_a_fresh_one(tmp_path, tiny_target):
    """run_cli forks its calls from a process that has the CLI's imports done (tests/cli_fork.py): each gives the
    exit code, stdout and stderr of `python -m draftsmith` started afresh, in the call's folder and environment;
    a call with an environment of its own starts afresh."""
    (tmp_path / "run").mkdir()
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lr: [1\n")
    calls = [["--help"], ["train", "--run", "run", "--set", "train.bogus=1"], ["train", "--run", "run", "--frob"],
             ["run", str(bad), "--run", "run"], ["prepare", "--run", "run", "--set", f"target={tiny_target}"],
             ["export", "--run", "run", "--set", f"target={tiny_target}"]]  # (status: its ages differ by the second)
    for args in calls:
        forked = conftest.run_cli(*args, cwd=tmp_path)
        fresh = subprocess.run([sys.executable, "-m", "draftsmith", *args], capture_output=True, text=True,
                               cwd=tmp_path, timeout=300)
        assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr), args
    z = conftest._zygote
    assert z is not None and z.proc.poll() is None
    # an environment the zygote did not import under, or another subprocess.run keyword: a fresh process
    env = dict(os.environ)
    changed = sorted(k for k in {*env, *z.env} if env.get(k) != z.env.get(k))
    assert z.fits(env, {}), f"the suite's environment changed since the zygote started: {changed}"
    assert not z.fits({**env, "HF_HUB_OFFLINE": "1"}, {}) and not z.fits(env, {"input": "y"})


def test_the_cli_zygote_reports_a_quick_call_at_once_cuts_a_long_one_and_refuses_imports_that_print(tmp_path):
    """tests/cli_fork.py's three paths: a call that ends at once is reported at once (its pid and status lines,
    written together, once sat in a read buffer while select() waited the whole timeout on the pipe); a call past
    its timeout is killed and the zygote serves the next call; a zygote whose imports print refuses to start."""
    import time

    from cli_fork import Zygote

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    z = Zygote(conftest.REPO, env)
    try:
        for _ in range(3):
            t0 = time.monotonic()
            p = z.run(["--help"], env, str(tmp_path), timeout=60)
            assert p.returncode == 0 and "Usage" in p.stdout and time.monotonic() - t0 < 30
        from draftsmith.rundir import RunDir

        RunDir(tmp_path / "run").ensure()  # a run whose stages are all pending: `watch` watches until stopped
        t0 = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired):
            z.run(["watch", str(tmp_path / "run"), "--interval", "0.1"], env, str(tmp_path), timeout=3)
        assert time.monotonic() - t0 < 30
        assert z.run(["--help"], env, str(tmp_path), timeout=60).returncode == 0  # it serves on
    finally:
        z.close()
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text("import sys\nprint('a library warning', file=sys.stderr)\n")
    with pytest.raises(RuntimeError, match="importing the CLI's stages printed: a library warning"):
        Zygote(conftest.REPO, {**env, "PYTHONPATH": str(hook)})
