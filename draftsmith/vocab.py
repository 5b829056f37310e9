"""The `vocab` stage: the draft vocabulary, from token frequencies under the loss mask.

The drafter predicts over a small vocabulary (`vocab.draft_vocab_size` tokens) instead of the
target's full one: the most frequent target tokens among those it is trained to predict (the
loss-masked ones), counted without the samples validation holds out (draftsmith/heldout.py, the split train
makes from the same ids and settings): a held-out answer then misses for an out-of-vocabulary token as a fresh
prompt's does, and the coverage reported is that of the training answers. Ties go to the smaller token id;
when fewer distinct tokens occur than the size asks for, the lowest unused ids fill the rest, so the result is
the same on every run.

Outputs (docs/run-directory.md), both written atomically:
- `vocab/vocab.safetensors`: `d2t` int64 [draft_vocab_size] (target id = draft id + d2t[draft id],
  draft ids in increasing target-id order, as vLLM and the EAGLE-3 reference expect), `t2d` bool
  [target_vocab_size], `counts` int64 [target_vocab_size]; its metadata carries the fingerprint.
- `vocab/vocab.json`: sizes, coverage, counts, the target and prepare fingerprints.

With train.init_from and train.init_vocab=keep (draftsmith/released.py) the vocabulary is the released drafter's
own d2t/t2d, of its size, not counted: the stage still counts the answers' tokens and reports the coverage those
maps reach on them, and vocab.json names the drafter (`init_from`).

Later stages read it with `load_vocab`, which refuses a vocabulary built for another target, size
or prepared data.
"""


import json
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.numpy import save_file

from draftsmith import DraftsmithError, heldout
from draftsmith.journal import fmt_count
from draftsmith.prepared_format import iter_prepared, prepared_groups
from draftsmith.progress import log
from draftsmith.released import draft_vocab_size, open_released, vocab_maps
from draftsmith.rundir import RunDir, atomic_path, atomic_write_json
from draftsmith.stage import StageBook, check_target, stage_run, upstream
from draftsmith.target import target_info

STAGE = "vocab"
VOCAB_VERSION = 1
# Masked token ids are buffered and counted in one bincount per this many (a bincount per sample
# would allocate a target-vocab-sized array each time).
COUNT_CHUNK = 1 << 20



def select_draft_vocab(counts, draft_vocab_size: int):
    """(d2t [Dv] int64, t2d [V] bool) for the `draft_vocab_size` most frequent ids of `counts` [V].

    Ties (including the zero counts that fill a vocabulary larger than the tokens seen) go to the
    smaller id.
    """
    counts = np.asarray(counts, dtype=np.int64)
    v = counts.shape[0]
    if draft_vocab_size > v:
        raise DraftsmithError(f"vocab.draft_vocab_size: {draft_vocab_size} is larger than the target vocabulary "
                              f"({v} tokens)")
    ids = np.arange(v, dtype=np.int64)
    # lexsort sorts by the last key first: descending count, then ascending id.
    order = np.lexsort((ids, -counts))
    chosen = np.sort(order[:draft_vocab_size])
    d2t = chosen - np.arange(draft_vocab_size, dtype=np.int64)
    t2d = np.zeros(v, dtype=bool)
    t2d[chosen] = True
    return d2t, t2d


def held_out_ids(run: RunDir, tc) -> set[str]:
    """The sample ids validation holds out (draftsmith/heldout.py) under train config `tc`, from prepare's ids."""
    if heldout.settings(tc) is None:
        return set()
    ids = [str(rec["id"]) for _, rec, _, _ in iter_prepared(run)]
    return {ids[i] for i in heldout.split_of(tc, ids, prepared_groups(run)).indices}


