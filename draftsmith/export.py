"""`export`: turn a training checkpoint into a drafter folder that vLLM (or SGLang) serves as is.

The output, RUN/export/, is in the layout export.format names; the kind's package writes and reads it
(kinds/<kind>/__init__.py: write_export, read_config, layout_keys):

- `speculators` (the default, every kind): the speculators format vLLM reads
  (vllm/transformers_utils/configs/speculators/) for eagle3, peagle and the block kinds;
- `eagle3` (an EAGLE-3 drafter with one Llama layer, three aux layers, no EAGLE-3.1 norm): the EAGLE-3 layout of the
  EAGLE authors and SpecForge, `LlamaForCausalLMEagle3`, that SGLang loads (python/sglang/srt/models/
  llama_eagle3.py) and vLLM too; the kinds it cannot hold are refused in one line (docs/kinds.md);
- an MLA drafter, under either: its native EAGLE-3 folder (Eagle3DeepseekV3ForCausalLM), which vLLM reads.

    config.json        speculators: `speculators_model_type`, `transformer_layer_config` (the drafter's
                       layers: shapes, eps, plain RoPE), `draft_vocab_size`, the target layer ids it reads,
                       `speculators_config` (proposal length and verifier = the target's Hub id or its name in
                       the config, never this machine's path); eagle3: a LlamaConfig's keys at the top level with
                       `architectures: [LlamaForCausalLMEagle3]`, `draft_vocab_size`, `target_hidden_size`,
                       `eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang's count: each id - 1) and
                       `eagle_aux_hidden_state_layer_ids` (vLLM's); both with a `draftsmith` block (the kind, the
                       target name as given, architecture, config.json sha256 and folder fingerprint, checkpoint
                       relative to the run, step, validation figures; outside speculators also the proposal length
                       and the verifier)
    model.safetensors  the kind's tensors by vLLM's names (eagle3: `layers.0.` as `midlayer.`), d2t, t2d (no
                       embed_tokens: the engines then share the target's embeddings, which is what the drafter
                       trained with)
    README.md          the model card (card.py), provenance.json beside it

    vllm serve TARGET --speculative-config "$(speculative_config(RUN/export, K))"
    python -m sglang.launch_server --model TARGET --speculative-algorithm EAGLE3 \\
        --speculative-draft-model-path RUN/export --speculative-num-steps K ...      (export.format=eagle3)

The folder is built beside RUN/export/ and renamed into place, so RUN/export/ always holds a
complete export or none. `load_exported(folder)` reads either layout back with every file and key checked.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from draftsmith import DraftsmithError, __version__, kinds
from draftsmith.bounds import check_model_numbers
from draftsmith.card import CARD, PROVENANCE, base_model, write_card
from draftsmith.checkpoint_format import BEST_DIR, CKPT_META, CKPT_STATE, CKPT_WEIGHTS, FC_INPUT_SCALE, FINAL_DIR
from draftsmith.model.config import DrafterConfig
from draftsmith.progress import Progress, log
from draftsmith.rundir import (RunDir, check_files, file_sha256, fingerprinted, published_path, read_json_object,
                               replace_dir)
from draftsmith.stage import StageBook, stage_run
from draftsmith.target import config_sha256, target_info, verifier_name

STAGE = "export"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# the stage's bookkeeping files, carried over when the built folder replaces RUN/export/
BOOKKEEPING = ("config.yaml", "progress.jsonl", "progress.prev.jsonl", "stage.log")


def export_keys(config, fmt: str = kinds.FORMATS[0]) -> dict[str, str]:
    """Model parameter name -> name in the exported safetensors, for a DrafterConfig in layout `fmt` (export.format):
    its kind's (kinds/<kind>/__init__.py: Kind.export_keys, renamed by Kind.layout_keys)."""
    kind = kinds.get(config.kind)
    return kind.layout_keys(kind.export_keys(config), config, fmt)


# optional in an export (vLLM uses the target's embeddings when it is absent)
OPTIONAL_KEYS = {"embed_tokens.weight": "embed_tokens.weight"}
# tensors that keep their integer/bool dtype; every other tensor is cast to export.dtype
INDEX_KEYS = ("d2t", "t2d")


