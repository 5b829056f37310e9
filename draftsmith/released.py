"""The released drafter a run starts from (`train.init_from`): found, read and checked against the target here and
nowhere else; the stages ask this module what it fixes.

    train.init_from: runs/peer/export            # a drafter folder
    train.init_from: RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3     # a Hub id, through the Hugging Face cache

- Found (`resolve`): a folder as given; else a Hub id `org/name`, whose snapshot huggingface_hub finds in the Hugging
  Face cache (HF_HOME, HF_HUB_CACHE), fetched into it unless HF_HUB_OFFLINE=1 says to read the cache alone.
- Read (`open_released`): its config.json in any layout export reads (kinds.read_export: the speculators format of
  vLLM, the peer and draftsmith; the EAGLE-3 layout of the EAGLE authors and SpecForge; an MLA drafter's
  Eagle3DeepseekV3ForCausalLM folder), and the sha256 of its config.json and weights, which every stage that depends
  on it fingerprints. Its weights are read by export's reader (`load`: export.load_exported).
- Checked before any work (`preflight`, called by `draftsmith run` and every stage command before the stage runs;
  `open_released` again in the stages): against the target (hidden size, vocabulary, aux layer ids inside its
  layers, a sane layer count; a one-line note when the folder names another target), and against the train
  settings: train.method must be its kind (written in every artifact, never inferred) and a setting that shapes the
  drafter (SHAPING) set to another value than the drafter has is refused. Each refusal is one line naming the
  folder and the field.
- What it fixes: the aux layers extract stores (`aux_layers`, `check_store_layers`); the drafter's architecture
  (train/drafter.py builds it from `Released.config`); with train.init_vocab=keep the draft vocabulary
  (`vocab_maps`, `draft_vocab_size`: vocab writes it).

No torch at import: `run` and the stage commands check a config here before a stage is imported.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from draftsmith import DraftsmithError, kinds, one_line
from draftsmith.config import is_hub_id
from draftsmith.rundir import folder_sha256, published_path, read_json_object

FIELD = "train.init_from"
CONFIG_FILE = "config.json"  # export.CONFIG_FILE (export imports torch)
# The train settings that shape the drafter -> the DrafterConfig field the released drafter has for each: one set
# (model_fields_set) to another value is refused, one left at its default follows the drafter.
SHAPING = {"num_layers": "num_hidden_layers", "norm_before_fc": "norm_before_fc", "fc_norm": "fc_norm",
           "norm_output": "norm_output", "mask_token_id": "mask_token_id", "drafter_options": "options"}
MAX_LAYERS = 32  # the most decoder layers a drafter may have (TrainConfig.num_layers' bound)
_TRUE = {"1", "on", "yes", "true"}


@dataclass
class Released:
    """A released drafter, read and checked (open_released)."""

    source: str  # train.init_from as given: a folder, or a Hub id
    folder: Path  # the local folder (a Hub id's snapshot in the Hugging Face cache)
    config: Any  # its DrafterConfig, as released (model/config.py)
    aux_layers: list[int]  # the target layer ids its fc fuses, in vLLM's count
    format: str  # the layout it is in (kinds.FORMATS: speculators or eagle3)
    vocab: str  # train.init_vocab: keep or remap
    hub: bool = False  # found as a Hub id (its source is published as is)
    weights: list[Path] = field(default_factory=list)  # its *.safetensors files

    @functools.cached_property
    def sha256(self) -> str:
        """sha256 of its config.json and weight files (rundir.folder_sha256: eval.drafter's print of a folder)."""
        return folder_sha256([self.folder / CONFIG_FILE, *self.weights])

    @property
    def keeps_vocab(self) -> bool:
        return self.vocab == "keep"

    def published_source(self, root: Path) -> str:
        """The source as a published file may name it: a Hub id as is, a folder relative to `root` (the run) or by
        its last two parts (rundir.published_path), never an absolute path of this machine."""
        return self.source if self.hub else published_path(self.folder, root)

    def record(self, root: Path) -> dict:
        """What drafter.json, the export's config.json and provenance.json say of it."""
        return {"source": self.published_source(root), "sha256": self.sha256, "format": self.format,
                "vocab": self.vocab}

    def settings(self) -> dict:
        """What a stage it shapes adds to its fingerprint: its contents and how it is used (never where it lies)."""
        return {"sha256": self.sha256, "vocab": self.vocab}


# -------------------------------------------------------------------------------------------------
# Finding and reading it


def _hub_offline() -> bool:
    # read at the call, not at import: huggingface_hub reads HF_HUB_OFFLINE once when it is imported
    return any(os.environ.get(k, "").strip().lower() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _hub_cache() -> str | None:
    """The Hugging Face cache this process names now (HF_HUB_CACHE, else HF_HOME/hub), else huggingface_hub's."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    return str(Path(os.environ["HF_HOME"]) / "hub") if os.environ.get("HF_HOME") else None


def resolve(source: str) -> tuple[Path, bool]:
    """(the local folder of train.init_from, whether it is a Hub id's): a folder as given, else a Hub id's snapshot
    in the Hugging Face cache (fetched into it unless offline); one line naming the source when there is none."""
    folder = Path(source).expanduser()
    if folder.is_dir():
        return folder.resolve(), False
    if not is_hub_id(source):
        raise DraftsmithError(f"{FIELD}: {source}: no such drafter folder, nor a Hub id (org/name)")
    import huggingface_hub  # only a Hub id needs it: `run` and the stage commands check a folder without it

    offline = _hub_offline()
    try:
        path = huggingface_hub.snapshot_download(source, cache_dir=_hub_cache(), local_files_only=offline,
                                                 allow_patterns=["*.json", "*.safetensors", "*.md"])
    except Exception as e:  # huggingface_hub raises its own error types (not cached, not found, no network)
        why = ("not in the Hugging Face cache and HF_HUB_OFFLINE=1 forbids fetching it" if offline else
               f"not found on the Hugging Face Hub nor in its cache ({type(e).__name__}: {one_line(str(e))[:200]})")
        raise DraftsmithError(f"{FIELD}: {source}: {why}") from None
    return Path(path), True


def open_released(cfg, info=None, say: Callable[[str], None] | None = None) -> Released | None:
    """The released drafter train.init_from names (None when unset), checked against the train settings and, given
    the target's TargetInfo `info`, against the target (check_target; `say` gets its note when the folder names
    another target)."""
    tc = cfg.train
    if tc.init_from is None:
        return None
    folder, hub = resolve(tc.init_from)
    cpath = folder / CONFIG_FILE
    if not cpath.is_file():
        raise DraftsmithError(f"{FIELD}: {folder}: no {CONFIG_FILE} (not a drafter folder)")
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise DraftsmithError(f"{FIELD}: {folder}: no *.safetensors weights (not a drafter folder)")
    cj = read_json_object(cpath)
    config, aux, _, verifier = kinds.read_export(cj, f"{FIELD}: {cpath}")
    rel = Released(source=tc.init_from, folder=folder, config=config, aux_layers=list(aux),
                   format=kinds.layout_of(cj), vocab=tc.init_vocab, hub=hub, weights=weights)
    check_train(rel, tc)
    if info is not None:
        check_target(rel, info, verifier or (cj.get("draftsmith") or {}).get("target_id"), cfg.target_id, say)
    return rel


def preflight(cfg, say: Callable[[str], None] | None = None) -> None:
    """Before any stage runs (`draftsmith run`, every stage command): train.init_from, when set, found and fitting the
    configured target and the train settings, or refused in one line."""
    if cfg.train.init_from is None:
        return
    from draftsmith.target import target_info  # transformers: paid only by a config that names a released drafter

    open_released(cfg, target_info(cfg.target, cfg.trust_remote_code), say)


def as_trained(cfg):
    """`cfg` as the run trains it from the released drafter train.init_from names (`cfg` itself when unset): the
    drafter's layers, attention and kind options, its aux layer ids as extract.layers, and with init_vocab=keep its
    vocabulary's size. What `estimate` sizes: the drafter and the store are the released drafter's, whatever
    train.num_layers and vocab.draft_vocab_size say (open_released refused a setting that contradicts it)."""
    rel = open_released(cfg)
    if rel is None:
        return cfg
    c = rel.config
    train = cfg.train.model_copy(update={"num_layers": c.num_hidden_layers, "drafter_attention": c.attention,
                                         "drafter_options": dict(c.options)})
    extract = cfg.extract.model_copy(update={"layers": list(rel.aux_layers)})
    vocab = cfg.vocab.model_copy(update={"draft_vocab_size": draft_vocab_size(cfg, rel)})
    return cfg.model_copy(update={"train": train, "extract": extract, "vocab": vocab})


# -------------------------------------------------------------------------------------------------
# Checks


def check_train(rel: Released, tc) -> None:
    """train.method must be the drafter's kind; a setting that shapes the drafter (SHAPING, drafter_attention) set to
    another value than the drafter has is refused, naming both; a block kind's block must be the drafter's."""
    where = f"{FIELD} ({rel.folder.name})"
    c = rel.config
    if tc.method != c.kind:
        raise DraftsmithError(f"train.method: {tc.method}, but {where} is a {c.kind} drafter (its config.json says "
                              f"so); set train.method={c.kind}")
    for key, attr in SHAPING.items():
        mine, theirs = getattr(tc, key), getattr(c, attr)
        if isinstance(mine, dict):  # the kind's options: those given, each as the drafter has it
            theirs = {k: theirs.get(k) for k in mine}
        if key in tc.model_fields_set and mine != theirs:
            raise DraftsmithError(f"train.{key}: {mine}, but {where} has {attr} {theirs}; unset it (the released "
                                  "drafter's architecture is the run's)")
    block = kinds.get(c.kind).block_size(tc)  # a block kind's drafts a step: what drafter.json and the export say
    if block != c.block_size:
        raise DraftsmithError(f"train.block_size: the run drafts blocks of {block} tokens (train.block_size, else "
                              f"ttt_steps + 1), but {where} drafts blocks of {c.block_size}; set "
                              f"train.block_size={c.block_size}")
    if tc.drafter_attention not in ("auto", c.attention):
        raise DraftsmithError(f"train.drafter_attention: {tc.drafter_attention}, but {where} has {c.attention} "
                              "attention; unset it")


def _same_model(a: str, b: str) -> bool:
    """Whether two target names clearly name the same model: their last parts (an org or folder aside) alike."""
    return a.rstrip("/").rsplit("/", 1)[-1].lower() == b.rstrip("/").rsplit("/", 1)[-1].lower()


def check_target(rel: Released, info, made_for: str | None, target_id: str | None = None,
                 say: Callable[[str], None] | None = None) -> None:
    """The drafter fits the target (TargetInfo): the same hidden size and vocabulary, aux layer ids inside its layers,
    at most MAX_LAYERS decoder layers, fewer than the target's. `made_for`: the target the folder says it was made
    for (its verifier), said in a one-line note when it clearly differs from the configured one."""
    cpath = rel.folder / CONFIG_FILE
    c = rel.config
    for name, mine, theirs in (("hidden_size", c.hidden_size, info.hidden_size),
                               ("vocab_size", c.vocab_size, info.vocab_size)):
        if mine != theirs:
            raise DraftsmithError(f"{FIELD}: {cpath}: {name} {mine}, but the target {info.name} has {theirs}; it was "
                                  f"made for another target")
    info.check_layers(rel.aux_layers, field=f"{FIELD}: {cpath}: aux layer ids")
    if not 1 <= c.num_hidden_layers <= min(MAX_LAYERS, info.num_layers - 1):
        raise DraftsmithError(f"{FIELD}: {cpath}: num_hidden_layers {c.num_hidden_layers}; a drafter of the target "
                              f"{info.name} ({info.num_layers} layers) has 1 to "
                              f"{min(MAX_LAYERS, info.num_layers - 1)}")
    ours = target_id or info.name
    if made_for and say is not None and not _same_model(made_for, ours) and not _same_model(made_for, info.name):
        say(f"note: {FIELD} {rel.source} says it was made for {made_for}, and the target is {ours}; its shapes fit")


def aux_layers(cfg, info, rel: Released | None) -> list[int]:
    """The aux layer ids extract stores and training reads: the released drafter's (extract.layers unset or the
    same), else extract.layers, else the target's default [2, N // 2, N - 3]; checked against the target."""
    asked = list(cfg.extract.layers) if cfg.extract.layers is not None else None
    if rel is None:
        return info.check_layers(asked if asked is not None else info.default_aux_layers())
    if asked is not None and asked != rel.aux_layers:
        raise DraftsmithError(f"extract.layers: {asked}, but {FIELD} ({rel.folder.name}) reads the target's layers "
                              f"{rel.aux_layers}; unset extract.layers (the released drafter's are the run's)")
    return rel.aux_layers


def check_store_layers(rel: Released | None, stored: list[int], where: Path) -> None:
    """A store extracted with other layers than the released drafter reads is refused, naming both."""
    if rel is not None and list(stored) != rel.aux_layers:
        raise DraftsmithError(f"{where}: extracted with layers {list(stored)}, but {FIELD} ({rel.folder.name}) reads "
                              f"layers {rel.aux_layers}; extract again (`draftsmith extract` with extract.overwrite="
                              "true)")


def draft_vocab_size(cfg, rel: Released | None) -> int:
    """The run's draft vocabulary size: the released drafter's with init_vocab keep (vocab.draft_vocab_size set to
    another is refused), else vocab.draft_vocab_size."""
    if rel is None or not rel.keeps_vocab:
        return cfg.vocab.draft_vocab_size
    size = rel.config.draft_vocab_size
    if "draft_vocab_size" in cfg.vocab.model_fields_set and cfg.vocab.draft_vocab_size != size:
        raise DraftsmithError(f"vocab.draft_vocab_size: {cfg.vocab.draft_vocab_size}, but train.init_vocab=keep "
                              f"keeps the {size} tokens of {FIELD} ({rel.folder.name}); unset it")
    return size


# -------------------------------------------------------------------------------------------------
# Its weights (torch)


def load(rel: Released, info):
    """(the released drafter as export's reader builds it, in float32 on the CPU (d2t and t2d as they are), its
    info): every file and key checked, and against the target (export.load_exported)."""
    from draftsmith.export import load_exported  # torch: the checks above stay light for `run` and the commands

    model, found = load_exported(rel.folder, target_info=info)
    return model.float(), found


def vocab_maps(rel: Released, info):
    """(d2t int64 [Dv], t2d bool [V]) of the released drafter, as numpy arrays (vocab writes them)."""
    model, _ = load(rel, info)
    return model.d2t.numpy(), model.t2d.numpy()