def count_masked_tokens(run: RunDir, vocab_size: int, prog=None, skip: set[str] = frozenset()):
    """Frequencies [V] int64 of target tokens under the loss mask of prepare/samples.jsonl, the samples in `skip`
    left out; (counts, samples counted, loss-masked tokens of the samples left out)."""
    path = run.stage_dir("prepare", create=False) / "samples.jsonl"
    counts = np.zeros(vocab_size, dtype=np.int64)
    buf: list = []
    buffered = 0
    samples = skipped = 0
    for i, rec, ids, mask in iter_prepared(run):
        if str(rec["id"]) in skip:
            skipped += int(mask.sum())
            if prog is not None:
                prog.advance(1)
            continue
        masked = ids[mask]
        if masked.size and (masked.min() < 0 or masked.max() >= vocab_size):
            raise DraftsmithError(f"{path}:{i + 1}: token id {int(masked.max())} is outside the target vocabulary "
                                  f"({vocab_size})")
        buf.append(masked)
        buffered += masked.size
        samples += 1
        if buffered >= COUNT_CHUNK:
            counts += np.bincount(np.concatenate(buf), minlength=vocab_size)
            buf, buffered = [], 0
        if prog is not None:
            prog.advance(1)
    if buf:
        counts += np.bincount(np.concatenate(buf), minlength=vocab_size)
    return counts, samples, skipped


@stage_run(STAGE)
def run_vocab(run: RunDir, cfg) -> dict:
    """Build vocab/vocab.safetensors and vocab/vocab.json; returns the manifest."""
    say = lambda msg: log(msg, stage=STAGE)  # noqa: E731 (before the progress journal opens)
    prep = upstream(run, "prepare", by="draftsmith vocab")
    info = target_info(cfg.target, cfg.trust_remote_code, log=say)
    check_target(run, "prepare", prep, info)
    rel = open_released(cfg, info)
    kept = rel if rel is not None and rel.keeps_vocab else None  # train.init_vocab=keep: the drafter's own
    size = draft_vocab_size(cfg, rel)
    if size > info.vocab_size:
        raise DraftsmithError(
            f"vocab.draft_vocab_size: {size} is larger than the vocabulary of target {info.name} "
            f"({info.vocab_size} tokens)")
    tc = cfg.train
    # the held-out split's settings are vocab's too: the samples it leaves out of the counts
    settings = {**cfg.section(STAGE), "version": VOCAB_VERSION, "held_out": heldout.settings(tc)}
    if kept is not None:  # its maps are the output: their contents in the print (a run without one keeps its own)
        settings["init_from"] = kept.settings()
    book = StageBook(run, STAGE, cfg, settings=settings, upstream={"prepare": prep}, target=info)
    fp = book.fingerprint
    d = run.stage_dir(STAGE)
    st_path, json_path = d / "vocab.safetensors", d / "vocab.json"
    if (old := book.skip_or_begin(outputs_ok=st_path.is_file() and json_path.is_file(),
                                  said=lambda m: f"coverage {m['counts'].get('coverage', 0):.1%}")) is not None:
        return old

    n_samples = int(prep.get("counts", {}).get("done") or 0) or None
    with book.progress(total=n_samples, unit="samples") as prog:
        held = held_out_ids(run, tc)
        counts, samples, skipped = count_masked_tokens(run, info.vocab_size, prog, held)
        total = int(counts.sum())
        prep_path = run.manifest_path("prepare")
        expected = prep.get("counts", {}).get("masked_tokens")
        if expected is not None and expected != total + skipped:
            raise DraftsmithError(
                f"{prep_path.parent / 'samples.jsonl'}: holds {total + skipped} loss-masked tokens but {prep_path} "
                f"records {expected}; the file changed after prepare finished, rerun `draftsmith prepare`")
        if total == 0:
            raise DraftsmithError(f"{prep_path.parent / 'samples.jsonl'}: no loss-masked tokens to count")
        distinct = int((counts > 0).sum())
        d2t, t2d = select_draft_vocab(counts, size) if kept is None else vocab_maps(kept, info)
        covered = int(counts[t2d].sum())
        coverage = covered / total
        filled = max(0, size - distinct) if kept is None else 0
        whose = "" if kept is None else f" (kept from the released drafter {kept.source}, train.init_vocab=keep)"
        prog.log(f"draft vocab {size} of {info.vocab_size}{whose} covers {coverage:.1%} of {fmt_count(total)} "
                 f"loss-masked tokens ({distinct} distinct tokens seen"
                 + (f"; {filled} unseen ids fill the rest" if filled else "")
                 + (f"; the {len(held)} samples validation holds out not counted" if held else "") + ")")

        vocab_info = {
            "draft_vocab_size": size, "target_vocab_size": info.vocab_size, "coverage": coverage,
            "tokens_counted": total, "tokens_covered": covered, "distinct_tokens": distinct, "filled": filled,
            "samples_counted": samples, "held_out_samples": len(held), "target": info.name,
            "target_fingerprint": info.fingerprint,
            "prepare_fingerprint": prep.get("fingerprint"), "fingerprint": fp,
        }
        if kept is not None:
            vocab_info["init_from"] = kept.record(run.path)
        meta = {k: str(vocab_info[k])
                for k in ("fingerprint", "prepare_fingerprint", "target_fingerprint", "draft_vocab_size")}
        with atomic_path(st_path) as tmp:
            save_file({"d2t": d2t, "t2d": t2d, "counts": counts}, str(tmp), metadata=meta)
        atomic_write_json(json_path, vocab_info)
        manifest_counts = {"done": samples + len(held), "total": samples + len(held), "unit": "samples",
                           "held_out": len(held), "coverage": coverage,
                           "tokens_counted": total, "distinct_tokens": distinct, "filled": filled}
        manifest = book.finish(counts=manifest_counts, outputs=["vocab.safetensors", "vocab.json"],
                               extra={"coverage": coverage})
        prog.end(coverage=round(coverage, 6), draft_vocab_size=size)
    return manifest


