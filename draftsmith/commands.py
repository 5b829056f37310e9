"""Stage subcommands of the `draftsmith` CLI.

Each stage module (draftsmith/<stage>.py) defines `register(app)`, which adds its command to the
Typer app. Stage modules import torch and transformers inside their functions only, so that
`draftsmith status` and `--help` stay fast.
"""

from __future__ import annotations

import importlib
import importlib.util

# CLI order: the pipeline's order, then the whole-pipeline commands.
COMMAND_MODULES = ("generate", "prepare", "vocab", "extract", "train", "export", "evaluate", "pipeline", "estimate")


def register_all(app) -> None:
    for name in COMMAND_MODULES:
        if importlib.util.find_spec(f"draftsmith.{name}") is None:
            continue  # a stage that is not built yet has no command (no stubs)
        module = importlib.import_module(f"draftsmith.{name}")
        module.register(app)
