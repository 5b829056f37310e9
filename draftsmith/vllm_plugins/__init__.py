"""Code that runs inside a vLLM server, not in draftsmith's own process.

vLLM lives in its own virtual environment without draftsmith installed, so a server loads a
module from here by putting this folder on its PYTHONPATH (`plugin_dir()`) and naming the
module, e.g. `"kv_connector_module_path": "draftsmith_hs_connector"`. Modules here import only
vLLM, torch and safetensors, and none of draftsmith.
"""

from pathlib import Path


def plugin_dir() -> Path:
    """The folder to put on a vLLM server's PYTHONPATH."""
    return Path(__file__).resolve().parent
