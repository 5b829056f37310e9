"""draftsmith: train EAGLE-3 draft models for speculative decoding and deploy them in vLLM."""

__version__ = "0.1.0"


class DraftsmithError(Exception):
    """A user-facing error: the CLI prints its message on one line and exits non-zero.

    The message should name the file, line or config field at fault.
    """
