"""extract.backend=hf: the target's hidden states from a transformers forward in this process.

- capture: target.capture.HiddenCapture (forward pre-hooks on the decoder layers; the LM head never runs).
- batches: within a shard, samples sorted by length (longest first) and packed while
  `batch size x longest length <= extract.batch_tokens`, right-padded. Right padding under a
  causal mask cannot change a real token's state (it only attends to earlier, real tokens), and
  position ids are explicit 0..L-1 per row, so each sample's states equal a one-sample forward.
- writing: store.ShardWriter, threads that encode, hash and write while the next batch computes.

make_batch also serves online training (train.mode=online), with the same capture, so its states
equal what this backend stores.
"""

import time

import torch

from draftsmith.extract.store import STAGE, ShardWriter
from draftsmith.prepared_format import Prepared
from draftsmith.rundir import RunDir
from draftsmith.target import load_target
from draftsmith.target.capture import HiddenCapture

# -------------------------------------------------------------------------------------------------
# Batches


def plan_batches(indices: list[int], lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group samples by length: longest first, each batch's (count x longest) <= batch_tokens.

    A sample longer than batch_tokens gets a batch of its own. Deterministic for a given set of
    indices, so any rank split of whole shards sees the same batches as a single process.
    """
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def make_batch(samples: list[dict], pad_id: int = 0):
    """Right-padded `input_ids` [B, T] and explicit `position_ids` 0..T-1 per row (int64)."""
    T = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), T), pad_id, dtype=torch.long)
    for b, s in enumerate(samples):
        ids[b, : len(s["input_ids"])] = torch.tensor(s["input_ids"], dtype=torch.long)
    pos = torch.arange(T, dtype=torch.long).unsqueeze(0).expand(len(samples), T)
    return ids, pos


# -------------------------------------------------------------------------------------------------
# The extract stage's loop for this backend (extract.stage.run_extract does everything else)


def extract_shards(run: RunDir, cfg, target, layers: list[int], prepared: Prepared, shards, todo, prog) -> dict:
    """The compute loop: forward each length-grouped batch, hand it to the writer thread.
    `target`: a loaded draftsmith.target.Target, or None to load it here when there is work."""
    d = run.stage_dir(STAGE)
    stats = {"samples": 0, "tokens": 0, "computed": 0, "padded": 0, "seconds": 0.0, "bytes": 0, "padding": 0.0}
    if any(todo[s] for s in shards) and target is None:
        with prog.busy("loading target"):
            target = load_target(cfg.target, cfg.device, cfg.dtype, cfg.trust_remote_code, log=prog.log)
    capture = HiddenCapture(target.model, layers) if target is not None else None
    # progress counts a sample once its file is committed (fsynced and renamed: ShardWriter calls on_written from its
    # committer thread, at least every COMMIT_S), so the journal never counts a file that is not on disk
    writer = ShardWriter(d, layers, on_written=prog.advance, threads=cfg.extract.writers,
                         fmt=cfg.extract.format)
    t0 = time.time()
    try:
        with torch.inference_mode():
            for s in shards:
                missing = set(todo[s])
                # Batches are planned over the whole shard, not over what is missing: a resumed
                # attempt then computes each sample in the batch it had in an uninterrupted run
                # (same padded length, same kernels), so its file is the same bytes. Finished
                # members of a batch are computed again but not rewritten.
                for batch in plan_batches(list(range(*s)), prepared.lengths, cfg.extract.batch_tokens):
                    keep = [b for b, i in enumerate(batch) if i in missing]
                    if not keep:
                        continue
                    samples = prepared.read(batch)
                    rows = [samples[i] for i in batch]
                    ids, pos = make_batch(rows)
                    aux, last = capture(ids.to(target.device), pos.to(target.device))
                    if len(keep) < len(batch):
                        aux, last = aux[keep], last[keep]
                    writer.write_batch(s, [batch[b] for b in keep], [rows[b] for b in keep], aux, last)
                    stats["samples"] += len(keep)
                    stats["tokens"] += sum(len(rows[b]["input_ids"]) for b in keep)
                    stats["computed"] += sum(len(r["input_ids"]) for r in rows)
                    stats["padded"] += ids.numel()
                writer.finish_shard(s)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        if capture is not None:
            capture.remove()
    stats["seconds"] = time.time() - t0
    stats["bytes"] = writer.bytes_written
    stats["padding"] = 1 - stats["computed"] / stats["padded"] if stats["padded"] else 0.0
    return stats