def load_vocab(run: RunDir, expect_target_fingerprint: str | None = None, expect_size: int | None = None,
               by: str = "this stage") -> tuple[Any, Any, dict]:
    """(d2t int64 [Dv], t2d bool [V], info from vocab.json) of a completed vocab stage.

    Refuses (DraftsmithError naming the file) a vocabulary built for another target
    (`expect_target_fingerprint`), of another size (`expect_size`), from other prepared data than
    the current prepare/manifest.json, or whose two files do not come from the same build.
    """
    manifest = run.require_manifest(STAGE, by=by)
    d = run.stage_dir(STAGE, create=False)
    json_path, st_path = d / "vocab.json", d / "vocab.safetensors"
    try:
        info = json.loads(json_path.read_text())
    except (OSError, ValueError) as e:
        raise DraftsmithError(f"{json_path}: cannot read ({e}); rerun `draftsmith vocab --run {run.path}`") from None
    rerun = f"rerun `draftsmith vocab --run {run.path}`"
    if info.get("fingerprint") != manifest.get("fingerprint"):
        raise DraftsmithError(f"{json_path}: does not belong to {run.manifest_path(STAGE)} (another build); {rerun}")
    if expect_target_fingerprint is not None and info.get("target_fingerprint") != expect_target_fingerprint:
        raise DraftsmithError(
            f"{json_path}: built for another target "
            f"({info.get('target')}, fingerprint {info.get('target_fingerprint')}) "
            f"than the current one ({expect_target_fingerprint}); {rerun}")
    if expect_size is not None and info.get("draft_vocab_size") != expect_size:
        raise DraftsmithError(
            f"{json_path}: draft vocabulary of {info.get('draft_vocab_size')} tokens, but vocab.draft_vocab_size is "
            f"{expect_size}; {rerun}")
    prep = run.read_manifest("prepare")
    if prep is not None and prep.get("fingerprint") != info.get("prepare_fingerprint"):
        raise DraftsmithError(f"{json_path}: built from other prepared data than the current prepare stage; {rerun}")
    try:
        with safe_open(str(st_path), framework="numpy") as f:
            meta = f.metadata() or {}
            d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise DraftsmithError(f"{st_path}: cannot read ({type(e).__name__}: {e}); {rerun}") from None
    if meta.get("fingerprint") != info.get("fingerprint"):
        raise DraftsmithError(f"{st_path}: does not belong to {json_path} (another build); {rerun}")
    dv, v = info["draft_vocab_size"], info["target_vocab_size"]
    if d2t.shape != (dv,) or t2d.shape != (v,) or int(t2d.sum()) != dv:
        raise DraftsmithError(f"{st_path}: d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not match "
                              f"{dv} of {v} tokens")
    if not np.array_equal(np.arange(dv) + d2t, np.flatnonzero(t2d)):
        raise DraftsmithError(f"{st_path}: d2t and t2d disagree; {rerun}")
    return torch.from_numpy(d2t.astype(np.int64)), torch.from_numpy(t2d.astype(bool)), info
