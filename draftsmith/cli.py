"""The `draftsmith` console script: one command per stage, plus run, demo, status and watch.

Every stage command takes `--run DIR`, `--config FILE.yaml` and any number of `--set key=value`.
User errors (bad input, bad config, missing upstream stage) print one line on stderr and exit 2;
a traceback means a bug in draftsmith.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer._click import exceptions as click_exc  # typer vendors its own click

from draftsmith import DraftsmithError, one_line

app = typer.Typer(
    name="draftsmith",
    help="Train EAGLE-3 draft models for speculative decoding and deploy them in vLLM.\n\n"
    "Examples:\n\n"
    "  draftsmith status runs/demo\n\n"
    "  draftsmith generate --run runs/r1 --set generate.limit=100",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)

RunOpt = Annotated[Path, typer.Option("--run", help="The run directory (created if missing).")]
ConfigOpt = Annotated[Optional[Path], typer.Option("--config", help="YAML config file.")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="Override a config key: --set train.lr=3e-4 (repeatable).")]


def stage_config(config: Path | None, sets: list[str] | None, **options):
    """Config from YAML + --set + the command's own options (which win), validated."""
    from draftsmith.config import load_config

    overrides = list(sets or [])
    for key, value in options.items():
        if value is not None:
            overrides.append(f"{key}={value}")
    return load_config(config, overrides)


# -------------------------------------------------------------------------------------------------
# status / watch


@app.command(epilog="Examples:\n\n  draftsmith status runs/demo\n\n  draftsmith status runs/demo --json | jq '.stages[] | {name, state, eta_s}'")
def status(
    run: Annotated[Path, typer.Argument(help="The run directory.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object (the shape in SPEC.md).")] = False,
):
    """Show each stage's state (pending, running, stalled, dead, failed, done), progress, rate, ETA and files on disk."""
    import json

    from draftsmith.status import render_table, run_status

    st = run_status(run)
    print(json.dumps(st) if json_out else render_table(st))


@app.command(epilog="Examples:\n\n  draftsmith watch runs/demo\n\n  draftsmith watch runs/demo --interval 30 > watch.log")
def watch(
    run: Annotated[Path, typer.Argument(help="The run directory.")],
    interval: Annotated[float, typer.Option(help="Seconds between refreshes.")] = 2.0,
):
    """Refresh the status table until every stage is done or failed (a snapshot per interval when piped)."""
    from draftsmith.status import watch as _watch

    _watch(str(run), interval_s=interval)


# -------------------------------------------------------------------------------------------------
# Entry point


def _register_stage_commands() -> None:
    """Stage commands live beside their stage modules (draftsmith/commands.py) to keep this file short."""
    from draftsmith.commands import register_all

    register_all(app)


def _fast_status(args: list[str]) -> None:
    """`draftsmith status` without importing Typer (~0.2 s): status must answer instantly, and
    monitoring scripts call it in loops. Same arguments and output as the Typer command."""
    import argparse
    import json

    from draftsmith.status import render_table, run_status

    ap = argparse.ArgumentParser(prog="draftsmith status", add_help=False)
    ap.add_argument("run")
    ap.add_argument("--json", action="store_true")
    ns, extra = ap.parse_known_args(args)
    if extra:
        raise DraftsmithError(f"status: unexpected arguments {' '.join(extra)} (see --help)")
    st = run_status(ns.run)
    print(json.dumps(st) if ns.json else render_table(st))


def main(argv: list[str] | None = None) -> None:
    # Logs must reach a file at once under `nohup cmd > log 2>&1 &`: line-buffer both streams
    # before anything is printed (Python block-buffers them when they are not a terminal).
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)
        except (AttributeError, ValueError):
            pass
    args = sys.argv[1:] if argv is None else argv
    try:
        if args[:1] == ["status"] and len(args) > 1 and not {"-h", "--help"} & set(args):
            return _fast_status(args[1:])
        _register_stage_commands()
        app(args=args, standalone_mode=False, prog_name="draftsmith")
    except DraftsmithError as e:
        print(f"draftsmith: error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        print("draftsmith: aborted", file=sys.stderr)
        sys.exit(130)
    except click_exc.NoArgsIsHelpError as e:
        print(e.ctx.get_help() if e.ctx is not None else "draftsmith --help")
        sys.exit(0)
    except click_exc.ClickException as e:
        # Usage errors (unknown option, missing argument): one line, not click's usage box.
        msg = e.format_message().replace("\n", " ")
        ctx = getattr(e, "ctx", None)
        where = f" ({ctx.command_path})" if ctx is not None else ""
        print(f"draftsmith: error{where}: {msg} (see --help)", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("draftsmith: interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        # `draftsmith status RUN | head`: the reader left; not an error worth a traceback.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    except Exception as e:
        # A full disk where no stage code named the file (stages raise rundir.DiskFull, above):
        # still one line, not a traceback.
        from draftsmith.rundir import is_disk_full

        if not is_disk_full(e):
            raise
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        print(f"draftsmith: error: {where}no space left on device ({type(e).__name__}: {one_line(e)}); "
              "free some space and run the same command again", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