# -------------------------------------------------------------------------------------------------
# Checkpoints


def _complete(folder: Path) -> bool:
    return all((folder / f).is_file() for f in (CKPT_WEIGHTS, CKPT_META, CKPT_STATE))


def find_checkpoint(run: RunDir, explicit: str | None = None) -> Path:
    """The checkpoint folder to export: `explicit` (`best`: RUN/train/best, the step of the highest validation tau;
    `final`, or unset: RUN/train/final, else the newest complete RUN/train/checkpoints/step_N; else a path, or
    relative to the run)."""
    train = run.path / "train"
    if explicit == BEST_DIR:
        if not _complete(train / BEST_DIR):
            raise DraftsmithError(f"export.checkpoint=best: {train / BEST_DIR}: no complete checkpoint (train keeps "
                                  "one when a validation pass measures a tau; is train.validation 0?)")
        return (train / BEST_DIR).resolve()
    if explicit and explicit != FINAL_DIR:
        p = Path(explicit).expanduser()
        if not p.is_absolute() and not p.exists() and (run.path / p).exists():
            p = run.path / p
        if not p.is_dir():
            raise DraftsmithError(f"export.checkpoint: {p}: no such checkpoint folder")
        for f in (CKPT_WEIGHTS, CKPT_META):
            if not (p / f).is_file():
                raise DraftsmithError(f"export.checkpoint: {p / f}: missing (not a draftsmith checkpoint)")
        if not (p / CKPT_STATE).is_file():
            raise DraftsmithError(f"export.checkpoint: {p}: incomplete checkpoint (no {CKPT_STATE}; "
                                  "it was being written when training stopped)")
        return p.resolve()
    if _complete(train / FINAL_DIR):
        return (train / FINAL_DIR).resolve()
    steps = []
    ck = train / "checkpoints"
    if ck.is_dir():
        for d in ck.iterdir():
            if d.is_dir() and d.name.startswith("step_") and d.name[5:].isdigit() and _complete(d):
                steps.append((int(d.name[5:]), d))
    if not steps:
        raise DraftsmithError(f"{train}: no complete checkpoint (train/final or train/checkpoints/step_N "
                              f"with {CKPT_STATE}); run `draftsmith train --run {run.path}` first")
    return max(steps)[1].resolve()


def drafter_config_from_meta(meta: dict, where: str):
    """DrafterConfig from a checkpoint's drafter.json: its DrafterConfig fields, at the top level
    or under "config"."""
    src = meta.get("config") if isinstance(meta.get("config"), dict) else meta
    check_model_numbers(src, where, drafter=True)  # bounded before anything is sized from it (1e9 layers)
    names = {f.name for f in fields(DrafterConfig)}
    kwargs = {k: v for k, v in src.items() if k in names}
    kwargs["kind"] = kinds.of_meta(meta)  # the kind as written (a checkpoint from before kinds: read once there)
    try:
        return DrafterConfig(**kwargs)
    except (TypeError, ValueError) as e:
        raise DraftsmithError(f"{where}: invalid drafter config ({e})") from None


def _meta_aux_layers(meta: dict, where: str) -> list[int]:
    layers = meta.get("aux_layers")
    if not (isinstance(layers, list) and layers and all(isinstance(x, int) for x in layers)):
        raise DraftsmithError(f"{where}: 'aux_layers' must be a list of layer ids, got {layers!r}")
    return layers


def _meta_target(meta: dict) -> tuple[str | None, str | None]:
    """(target name, target fingerprint) recorded by train, in either flat or nested form."""
    t = meta.get("target")
    if isinstance(t, dict):
        return t.get("name"), t.get("fingerprint")
    return t, meta.get("target_fingerprint")


# -------------------------------------------------------------------------------------------------
# Shapes and checks shared by export and load_exported


