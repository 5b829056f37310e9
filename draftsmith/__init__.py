"""draftsmith: train EAGLE-3 draft models for speculative decoding and deploy them in vLLM."""

import re

__version__ = "0.1.0"


class DraftsmithError(Exception):
    """A user-facing error: the CLI prints its message on one line and exits non-zero.

    The message should name the file, line or config field at fault.
    """


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's kill, `kill PID`) raised as an interruption, so that a stage closes its
    journal as interrupted and the command exits 143 with one line, as Ctrl-C does with 130."""


# What looks like a credential whatever its value: an Authorization header's token, an OpenAI-style
# key, the user:password of a URL (http://user:key@host/v1 in generate.servers).
_BEARER = re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=\\%-]{6,}")
_KEY_LIKE = re.compile(r"\bsk-[A-Za-z0-9_\\/%+=-]{12,}")
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@]+@")


def scrub(text: str) -> str:
    """`text` with anything shaped like a credential replaced by ***: applied to every log line and
    error line, so that no key reaches a file or the terminal whatever its value."""
    return _URL_USERINFO.sub(r"\1***@", _KEY_LIKE.sub("***", _BEARER.sub(r"\1***", text)))


def one_line(text: str) -> str:
    """A message on one line, credentials scrubbed: the lines of `text` joined by spaces (library
    errors quoted in a DraftsmithError can span several)."""
    return scrub(" ".join(line.strip() for line in str(text).splitlines() if line.strip()))
