"""The `draftsmith` console script: one command per stage, plus run, demo, status and watch.

Every stage command takes `--run DIR`, `--config FILE.yaml` and any number of `--set key=value`.
User errors (bad input, bad config, missing upstream stage) print one line on stderr and exit 2;
any other exception is a bug in draftsmith: one line too (exit 1), naming the stage and where its
traceback was written (the stage's stage.log, else a file in the temporary folder), never a
traceback on the terminal.
"""

from __future__ import annotations

import errno
import inspect
import json
import logging
import os
import signal
import sys
import threading
import warnings
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer._click import exceptions as click_exc  # typer vendors its own click

from draftsmith import DraftsmithError, Terminated, kinds, one_line, stages
from draftsmith.estimate import (DEFAULT_PROMPT_TOKENS, HARDWARE, apply_run_rates, estimate_config, render,
                                 run_rates)
from draftsmith.journal import env_rank
from draftsmith.progress import log, write_traceback
from draftsmith.rundir import RunDir, is_disk_full
from draftsmith.status import render_table, run_status
from draftsmith.status import watch as watch_run

# errors of a path the system will not write: the user's to fix, so one line naming the path
REFUSED_BY_THE_SYSTEM = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG}

app = typer.Typer(
    name="draftsmith",
    help=f"Train draft models ({', '.join(k.label for k in kinds.all_kinds())}) for speculative decoding and deploy "
    "them in vLLM.\n\n"
    "Examples:\n\n"
    "  draftsmith status runs/demo\n\n"
    "  draftsmith generate --run runs/r1 --set generate.limit=100",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def annotated(opt: stages.Option):
    """A record's option as the annotation Typer reads a command's parameter by, and the parameter's default."""
    info = typer.Option(*opt.flags, help=opt.help)
    if opt.type is bool:
        return Annotated[bool, info], False
    kind = list[opt.type] if opt.multiple else opt.type
    if opt.required:
        return Annotated[kind, info], inspect.Parameter.empty
    return Annotated[Optional[kind], info], None


SetOpt = annotated(stages.SETS)[0]


def stage_config(config: Path | None, sets: list[str] | None, **options):
    """Config from YAML + --set + the command's own options (which win), validated."""
    from draftsmith.config import load_config  # pydantic costs ~0.1 s that `status` must not pay

    overrides = list(sets or [])
    for key, value in options.items():
        if value is not None:
            overrides.append(f"{key}={value}")
    return load_config(config, overrides)


def torch_threads(cfg) -> None:
    """Set this process's torch threads by the thread policy and say so in the first log line."""
    from draftsmith.host import thread_policy  # torch: only the commands that compute pay for it

    log(thread_policy(cfg.threads, cfg.device)[1])


# -------------------------------------------------------------------------------------------------
# Stage commands, one per record of stages.REGISTRY, its options the record's. Each imports its stage
# when it runs, after its config is read: the stages pull in torch and transformers (~3 s), which
# `--help`, `status` and a config error must not pay for.


def run_stage(record: stages.Stage, values: dict) -> None:
    """Run a stage as its command does: config from --config, --set and the options that set keys; torch's
    threads taken if the record says so; the run function called with the options that are its arguments; the
    record's summary line printed."""
    opts = [o for o in record.options if o not in stages.COMMON]
    cfg = stage_config(values[stages.CONFIG.name], values[stages.SETS.name],
                       **{o.key: o.override(values[o.name]) for o in opts if o.key})
    from draftsmith.released import preflight  # pydantic, read with the config above; `status` must not pay for it

    preflight(cfg, log)  # a released drafter (train.init_from) that does not fit: one line before any stage runs
    run_function = record.run_function()
    if record.threads(cfg):
        torch_threads(cfg)
    run = RunDir(values[stages.RUN.name])
    manifest = run_function(run, cfg, **{o.arg: values[o.name] for o in opts if o.arg})
    if record.summary and env_rank()[0] == 0 and (line := stages.load(record.summary)(run, manifest)) is not None:
        print(line)  # rank 0's alone: the other ranks of a torchrun ran the same stage


def add_stage_command(record: stages.Stage) -> None:
    """Register `draftsmith <record.name>` with the record's help, examples and options."""
    def command(**values) -> None:
        run_stage(record, values)

    params = []
    for opt in record.options:
        annotation, default = annotated(opt)
        params.append(inspect.Parameter(opt.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                        annotation=annotation))
    command.__signature__ = inspect.Signature(params)  # what Typer reads the options from
    command.__name__ = record.name
    app.command(record.name, help=record.help, epilog=record.epilog)(command)


for _record in stages.REGISTRY.values():
    add_stage_command(_record)


# -------------------------------------------------------------------------------------------------
# The whole pipeline


@app.command(
    "run",
    epilog="Examples:\n\n  draftsmith run configs/demo.yaml --run runs/demo\n\n"
    "  draftsmith run configs/smollm2-cpu.yaml --run runs/cpu --set train.max_steps=2000\n\n"
    "  draftsmith run my.yaml --run runs/x --from train   (generate..vocab/extract must be done)\n\n"
    "  nohup draftsmith run my.yaml --run runs/x > runs/x.log 2>&1 &   then: draftsmith watch runs/x",
)
def run_cmd(
    config: Annotated[Path, typer.Argument(help="The run's YAML config.")],
    run: Annotated[str, typer.Option("--run", help="The run directory.")],
    sets: SetOpt = None,
    from_stage: Annotated[Optional[str], typer.Option("--from", help="First stage to run.")] = None,
    until_stage: Annotated[Optional[str], typer.Option("--until", help="Last stage to run.")] = None,
):
    """Run the stages in order; a stage whose inputs and settings are unchanged is skipped."""
    cfg = stage_config(config, sets)
    from draftsmith.pipeline import run_pipeline, summarize
    torch_threads(cfg)
    rd = RunDir(run)
    run_pipeline(rd, cfg, from_stage, until_stage, retake_threads=True)
    print(summarize(rd))


@app.command(
    "demo",
    epilog="Examples:\n\n  draftsmith demo\n\n  draftsmith demo --run runs/my-demo\n\n"
    "  draftsmith demo --set eval.limit=10   (a quicker look)",
)
def demo_cmd(
    run: Annotated[str, typer.Option("--run", help="The run directory.")] = "runs/demo",
    sets: SetOpt = None,
):
    """The whole pipeline on the embedded default: SmolLM2-135M-Instruct, ShareGPT, MT-bench, on the CPU."""
    from draftsmith.demo import demo_config, explain, run_demo
    from draftsmith.pipeline import summarize

    rd = RunDir(run)
    torch_threads(demo_config(list(sets or [])))
    run_demo(rd, list(sets or []))
    print(summarize(rd))
    print(explain(rd))


@app.command(
    "estimate",
    epilog="Examples:\n\n  draftsmith estimate configs/demo.yaml\n\n"
    "  draftsmith estimate configs/llama-8b-1xh100.yaml --hardware h100 "
    "--target-config configs/targets/llama-3.1-8b-instruct.json\n\n"
    "  draftsmith estimate configs/kimi-k2-8xh200.yaml --hardware h200 --devices 8 "
    "--target-config configs/targets/kimi-k2-instruct.json --json",
)
def estimate_cmd(
    config: Annotated[Path, typer.Argument(help="The run's YAML config.")],
    sets: SetOpt = None,
    hardware: Annotated[str, typer.Option(help=f"Hardware profile: {', '.join(HARDWARE)}.")] = "cpu",
    devices: Annotated[int, typer.Option(help="Devices (GPUs) the target and training use.")] = 1,
    target_config: Annotated[Optional[Path], typer.Option(
        help="The target's config.json, when the target is not on this machine (else read from `target`).")] = None,
    prompt_tokens: Annotated[int, typer.Option(
        help="Average prompt tokens per sample, chat template included.")] = DEFAULT_PROMPT_TOKENS,
    answer_tokens: Annotated[Optional[int], typer.Option(
        help="Average answer tokens per sample (default: 85% of generate.max_tokens, as measured on "
        "ShareGPT).")] = None,
    load_rate: Annotated[Optional[float], typer.Option(
        help="GB/s the target's weights are read at on each server start (default: the profile's, printed with "
        "its source).")] = None,
    disk_rate: Annotated[Optional[float], typer.Option(
        help="GB/s the run directory's disk reads and writes (default: the profile's local disk; a network volume "
        "can be far slower, and offline training reads the whole store every epoch).")] = None,
    from_run: Annotated[Optional[Path], typer.Option(
        "--from", help="A run directory (a pilot on the same hardware): take each finished stage's measured rate "
        "from its manifests and scale it to this recipe; the rest stays modelled.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
):
    """Estimate disk, memory per device and time of each stage, before running it."""
    cfg = stage_config(config, sets)
    rates = run_rates(from_run) if from_run is not None else None  # a bad --from fails before any work
    e = estimate_config(cfg, hardware, devices, target_config, prompt_tokens, answer_tokens, load_rate, disk_rate)
    if rates is not None:
        e = apply_run_rates(e, rates)
    print(json.dumps(e) if json_out else render(e))


# -------------------------------------------------------------------------------------------------
# status / watch


@app.command(epilog="Examples:\n\n  draftsmith status runs/demo\n\n"
             "  draftsmith status runs/demo --json | jq '.stages[] | {name, state, eta_s}'")
def status(
    run: Annotated[str, typer.Argument(help="The run directory.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object (the shape in SPEC.md).")] = False,
):
    """Show each stage's state (pending, running, stalled, dead, failed, done), progress, rate, ETA and files
    on disk."""
    st = run_status(run)
    print(json.dumps(st) if json_out else render_table(st))


@app.command(epilog="Examples:\n\n  draftsmith watch runs/demo\n\n"
             "  draftsmith watch runs/demo --interval 30 > watch.log\n\n"
             "  nohup draftsmith watch runs/big --interval 60 --notify 'curl -sS --fail -X POST -H \"Content-type: "
             "application/json\" --data \"{\\\"text\\\": $DRAFTSMITH_MESSAGE_JSON}\" \"$SLACK_WEBHOOK\"' > watch.log &")
def watch(
    run: Annotated[str, typer.Argument(help="The run directory.")],
    interval: Annotated[float, typer.Option(help="Seconds between refreshes.")] = 2.0,
    notify: Annotated[Optional[str], typer.Option(
        help="A shell command run once each time a stage becomes running, stalled, dead, failed, interrupted or "
        "done, with DRAFTSMITH_RUN, _STAGE, _STATE, _PREVIOUS_STATE, _DONE, _TOTAL, _UNIT, _ETA_S, _ERROR, "
        "_MESSAGE (one line) and _MESSAGE_JSON (that line as a JSON string) in its environment; watching then goes "
        "on until every stage is done.")] = None,
):
    """Refresh the status table until every stage is done or failed (a snapshot per interval when piped); with
    --notify, tell a command of every change of a stage's state."""
    if interval <= 0 or interval != interval:
        raise DraftsmithError(f"--interval: {interval}: must be a positive number of seconds")
    watch_run(str(run), interval_s=interval, notify=notify)


# -------------------------------------------------------------------------------------------------
# Entry point


def _fast_status(args: list[str]) -> None:
    """`draftsmith status` without importing Typer (~0.2 s): status must answer instantly, and
    monitoring scripts call it in loops. Same arguments and output as the Typer command."""
    import argparse  # only this fast path parses by hand

    ap = argparse.ArgumentParser(prog="draftsmith status", add_help=False)
    ap.add_argument("run")
    ap.add_argument("--json", action="store_true")
    ns, extra = ap.parse_known_args(args)
    if extra:
        raise DraftsmithError(f"status: unexpected arguments {' '.join(extra)} (see --help)")
    st = run_status(ns.run)
    print(json.dumps(st) if ns.json else render_table(st))


_received_sigterm = False  # Typer turns any KeyboardInterrupt into the return value 130: this tells which


def _raise_terminated(signum, frame) -> None:
    global _received_sigterm
    _received_sigterm = True
    raise Terminated()


def _quiet_leftovers() -> None:
    """A signal that landed inside an event loop's task (generate's requests) leaves that task holding the
    exception; when it is collected at exit, asyncio logs "Task exception was never retrieved" and a traceback
    to stderr, after the one line a stop prints; one that landed while anyio's connect was starting its attempts
    leaves a coroutine never awaited, whose RuntimeWarning comes at exit. The stop is already said: neither says
    anything more."""
    logging.getLogger("asyncio").disabled = True
    warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning)


def _stderr(line: str) -> None:
    """The one line a failed command prints; a stderr that went away (a launcher killed) is not a second error."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def main(argv: list[str] | None = None) -> None:
    # Logs must reach a file at once under `nohup cmd > log 2>&1 &`: line-buffer both streams
    # before anything is printed (Python block-buffers them when they are not a terminal).
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)
        except (AttributeError, ValueError):
            pass
    args = sys.argv[1:] if argv is None else argv
    if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
        signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        if args[:1] == ["status"] and len(args) > 1 and not {"-h", "--help"} & set(args):
            return _fast_status(args[1:])
        # Ctrl-C inside a command comes back from Typer as the return value 130, not as an exception
        rc = app(args=args, standalone_mode=False, prog_name="draftsmith")
        if rc == 130:
            raise Terminated() if _received_sigterm else KeyboardInterrupt()
        if isinstance(rc, int) and rc:
            sys.exit(rc)
    except DraftsmithError as e:
        _stderr(f"draftsmith: error: {one_line(e)}")
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        _stderr("draftsmith: aborted")
        sys.exit(130)
    except click_exc.NoArgsIsHelpError as e:
        print(e.ctx.get_help() if e.ctx is not None else "draftsmith --help")
        sys.exit(0)
    except click_exc.ClickException as e:
        # Usage errors (unknown option, missing argument): one line, not click's usage box.
        msg = e.format_message().replace("\n", " ")
        ctx = getattr(e, "ctx", None)
        where = f" ({ctx.command_path})" if ctx is not None else ""
        _stderr(f"draftsmith: error{where}: {msg} (see --help)")
        sys.exit(2)
    except Terminated:
        _quiet_leftovers()
        _stderr("draftsmith: terminated (SIGTERM); the same command resumes from the finished work")
        sys.exit(143)
    except KeyboardInterrupt:
        _quiet_leftovers()
        _stderr("draftsmith: interrupted (Ctrl-C); the same command resumes from the finished work")
        sys.exit(130)
    except BrokenPipeError:
        # `draftsmith status RUN | head`: the reader left; not an error worth a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    except Exception as e:
        # A full disk, or a file the system refuses (read-only file system, no permission, a folder
        # where a file should be), where no stage code named it: still one line, not a traceback.
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        if is_disk_full(e):
            _stderr(f"draftsmith: error: {where}no space left on device ({type(e).__name__}: {one_line(e)}); "
                    "free some space and run the same command again")
            sys.exit(2)
        if isinstance(e, OSError) and e.errno in REFUSED_BY_THE_SYSTEM and where:
            _stderr(f"draftsmith: error: {where}{e.strerror}")
            sys.exit(2)
        # Anything else is a bug: one line saying what failed where, the traceback in a log, never on the terminal
        # (a stage wrote it into its stage.log on the way out; elsewhere it goes to a file of its own)
        log_path = write_traceback(e, None)
        stage = getattr(e, "traceback_stage", None)
        _stderr(f"draftsmith: error: {f'{stage}: ' if stage else ''}{type(e).__name__}: {one_line(e)[:300]} (a bug "
                f"in draftsmith, please report it; the traceback is in {log_path})")
        sys.exit(1)


if __name__ == "__main__":
    main()
