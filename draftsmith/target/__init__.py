"""The target package (being split from target.py, moved whole to load.py)."""

from draftsmith.target.load import *  # noqa: F401,F403
