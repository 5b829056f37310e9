"""The target: everything draftsmith knows of the model a drafter follows, asked here and nowhere else.

  identity.py  its config.json read once, and the family's facts (MLA, layers, widths, stop tokens); no torch
  layout.py    where its language model sits: tensor names and modules, one adapter per odd family; no torch
  gguf.py      finding its folder: a model folder, a .gguf file or the embedded short name, converted once
  load.py      describing it (target_info, TargetInfo) and loading it (load_target, load_tokenizer)
  capture.py   its hidden states captured during its forward (extract, online training, eval's local engine)

The device, threads and dtype a process computes with are host policy: draftsmith/host.py.

`from draftsmith.target import X` names the public names below; each is imported from its module on first use
(PEP 562), so that importing the torch-free identity.py (estimate, model/config.py) does not load transformers.
"""

import importlib

_MODULE_OF = {
    "load": ("Target", "TargetInfo", "chat_template_sha256", "config_sha256", "load_target", "load_tokenizer",
             "target_device_map", "target_info", "verifier_name"),
    "gguf": ("resolve_target",),
    "layout": ("language_model_names", "read_tensor"),
    "identity": ("Identity", "is_mla", "read_identity"),
}
__all__ = [name for names in _MODULE_OF.values() for name in names]


def __getattr__(name: str):
    module = next((m for m, names in _MODULE_OF.items() if name in names), None)
    if module is None:
        raise AttributeError(f"module 'draftsmith.target' has no attribute {name!r}")
    return getattr(importlib.import_module(f"draftsmith.target.{module}"), name)
