"""Which drafter class a drafter config builds: a DFlash block drafter (model/dflash.py) when the config has a
block size, a P-EAGLE drafter (model/peagle.py) when it names a mask token only, the EAGLE-3 chain drafter
(model/eagle3.py) otherwise. Training, export and the engines all build their
drafter through this, so that a config (a checkpoint's drafter.json, an export's config.json) alone decides."""

from __future__ import annotations

from draftsmith.model.config import Eagle3Config
from draftsmith.model.dflash import DFlashDrafter
from draftsmith.model.eagle3 import Eagle3Drafter
from draftsmith.model.peagle import PEagleDrafter

# train.method -> the speculators type vLLM reads (speculators_model_type)
METHODS = ("eagle3", "peagle", "dflash")


def drafter_method(config: Eagle3Config) -> str:
    if config.block_size:
        return "dflash"
    return "peagle" if config.mask_token_id is not None else "eagle3"


def drafter_class(config: Eagle3Config):
    return {"dflash": DFlashDrafter, "peagle": PEagleDrafter, "eagle3": Eagle3Drafter}[drafter_method(config)]