def expected_shapes(config, fmt: str = kinds.FORMATS[0]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Export name (in layout `fmt`) -> (shape, kind) for a drafter config; kind is "float", "int64" or "bool".
    Built on the meta device: no memory, always in step with model/eagle3.py."""
    with torch.device("meta"):
        model = kinds.drafter_class(config)(config)
    out, names = {}, export_keys(config, fmt)
    for name, t in model.state_dict().items():
        kind = "int64" if t.dtype == torch.long else "bool" if t.dtype == torch.bool else "float"
        out[names.get(name) or OPTIONAL_KEYS[name]] = (tuple(t.shape), kind)
    return out


def check_tensors(path: Path, shapes: dict[str, tuple[tuple[int, ...], Any]], config, *,
                  allow_extra: tuple[str, ...] = (), fmt: str = kinds.FORMATS[0]) -> None:
    """Check the names, shapes and dtypes of a safetensors file in layout `fmt` against `expected_shapes` without
    loading it; a missing, extra or misshapen tensor is a one-line error naming file and key."""
    if not path.is_file():
        raise DraftsmithError(f"{path}: missing")
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            found = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in keys}
    except Exception as e:  # safetensors raises its own error types for a corrupt header
        raise DraftsmithError(f"{path}: not a readable safetensors file ({e})") from None
    names = export_keys(config, fmt)
    for key in names.values():
        if key not in keys:
            raise DraftsmithError(f"{path}: missing tensor '{key}'")
    extra = sorted(keys - set(names.values()) - set(OPTIONAL_KEYS.values()) - set(allow_extra))
    if extra:
        raise DraftsmithError(f"{path}: unexpected tensor '{extra[0]}'"
                              + (f" (+{len(extra) - 1} more)" if len(extra) > 1 else ""))
    st_kind = {"I64": "int64", "BOOL": "bool", "F32": "float", "F16": "float", "BF16": "float", "F64": "float"}
    for key in [*names.values(), *OPTIONAL_KEYS.values()]:  # a fixed order: the same error every time
        if key not in found or key not in shapes:
            continue
        (shape, dtype), (want, kind) = found[key], shapes[key]
        if shape != want:
            raise DraftsmithError(f"{path}: tensor '{key}' has shape {list(shape)}, expected {list(want)} "
                                  f"(hidden {config.hidden_size}, vocab {config.vocab_size}, "
                                  f"draft vocab {config.draft_vocab_size})")
        if st_kind.get(dtype, dtype) != kind:
            raise DraftsmithError(f"{path}: tensor '{key}' has dtype {dtype}, expected {kind}")


def check_vocab_maps(d2t, t2d, where: str) -> None:
    """d2t must map draft ids to strictly increasing target ids in range, and t2d mark exactly them."""
    ids = d2t + torch.arange(d2t.numel())
    V = t2d.numel()
    if d2t.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
        raise DraftsmithError(f"{where}: 'd2t' maps a draft id outside the target vocabulary [0, {V})")
    if d2t.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise DraftsmithError(f"{where}: 'd2t' target ids are not strictly increasing")
    if int(t2d.sum()) != d2t.numel() or not bool(t2d[ids].all()):
        raise DraftsmithError(f"{where}: 't2d' does not mark exactly the target ids of 'd2t'")


# -------------------------------------------------------------------------------------------------
# The config.json vLLM reads: each kind's format (kinds/<kind>/__init__.py)


def speculative_config(folder: str | os.PathLike, num_speculative_tokens: int) -> dict:
    """The --speculative-config that serves the export in `folder` beside its target (its kind's: eagle3's
    method; P-EAGLE's with parallel_drafting, since vLLM 0.32 knows no method "peagle"; a block kind's with
    exactly block_size - 1 drafts)."""
    where = str(Path(folder) / CONFIG_FILE)
    cj = read_json_object(Path(folder) / CONFIG_FILE)
    config, *_ = kinds.read_export(cj, where)
    return kinds.get(config.kind).speculative_config(str(folder), config, int(num_speculative_tokens))


def exported_k(folder: str | os.PathLike) -> int:
    """The drafts per step the export in `folder` was made to be served with (its trained steps; a block
    drafter's block_size - 1): what `eval.num_speculative_tokens: auto` serves."""
    where = str(Path(folder) / CONFIG_FILE)
    _, _, spec_tokens, _ = kinds.read_export(read_json_object(Path(folder) / CONFIG_FILE), where)
    return int(spec_tokens)


# -------------------------------------------------------------------------------------------------
# Loading an export


def load_exported(folder: str | os.PathLike, *, target_info=None, embed_weight=None,
                  device: str = "cpu", dtype=None):
    """Read an exported drafter folder, checking it the way vLLM would use it.

    target_info (draftsmith.target.TargetInfo, optional): also check that the drafter fits this
    target (hidden size, vocabulary, aux layer ids in range). embed_weight [V, H] (optional): the
    target's input embeddings, copied into the drafter (an export carries none by default).

    Returns (the drafter in eval mode, of its kind's class (kinds/<kind>/model.py: Drafter), info dict: config,
    aux_layers, num_speculative_tokens, has_embed_tokens, dtype, draftsmith block, path). Every problem is a
    DraftsmithError naming the file and the key.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise DraftsmithError(f"{folder}: no such export folder")
    cpath, wpath = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    config_json = read_json_object(cpath)
    config, aux, spec_tokens, verifier = kinds.read_export(config_json, str(cpath))
    fmt = kinds.layout_of(config_json)
    if target_info is not None:
        where = f"{cpath}: eagle_aux_hidden_state_layer_ids"
        target_info.check_layers(aux, field=where)
        for name, mine, theirs in (("hidden_size", config.hidden_size, target_info.hidden_size),
                                   ("vocab_size", config.vocab_size, target_info.vocab_size)):
            if mine != theirs:
                raise DraftsmithError(f"{cpath}: the drafter's {name} is {mine} but the target "
                                      f"{target_info.name} has {theirs}")
    check_tensors(wpath, expected_shapes(config, fmt), config, fmt=fmt)
    sd = load_file(str(wpath))
    check_vocab_maps(sd["d2t"], sd["t2d"], str(wpath))

    model = kinds.drafter_class(config)(config)
    has_embed = "embed_tokens.weight" in sd
    if not has_embed:
        if embed_weight is not None:
            if tuple(embed_weight.shape) != (config.vocab_size, config.hidden_size):
                raise DraftsmithError(f"{folder}: target embeddings are {list(embed_weight.shape)}, the drafter "
                                      f"needs [{config.vocab_size}, {config.hidden_size}]")
            sd["embed_tokens.weight"] = embed_weight.detach().to("cpu", torch.float32)
        else:
            sd["embed_tokens.weight"] = model.embed_tokens.weight.detach().zero_()
    param_sd = {name: sd[export] for name, export in {**export_keys(config, fmt), **OPTIONAL_KEYS}.items()}
    model.load_state_dict(param_sd, strict=True)
    model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    # to(dtype) casts floating tensors only: d2t (int64) and t2d (bool) keep theirs
    model.eval().requires_grad_(False)
    stored_dtype = next((str(t.dtype).removeprefix("torch.") for k, t in sd.items()
                         if k not in INDEX_KEYS and k != "embed_tokens.weight"), None)
    info = {
        "path": str(folder.resolve()),
        "config": config,
        "aux_layers": list(aux),
        "num_speculative_tokens": spec_tokens,
        "verifier": verifier,
        "has_embed_tokens": has_embed,
        "format": fmt,
        "dtype": stored_dtype,
        "draftsmith": config_json.get("draftsmith") or {},
    }
    return model, info


# -------------------------------------------------------------------------------------------------
# The stage


def _swap_into_place(built: Path, dest: Path) -> None:
    """Replace `dest` by the folder `built` (same parent): the stage's bookkeeping files move over
    first, then two renames; `dest` is never a mix of old and new exported files."""
    if dest.is_dir():
        for name in BOOKKEEPING:
            if (dest / name).exists():
                os.replace(dest / name, built / name)
    replace_dir(built, dest)


@dataclass
class _Checkpoint:
    """The checkpoint export reads, checked against the target (_read_checkpoint)."""

    folder: Path
    meta: dict  # drafter.json
    state: dict  # state.json
    config: Any  # its DrafterConfig
    kind: Any  # its kinds.Kind
    aux: list[int]  # the target layers its fc fuses
    info: Any  # the target's TargetInfo


def _read_checkpoint(run: RunDir, cfg, checkpoint: str | None) -> _Checkpoint:
    """The checkpoint to export (export.checkpoint, else train/final, else the newest complete one), refused in one
    line when it does not fit the configured target."""
    ckpt = find_checkpoint(run, checkpoint or cfg.export.checkpoint)
    train = run.path / "train"
    if ckpt.is_relative_to(train.resolve()) and (manifest := run.read_manifest("train")) is not None:
        # a checkpoint the train manifest recorded (train/final): its files as train wrote them, or refused
        rel = ckpt.relative_to(train.resolve()).as_posix()
        if bad := check_files(manifest, train, only={f"{rel}/{n}" for n in (CKPT_META, CKPT_WEIGHTS, CKPT_STATE)}):
            raise DraftsmithError(f"{bad} (changed since train finished; rerun `draftsmith train --run {run.path}`, "
                                  "or name another checkpoint in export.checkpoint)")
    meta_path = ckpt / CKPT_META
    meta = read_json_object(meta_path)
    state = read_json_object(ckpt / CKPT_STATE)
    config = drafter_config_from_meta(meta, str(meta_path))
    aux = _meta_aux_layers(meta, str(meta_path))
    if len(aux) != config.num_aux_layers:
        raise DraftsmithError(f"{meta_path}: {len(aux)} aux_layers but the drafter's fc fuses {config.num_aux_layers}")

    info = target_info(cfg.target, cfg.trust_remote_code)
    ck_name, ck_fp = _meta_target(meta)
    if ck_fp is not None and ck_fp != info.fingerprint:
        raise DraftsmithError(f"{meta_path}: the checkpoint was trained for target {ck_name or '?'} "
                              f"(fingerprint {ck_fp}), but target is {info.name} (fingerprint {info.fingerprint}); "
                              "set target to the model it was trained on")
    info.check_layers(aux, field=f"{meta_path}: aux_layers")
    if (config.hidden_size, config.vocab_size) != (info.hidden_size, info.vocab_size):
        raise DraftsmithError(f"{meta_path}: drafter hidden/vocab sizes {config.hidden_size}/{config.vocab_size} "
                              f"do not match target {info.name} ({info.hidden_size}/{info.vocab_size})")
    return _Checkpoint(ckpt, meta, state, config, kinds.get(config.kind), aux, info)


def _served_tensors(weights_path: Path, config, kind, out_dtype, fmt: str) -> dict:
    """The checkpoint's weights under the names of layout `fmt` (export.format) in `out_dtype` (the vocabulary maps
    as they are), with train.fc_input_norm's scale folded into fc."""
    check_tensors(weights_path, expected_shapes(config), config, allow_extra=(FC_INPUT_SCALE,))
    sd = load_file(str(weights_path))
    check_vocab_maps(sd["d2t"], sd["t2d"], str(weights_path))
    if FC_INPUT_SCALE in sd:  # train.fc_input_norm: fc(x * s) = (W diag(s)) x, a plain fc for vLLM
        s = sd.pop(FC_INPUT_SCALE).float()
        if tuple(s.shape) != (sd["fc.weight"].shape[1],):
            raise DraftsmithError(f"{weights_path}: tensor '{FC_INPUT_SCALE}' has shape {list(s.shape)}, "
                                  f"expected [{sd['fc.weight'].shape[1]}]")
        sd["fc.weight"] = sd["fc.weight"].float() * s[None, :]
        kind.fold_fc_scale(sd, s)
    return {export_name: (sd[name] if name in INDEX_KEYS else sd[name].to(out_dtype)).contiguous()
            for name, export_name in export_keys(config, fmt).items()}


@stage_run(STAGE)
def run_export(run: RunDir, cfg, checkpoint: str | None = None) -> dict:
    """Export a checkpoint (export.checkpoint, else train/final, else the newest complete one)
    to RUN/export/. Returns the manifest.

        read the checkpoint -> the book (up to date: the card rewritten, done) -> the served tensors and
        config.json -> the folder built beside RUN/export/ and checked -> swapped into place"""
    run.ensure()
    ck = _read_checkpoint(run, cfg, checkpoint)
    ckpt, meta, state, aux, info = ck.folder, ck.meta, ck.state, ck.aux, ck.info
    fmt = cfg.export.format
    ck.kind.check_format(fmt, ck.config, aux)  # what the layout cannot hold of this drafter, before anything is written
    book, inputs = _book(run, cfg, ck)
    dest = run.path / STAGE
    published = verifier_name(cfg.target, info, cfg.target_id)
    if base_model(published, cfg.export.base_model) is None:
        log(f"note: the model card has no base_model: the target {published!r} is not a Hub id (org/name); set "
            "export.base_model=ORG/NAME (the target's Hub id) to add it", stage=STAGE)
    if (old := book.skip_or_begin(outputs_ok=all((dest / f).is_file() for f in (CONFIG_FILE, WEIGHTS_FILE)),
                                  said=lambda m: f"step {m['counts'].get('step')}")) is not None:
        if why := write_card(run, dest, speculative_config(dest, kinds.served_tokens(meta)), cfg.export.repo_id,
                             base_model_id=cfg.export.base_model):
            log(f"warning: {why}", stage=STAGE)  # (export.repo_id may have changed: the card is rewritten here)
        return old  # up to date: same checkpoint, target and settings (`run` skips it)

    dtype_name = cfg.export.dtype
    out_dtype = getattr(torch, dtype_name)
    # RUN/export may be a link to another disk: the folder is built beside where it points (a rename stays on one
    # file system) and swapped in there, so the link is kept and the export lands where the user put it
    home = dest.resolve() if dest.is_symlink() else dest
    for stale in [*run.path.glob(f".{STAGE}.*.tmp"), *home.parent.glob(f".{home.name}.*.tmp")]:  # a crash's
        shutil.rmtree(stale, ignore_errors=True)

    with book.progress(total=1, unit="exports") as prog:
        prog.log(f"exporting {ckpt} (step {state.get('step', '?')}) for {info.name}, aux layers {aux}, "
                 f"dtype {dtype_name}")
        tensors = _served_tensors(ckpt / CKPT_WEIGHTS, ck.config, ck.kind, out_dtype, fmt)
        config_json = _export_config(run, ck, fmt, published, dtype_name)
        built = _build(run, cfg, home, tensors, config_json, ck, prog)
        prog.advance(1)
        size = (built / WEIGHTS_FILE).stat().st_size
        prog.end(checkpoint=str(ckpt), bytes=size)
    # after the journal is closed: its file moves with the other bookkeeping into the new folder
    _swap_into_place(built, home)
    return book.finish(counts={"done": 1, "total": 1, "unit": "exports", "bytes": size, "step": state.get("step")},
                       outputs=[CONFIG_FILE, WEIGHTS_FILE, CARD, PROVENANCE], inputs=inputs,
                       extra={"checkpoint": published_path(ckpt, run.path), "aux_layers": aux, "dtype": dtype_name,
                              "format": fmt},
                       checked=[CONFIG_FILE, WEIGHTS_FILE])  # the card is rewritten by eval: not the drafter


def summary(run: RunDir, manifest: dict) -> str:
    """The line `draftsmith export` prints when done."""
    return f"exported {manifest['checkpoint']} -> {run.stage_dir(STAGE)}"


def _book(run: RunDir, cfg, ck: _Checkpoint) -> tuple[StageBook, dict]:
    """(the stage's book, the inputs its fingerprint covers): the export settings, and the checkpoint itself (its
    place in the run and the sha256 of its weights and drafter.json), the train run's fingerprint and the target's,
    so that a changed checkpoint or target is exported again."""
    ck_sha = file_sha256(ck.folder / CKPT_WEIGHTS)
    train_manifest = run.read_manifest("train")
    settings = {**cfg.section(STAGE), "target_id": cfg.target_id}
    # repo_id and base_model: the card's alone, which run_export rewrites when up to date; format at its default:
    # the exports made before it existed stay up to date
    settings[STAGE] = fingerprinted(settings[STAGE], ("repo_id", "base_model"), {"format": kinds.FORMATS[0]})
    # the checkpoint relative to the run: a moved run stays up to date (and its manifest names no path of the move)
    inputs = {"checkpoint": published_path(ck.folder, run.path), "checkpoint_sha256": ck_sha,
              "drafter_json_sha256": file_sha256(ck.folder / CKPT_META),
              "train": (train_manifest or {}).get("fingerprint"), "target_fingerprint": ck.info.fingerprint}
    # No upstream manifest in the print: the checkpoint itself (its path and hashes) is the input.
    return StageBook(run, STAGE, cfg, settings=settings, fingerprint_extra={"inputs": inputs}), inputs


def _export_config(run: RunDir, ck: _Checkpoint, fmt: str, published: str, dtype_name: str) -> dict:
    """The export's config.json in layout `fmt` (the kind writes it), with its `draftsmith` block: what identifies
    the target and what training left, for eval, the card and whoever deploys the drafter."""
    info, meta, state = ck.info, ck.meta, ck.state
    return ck.kind.write_export(
        fmt, ck.config, ck.aux, target_name=published, target_arch=info.architecture,
        num_speculative_tokens=kinds.served_tokens(meta), dtype=dtype_name,
        # what identifies the target wherever the drafter is deployed: the name it is published as, its
        # architecture, the hash of its config.json, and the folder print training checked; what training
        # left (the kind, the steps it drafts, its validation figures: eval holds them against serving);
        # no path of this machine (the checkpoint relative to the run)
        draftsmith={"version": __version__, "kind": ck.kind.name, "target": info.name,
                    "target_id": published, "target_architecture": info.architecture,
                    "target_config_sha256": config_sha256(info), "target_fingerprint": info.fingerprint,
                    "checkpoint": published_path(ck.folder, run.path), "step": state.get("step"),
                    "ttt_steps": kinds.served_tokens(meta), "aux_layers_trained": ck.aux,
                    "vocab_fingerprint": meta.get("vocab_fingerprint"), "validation": state.get("validation"),
                    # of how many validation passes (train/best: the figure is their maximum)
                    "validation_passes": state.get("validation_passes"),
                    # the released drafter training started from (train.init_from; no local path in it)
                    **({"init_from": meta["init_from"]} if meta.get("init_from") else {}),
                    "exported": time.time()},
    )


def _build(run: RunDir, cfg, home: Path, tensors: dict, config_json: dict, ck: _Checkpoint, prog: Progress) -> Path:
    """The export, built in a new folder beside `home` (one file system: _swap_into_place renames it in): the
    weights and config.json, fsynced and read back, and the model card. A failure removes the folder, so no
    half-built export is left behind."""
    home.parent.mkdir(parents=True, exist_ok=True)
    built = Path(tempfile.mkdtemp(prefix=f".{home.name}.", suffix=".tmp", dir=home.parent))
    try:
        save_file(tensors, str(built / WEIGHTS_FILE), metadata={"format": "pt"})
        (built / CONFIG_FILE).write_text(json.dumps(config_json, indent=2) + "\n", encoding="utf-8")
        for name in (WEIGHTS_FILE, CONFIG_FILE):
            with open(built / name, "rb") as f:
                os.fsync(f.fileno())
        # read back through the same checks a user's load goes through
        load_exported(built, target_info=ck.info)
        if why := write_card(run, built, speculative_config(built, kinds.served_tokens(ck.meta)), cfg.export.repo_id,
                             reports=False, base_model_id=cfg.export.base_model):
            prog.log(f"warning: {why}")
    except BaseException:
        shutil.rmtree(built, ignore_errors=True)
        raise
    return built
