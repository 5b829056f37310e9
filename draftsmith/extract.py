"""The `extract` stage: run the target over the prepared samples and store, per sample, what
offline training needs: the hidden states entering the auxiliary layers and the target's final
normed hidden state (target logits = lm_head(last_hidden)).

Two backends fill the same store: `hf` (below: a transformers forward in this process) and
`vllm` (draftsmith/extract_vllm.py: vLLM servers with the extract_hidden_states method, for
targets too big for one process). Only how a sample's states are obtained differs; the files,
shard records, preflight, resume and --verify are the same.

Layout (docs/run-directory.md, "extract/"):

    extract/meta.json                        target, layers, prepare fingerprint, lengths, ...
    extract/rows_{start}-{end}/{i}.safetensors   one file per sample i (global prepare index)
    extract/rows_{start}-{end}/shard.json    written once every file of the shard is complete
    extract/manifest.json                    written when every shard is complete

How it runs:
- capture: forward pre-hooks on the decoder layers keep the input of layer k (= HF
  `output_hidden_states[k]`, vLLM's aux layer id k); the base model (`model.model`) gives the
  final normed state; the LM head never runs and the other N+1-4 states are never kept.
- batches: within a shard, samples sorted by length (longest first) and packed while
  `batch size x longest length <= extract.batch_tokens`, right-padded. Right padding under a
  causal mask cannot change a real token's state (it only attends to earlier, real tokens), and
  position ids are explicit 0..L-1 per row, so each sample's states equal a one-sample forward.
- writing: a writer thread (bounded queue) serialises, hashes and atomically writes the files
  while the next batch computes.
- resume: a file under its final name is done; temp files are removed; `--verify` re-reads
  every finished file (and shard.json checksums) and redoes the bad ones.
- scale-out: shard i belongs to rank i % world_size; the last rank to finish writes the manifest.
- failures (vllm only): a sample whose states fail after retries is listed in failures.jsonl, its
  shard stays unsealed and the stage fails once the others are stored; a rerun retries it.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import queue
import shutil
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from draftsmith import DraftsmithError
from draftsmith.progress import journal_failures
from draftsmith.rundir import (
    RunDir,
    atomic_write_bytes,
    atomic_write_json,
    file_sha256,
    is_temp_name,
    stage_fingerprint,
    write_stage_config,
)

STAGE = "extract"
META = "meta.json"
SHARD_RECORD = "shard.json"
FAILURES = "failures.jsonl"  # backend vllm: samples that failed in the last attempt
LOCK = ".extract.lock"
FORMAT_VERSION = 1
FIELDS = ("input_ids", "loss_mask", "aux_hidden", "last_hidden")
STORE_DTYPE = "bfloat16"
# Meta keys that must match for files of two attempts to live in one store.
COMPAT_KEYS = ("format", "target_fingerprint", "layers", "hidden_size", "dtype", "compute_dtype",
               "prepare_fingerprint", "num_samples", "shard_size")
FILE_OVERHEAD = 1024  # bytes per sample file beyond the tensors: safetensors header + metadata


# -------------------------------------------------------------------------------------------------
# Shards


def shard_ranges(num_samples: int, shard_size: int) -> list[tuple[int, int]]:
    """[(start, end)] covering 0..num_samples-1, end exclusive."""
    return [(s, min(s + shard_size, num_samples)) for s in range(0, num_samples, shard_size)]


def shard_name(start: int, end: int) -> str:
    return f"rows_{start}-{end}"


def sample_name(index: int) -> str:
    return f"{index}.safetensors"


def bytes_per_token(num_aux: int, hidden_size: int) -> int:
    """Bytes on disk per token: (aux + last) bf16 states, an int32 id and a uint8 mask."""
    return (num_aux + 1) * hidden_size * 2 + 4 + 1


# -------------------------------------------------------------------------------------------------
# The prepared samples (prepare/samples.jsonl), read by offset so a big file never sits in memory


@dataclass
class Prepared:
    path: Path
    offsets: list[int]  # byte offset of each line
    lengths: list[int]  # tokens per sample

    def __len__(self) -> int:
        return len(self.lengths)

    def read(self, indices: list[int]) -> dict[int, dict]:
        out = {}
        with open(self.path, "rb") as f:
            for i in sorted(indices):
                f.seek(self.offsets[i])
                out[i] = json.loads(f.readline())
        return out


def index_prepared(path: Path, vocab_size: int) -> Prepared:
    """Scan prepare/samples.jsonl once: offsets, lengths and ids; validate every record."""
    offsets, lengths = [], []
    seen: set[str] = set()
    pos = 0
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            where = f"{path}:{line_no}"
            start, pos = pos, pos + len(line)
            if not line.strip():
                raise DraftsmithError(f"{where}: empty line; rerun `draftsmith prepare`")
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DraftsmithError(f"{where}: invalid JSON ({e.msg}); rerun `draftsmith prepare`") from None
            tokens = rec.get("input_ids") if isinstance(rec, dict) else None
            mask = rec.get("loss_mask") if isinstance(rec, dict) else None
            if not isinstance(tokens, list) or not isinstance(mask, list) or "id" not in rec:
                raise DraftsmithError(f"{where}: expected {{\"id\", \"input_ids\", \"loss_mask\"}}")
            if not tokens or len(tokens) != len(mask):
                raise DraftsmithError(f"{where}: input_ids ({len(tokens)}) and loss_mask ({len(mask)}) must be non-empty and equally long")
            if min(tokens) < 0 or max(tokens) >= vocab_size:
                bad = max(tokens) if max(tokens) >= vocab_size else min(tokens)
                raise DraftsmithError(f"{where}: token id {bad} is outside the target's vocabulary (size {vocab_size}); "
                                      "was prepare run with another tokenizer?")
            sid = str(rec["id"])
            if sid in seen:
                raise DraftsmithError(f"{where}: duplicate sample id {sid!r}")
            seen.add(sid)
            offsets.append(start)
            lengths.append(len(tokens))
    return Prepared(path=path, offsets=offsets, lengths=lengths)


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


# -------------------------------------------------------------------------------------------------
# Capture: one forward of the base model with pre-hooks on the auxiliary layers


def decoder_parts(model):
    """(base model that returns the final normed state, its list of decoder layers)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if base is None or layers is None:
        raise DraftsmithError(f"target: cannot find the decoder layers of {type(model).__name__} "
                              "(expected model.model.layers, as in Llama-style models)")
    return base, layers


class HiddenCapture:
    """Runs the target's base model once per batch and returns the states training needs.

    `__call__(input_ids [B, T], position_ids [B, T]) -> (aux [B, T, A, H], last [B, T, H])`,
    on the model's device and in its dtype; aux in layer-id order.
    """

    def __init__(self, model, layers: list[int]):
        self.base, decoder_layers = decoder_parts(model)
        self.layers = list(layers)
        self._captured: dict[int, Any] = {}
        self._handles = [decoder_layers[k].register_forward_pre_hook(self._hook(k), with_kwargs=True)
                         for k in self.layers]

    def _hook(self, k: int):
        def hook(module, args, kwargs):
            # The input of decoder layer k is the residual stream after layers 0..k-1: HF's
            # hidden_states[k]. Llama-style layers take it positionally, others by keyword.
            self._captured[k] = args[0] if args else kwargs["hidden_states"]
        return hook

    def __call__(self, input_ids, position_ids):
        import torch

        self._captured.clear()
        # No attention_mask on purpose: rows are right-padded, so under the causal mask a real
        # token never sees a pad; leaving it out keeps SDPA on its fast is_causal path.
        out = self.base(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        aux = torch.stack([self._captured[k] for k in self.layers], dim=2)  # [B, T, A, H]
        self._captured.clear()
        return aux, out.last_hidden_state

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def make_batch(samples: list[dict], pad_id: int = 0):
    """Right-padded `input_ids` [B, T] and explicit `position_ids` 0..T-1 per row (int64)."""
    import torch

    T = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), T), pad_id, dtype=torch.long)
    for b, s in enumerate(samples):
        ids[b, : len(s["input_ids"])] = torch.tensor(s["input_ids"], dtype=torch.long)
    pos = torch.arange(T, dtype=torch.long).unsqueeze(0).expand(len(samples), T)
    return ids, pos


# -------------------------------------------------------------------------------------------------
# Writing: a thread that serialises, hashes and atomically writes sample files and shard records


def sample_tensors(sample: dict, aux, last) -> dict:
    """The tensors of one sample file; aux [T, A, H] and last [T, H] are cut to its length L."""
    import torch

    L = len(sample["input_ids"])
    return {
        "input_ids": torch.tensor(sample["input_ids"], dtype=torch.int32),
        "loss_mask": torch.tensor(sample["loss_mask"], dtype=torch.uint8),
        # clone(): a slice of the batch tensor shares its storage; the file must hold just [L, ...]
        "aux_hidden": aux[:L].to(torch.bfloat16).clone(),
        "last_hidden": last[:L].to(torch.bfloat16).clone(),
    }


def canonical_safetensors(data: bytes) -> bytes:
    """The same safetensors file with its JSON header's keys sorted.

    safetensors emits the header from a hash map, so key order (of the metadata) changes from one
    process to the next; sorted, equal tensors give byte-equal files and checksums whichever
    process or rank wrote them. The header stays padded to a multiple of 8 bytes.
    """
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8: 8 + n])
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data[8 + n:]


def encode_sample(index: int, sample: dict, aux, last, layers: list[int]) -> bytes:
    from safetensors.torch import save

    meta = {"id": str(sample["id"]), "index": str(index), "layers": json.dumps(list(layers))}
    return canonical_safetensors(save(sample_tensors(sample, aux, last), metadata=meta))


class ShardWriter:
    """Writes finished batches and shard records on a background thread.

    The queue is bounded (`depth` batches) so compute can run ahead of the disk by at most that
    much memory. An error on the thread is raised in the caller at its next `put` or `close`.
    """

    def __init__(self, stage_dir: Path, layers: list[int], on_written=None, depth: int = 2):
        self.stage_dir = stage_dir
        self.layers = layers
        self.on_written = on_written or (lambda n: None)
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.records: dict[tuple[int, int], dict[str, dict]] = {}  # shard -> name -> {size, sha256}
        self.bytes_written = 0
        self.files_written = 0
        self._thread = threading.Thread(target=self._loop, name="extract-writer", daemon=True)
        self._thread.start()

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def put(self, item) -> None:
        while True:
            self._check()
            try:
                self.q.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def write_batch(self, shard: tuple[int, int], indices: list[int], samples: list[dict], aux, last) -> None:
        self.put(("batch", shard, indices, samples, aux, last))

    def finish_shard(self, shard: tuple[int, int]) -> None:
        self.put(("shard", shard))

    def close(self) -> None:
        if self._thread.is_alive():
            self.put(None)
            self._thread.join()
        self._check()

    def abort(self) -> None:
        """Stop without raising (the caller is already failing): drop what is queued."""
        with contextlib.suppress(queue.Empty):
            while True:
                self.q.get_nowait()
        with contextlib.suppress(queue.Full):
            self.q.put_nowait(None)
        self._thread.join(timeout=60)

    def _loop(self) -> None:
        import torch

        try:
            with torch.inference_mode():
                while (item := self.q.get()) is not None:
                    if item[0] == "batch":
                        self._write_batch(*item[1:])
                    else:
                        self._write_shard_record(item[1])
        except BaseException as e:  # surfaced to the main thread by _check()
            self.error = e

    def _write_batch(self, shard, indices, samples, aux, last) -> None:
        d = self.stage_dir / shard_name(*shard)
        d.mkdir(parents=True, exist_ok=True)
        aux, last = aux.cpu(), last.cpu()
        for b, (i, s) in enumerate(zip(indices, samples)):
            data = encode_sample(i, s, aux[b], last[b], self.layers)
            atomic_write_bytes(d / sample_name(i), data)
            self.records.setdefault(shard, {})[sample_name(i)] = {
                "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            self.bytes_written += len(data)
            self.files_written += 1
        self.on_written(len(indices))

    def _write_shard_record(self, shard) -> None:
        write_shard_record(self.stage_dir, shard, self.layers, self.records.pop(shard, {}))


def write_shard_record(stage_dir: Path, shard: tuple[int, int], layers: list[int], known: dict[str, dict]) -> dict:
    """Write rows_*/shard.json: every file's name, size and sha256 (hashing the files written by
    an earlier attempt, whose bytes are not in memory)."""
    d = stage_dir / shard_name(*shard)
    files = []
    for i in range(*shard):
        name = sample_name(i)
        rec = known.get(name)
        if rec is None:
            p = d / name
            if not p.is_file():
                raise DraftsmithError(f"{p}: missing while closing shard {d.name}")
            rec = {"size": p.stat().st_size, "sha256": file_sha256(p)}
        files.append({"name": name, **rec})
    record = {"start": shard[0], "end": shard[1], "layers": list(layers), "files": files,
              "bytes": sum(f["size"] for f in files), "finished": time.time()}
    atomic_write_json(d / SHARD_RECORD, record)
    return record


# -------------------------------------------------------------------------------------------------
# Checking finished files (--verify)


def check_sample_file(path: Path, index: int, sample: dict, layers: list[int], hidden_size: int) -> str | None:
    """None when the file is a complete, consistent sample file; else what is wrong with it."""
    import torch
    from safetensors import safe_open

    L = len(sample["input_ids"])
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            meta = f.metadata() or {}
            if keys != set(FIELDS):
                return f"fields {sorted(keys)}, expected {list(FIELDS)}"
            t = {k: f.get_tensor(k) for k in FIELDS}
    except Exception as e:  # safetensors raises its own error type for cut or garbled files
        return f"unreadable ({type(e).__name__}: {e})"
    expect = {
        "input_ids": (torch.int32, (L,)), "loss_mask": (torch.uint8, (L,)),
        "aux_hidden": (torch.bfloat16, (L, len(layers), hidden_size)), "last_hidden": (torch.bfloat16, (L, hidden_size)),
    }
    for k, (dt, shape) in expect.items():
        if t[k].dtype != dt or tuple(t[k].shape) != shape:
            return f"{k} is {t[k].dtype} {tuple(t[k].shape)}, expected {dt} {shape}"
    if meta.get("index") != str(index) or meta.get("id") != str(sample["id"]) or meta.get("layers") != json.dumps(list(layers)):
        return f"metadata {meta} does not match sample {index} ({sample['id']!r}, layers {layers})"
    if t["input_ids"].tolist() != list(sample["input_ids"]) or t["loss_mask"].tolist() != list(sample["loss_mask"]):
        return "input_ids/loss_mask differ from prepare/samples.jsonl"
    if not (torch.isfinite(t["aux_hidden"]).all() and torch.isfinite(t["last_hidden"]).all()):
        return "non-finite hidden states"
    return None


def verify_shard(stage_dir: Path, shard: tuple[int, int], prepared: Prepared, layers: list[int], hidden_size: int,
                 log) -> int:
    """Check a shard's finished files (and its shard.json checksums); delete the bad ones.

    Returns how many files were removed. A shard that loses a file loses its shard.json too.
    """
    d = stage_dir / shard_name(*shard)
    if not d.is_dir():
        return 0
    bad: dict[int, str] = {}
    rec_path = d / SHARD_RECORD
    if rec_path.is_file():
        try:
            record = {f["name"]: f for f in json.loads(rec_path.read_text())["files"]}
        except (json.JSONDecodeError, KeyError, TypeError):
            record = {}
            log(f"{rec_path}: unreadable; it will be rewritten")
            rec_path.unlink()
        for i in range(*shard):
            p, r = d / sample_name(i), record.get(sample_name(i))
            if r is not None and p.is_file() and (p.stat().st_size != r["size"] or file_sha256(p) != r["sha256"]):
                bad[i] = "checksum differs from shard.json"
    present = [i for i in range(*shard) if (d / sample_name(i)).is_file() and i not in bad]
    samples = prepared.read(present)
    for i in present:
        problem = check_sample_file(d / sample_name(i), i, samples[i], layers, hidden_size)
        if problem:
            bad[i] = problem
    for i, why in sorted(bad.items()):
        log(f"verify: {d.name}/{sample_name(i)}: {why}; redoing it")
        (d / sample_name(i)).unlink()
    if bad:
        with contextlib.suppress(FileNotFoundError):
            rec_path.unlink()
    return len(bad)


# -------------------------------------------------------------------------------------------------
# The stage


@contextlib.contextmanager
def _stage_lock(stage_dir: Path) -> Iterator[None]:
    """Serialise store set-up and the final manifest between ranks sharing the run folder."""
    with open(stage_dir / LOCK, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _clear_store(stage_dir: Path) -> None:
    for p in stage_dir.iterdir():
        if p.is_dir() and p.name.startswith("rows_"):
            shutil.rmtree(p)
    for name in (META, "manifest.json"):
        with contextlib.suppress(FileNotFoundError):
            (stage_dir / name).unlink()


def _open_store(run: RunDir, cfg, meta: dict, fingerprint: str, overwrite: bool) -> None:
    """Make extract/meta.json describe this attempt, refusing to mix incompatible files."""
    d = run.stage_dir(STAGE)
    old_path = d / META
    old = None
    if old_path.is_file():
        try:
            old = json.loads(old_path.read_text())
        except json.JSONDecodeError:
            old = {}
    has_files = any(p.is_dir() and p.name.startswith("rows_") for p in d.iterdir())
    if old is not None or has_files:
        diff = [k for k in COMPAT_KEYS if (old or {}).get(k) != meta[k]]
        if diff:
            if not overwrite:
                what = ", ".join(f"{k} {(old or {}).get(k)!r} -> {meta[k]!r}" if k not in ("prepare_fingerprint", "target_fingerprint")
                                 else f"{k} changed" for k in diff)
                raise DraftsmithError(
                    f"{old_path}: the existing store was built differently ({what}); use a new run dir, "
                    "or --set extract.overwrite=true to delete it and start over")
            from draftsmith.progress import log

            log(f"replacing the store in {d}: it was built differently ({', '.join(diff)} changed)", stage=STAGE)
            _clear_store(d)
            old = None
    manifest = run.read_manifest(STAGE)
    if manifest is not None and manifest.get("fingerprint") != fingerprint:
        run.invalidate(STAGE)
    if old is None or old != meta:
        atomic_write_json(old_path, meta)
    write_stage_config(run, STAGE, cfg)


def _present(stage_dir: Path, shard: tuple[int, int]) -> set[int]:
    """Indices of the shard's files under their final names (temp files are not counted)."""
    d = stage_dir / shard_name(*shard)
    out = set()
    with contextlib.suppress(FileNotFoundError), os.scandir(d) as it:
        for e in it:
            if e.name.endswith(".safetensors") and not is_temp_name(e.name):
                with contextlib.suppress(ValueError):
                    out.add(int(e.name.split(".")[0]))
    return out & set(range(*shard))


def _remove_temps(stage_dir: Path, shard: tuple[int, int]) -> int:
    d = stage_dir / shard_name(*shard)
    n = 0
    with contextlib.suppress(FileNotFoundError), os.scandir(d) as it:
        for e in it:
            if is_temp_name(e.name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(e.path)
                    n += 1
    return n


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    from draftsmith.progress import env_rank

    if rank is None and world_size is None:
        return env_rank()
    if rank is None or world_size is None:
        raise DraftsmithError("--rank and --world-size go together")
    if world_size < 1 or not 0 <= rank < world_size:
        raise DraftsmithError(f"--rank {rank} --world-size {world_size}: need 0 <= rank < world-size")
    return rank, world_size


def _try_finish(run: RunDir, cfg, meta: dict, fingerprint: str, settings: dict, inputs: dict, started: float,
                shards: list[tuple[int, int]]) -> dict | None:
    """Write the manifest if every shard (of every rank) is complete; else None."""
    d = run.stage_dir(STAGE)
    with _stage_lock(d):
        missing = [s for s in shards if not (d / shard_name(*s) / SHARD_RECORD).is_file()]
        if missing:
            return None
        current = run.read_manifest(STAGE)
        if current is not None and current.get("fingerprint") == fingerprint:
            return current  # another rank finished last and wrote it
        total_bytes = sum(json.loads((d / shard_name(*s) / SHARD_RECORD).read_text())["bytes"] for s in shards)
        n = meta["num_samples"]
        return run.write_manifest(
            STAGE, fingerprint=fingerprint, inputs=inputs, settings=settings, started=started,
            counts={"done": n, "total": n, "unit": "samples", "tokens": sum(meta["lengths"]),
                    "shards": len(shards), "bytes": total_bytes},
            outputs=[META] + [f"{shard_name(*s)}/{SHARD_RECORD}" for s in shards],
        )


@journal_failures(STAGE)
def run_extract(run: RunDir, cfg, verify: bool = False, force: bool = False, rank: int | None = None,
                world_size: int | None = None, target=None) -> dict | None:
    """Extract hidden states for every prepared sample of this rank's shards.

    Returns the manifest when the whole store is complete, or None on a rank that finished its
    shards while another rank's are still missing (the last rank to finish writes the manifest).
    `target`: an already loaded `draftsmith.target.Target` to reuse (else loaded here).
    """
    from draftsmith.prepare import check_upstream_target
    from draftsmith.progress import Progress, log
    from draftsmith.target import pick_dtype, pick_device, target_info

    ec = cfg.extract
    verify = verify or ec.verify
    force = force or ec.force
    rank, world_size = _resolve_rank(rank, world_size)
    started = time.time()

    # -- upstream checks (before anything is written) ---------------------------------------------
    prep_manifest = run.require_manifest("prepare", by="draftsmith extract")
    info = target.info if target is not None else target_info(cfg.target, cfg.trust_remote_code)
    check_upstream_target(run, "prepare", prep_manifest, info)
    layers = info.check_layers(list(ec.layers) if ec.layers is not None else info.default_aux_layers())
    samples_path = run.path / "prepare" / "samples.jsonl"
    if not samples_path.is_file():
        raise DraftsmithError(f"{samples_path}: missing although prepare/manifest.json exists; rerun prepare")
    if ec.backend == "vllm":
        from draftsmith.extract_vllm import server_dtype

        compute_dtype = server_dtype(cfg)  # what the server runs in (its files are checked to hold it)
    else:
        compute_dtype = str(target.dtype if target is not None else pick_dtype(cfg.dtype, pick_device(cfg.device))).replace("torch.", "")
    settings = {"target": cfg.target, "layers": layers, "shard_size": ec.shard_size, "backend": ec.backend,
                "compute_dtype": compute_dtype}
    inputs = {"prepare": prep_manifest.get("fingerprint"), "target_fingerprint": info.fingerprint,
              "samples": str(samples_path)}
    fp = stage_fingerprint({**settings, "target_fingerprint": info.fingerprint}, {"prepare": prep_manifest})
    current = run.read_manifest(STAGE)
    if current is not None and current.get("fingerprint") == fp and not verify:
        log(f"up to date ({current['counts']['done']} samples; --verify re-checks the files)", stage=STAGE)
        return current
    prepared = index_prepared(samples_path, info.vocab_size)
    meta = {
        "format": FORMAT_VERSION, "target": info.name, "target_fingerprint": info.fingerprint,
        "layers": layers, "num_layers": info.num_layers, "hidden_size": info.hidden_size,
        "vocab_size": info.vocab_size, "dtype": STORE_DTYPE, "compute_dtype": compute_dtype,
        "prepare_fingerprint": prep_manifest.get("fingerprint"), "num_samples": len(prepared),
        "shard_size": ec.shard_size, "fields": list(FIELDS), "backend": ec.backend, "lengths": prepared.lengths,
    }
    d = run.stage_dir(STAGE)
    with _stage_lock(d):
        _open_store(run, cfg, meta, fp, ec.overwrite)

    shards = shard_ranges(len(prepared), ec.shard_size)
    mine = [s for i, s in enumerate(shards) if i % world_size == rank]
    present = {s: _present(d, s) for s in mine}
    total = sum(e - s for s, e in mine)
    done = sum(len(p) for p in present.values())

    with Progress(run, STAGE, total=total, unit="samples", done=done, stall_after_s=cfg.stall_after_s,
                  rank=rank, world_size=world_size) as prog:
        # -- disk preflight (all ranks' remaining samples: ranks normally share the run's disk) --
        bpt = bytes_per_token(len(layers), info.hidden_size)
        all_present = {s: (present[s] if s in present else _present(d, s)) for s in shards}
        remaining = sum(prepared.lengths[i] * bpt + FILE_OVERHEAD
                        for s in shards for i in range(*s) if i not in all_present[s])
        full = sum(n * bpt + FILE_OVERHEAD for n in prepared.lengths)
        free = shutil.disk_usage(d).free
        prog.log(f"{len(prepared)} samples, {sum(prepared.lengths):,} tokens, layers {layers} + last, "
                 f"{bpt:,} bytes/token: store {_fmt_bytes(full)}, still to write {_fmt_bytes(remaining)}, "
                 f"free {_fmt_bytes(free)}")
        if remaining * 1.1 > free:
            msg = (f"{d}: not enough disk space: extract needs {_fmt_bytes(remaining)} (+10% margin) "
                   f"but {_fmt_bytes(free)} is free")
            if not force:
                raise DraftsmithError(msg + "; free space, use another run dir, or pass --force")
            prog.log(msg + " (--force: going on)")
        if world_size > 1:
            prog.log(f"rank {rank}/{world_size}: {len(mine)} of {len(shards)} shards, {total} samples")

        # -- resume: drop temp files, optionally re-check finished files -------------------------
        for s in mine:
            if _remove_temps(d, s):
                prog.log(f"{shard_name(*s)}: removed temp files of an interrupted attempt")
        if verify and done:
            with prog.busy(f"verifying {done} finished files"):
                removed = sum(verify_shard(d, s, prepared, layers, info.hidden_size, prog.log) for s in mine)
            present = {s: _present(d, s) for s in mine}
            prog.done -= removed  # the journal's count must match what is on disk
            prog.log(f"verify: {done - removed} files good, {removed} redone")
        for s in mine:
            # A shard.json from a complete attempt whose files were since removed no longer holds.
            rec = d / shard_name(*s) / SHARD_RECORD
            if rec.is_file() and len(present[s]) < s[1] - s[0]:
                rec.unlink()
        todo = {s: [i for i in range(*s) if i not in present[s]] for s in mine}
        n_todo = sum(len(v) for v in todo.values())
        unsealed = [s for s in mine if not (d / shard_name(*s) / SHARD_RECORD).is_file()]
        if done and n_todo:
            prog.log(f"resuming: {prog.done} of {total} samples already done")
        if unsealed:
            run.invalidate(STAGE)  # files are about to change: the store is not complete meanwhile

        if unsealed:
            with contextlib.suppress(FileNotFoundError):
                (d / FAILURES).unlink()  # the previous attempt's; its samples are missing, so retried now
            if ec.backend == "vllm":
                from draftsmith.extract_vllm import extract_shards

                stats = extract_shards(run, cfg, info, layers, prepared, unsealed, todo, prog)
            else:
                stats = _extract_shards(run, cfg, target, layers, prepared, unsealed, todo, prog)
            if stats["tokens"]:
                prog.log(f"extracted {stats['samples']} samples, {stats['tokens']:,} tokens in {stats['seconds']:.1f}s "
                         f"({stats['tokens'] / max(stats['seconds'], 1e-9):,.0f} tokens/s, "
                         f"{100 * stats['padding']:.1f}% padding, {stats['bytes'] / max(stats['tokens'], 1):,.0f} bytes/token)")
            if stats.get("failed"):
                raise DraftsmithError(f"{stats['failed']} samples failed, see {d / FAILURES}; the other samples are stored, "
                                      "rerun `draftsmith extract` to retry the missing ones")
        manifest = _try_finish(run, cfg, meta, fp, settings, inputs, started, shards)
        if manifest is None:
            prog.log(f"rank {rank}: its shards are complete; other ranks' shards are still missing "
                     "(the last rank to finish writes extract/manifest.json)")
        prog.end(samples=total, complete=manifest is not None)
    return manifest


def _extract_shards(run: RunDir, cfg, target, layers, prepared: Prepared, shards, todo, prog) -> dict:
    """The compute loop: forward each length-grouped batch, hand it to the writer thread."""
    import torch

    from draftsmith.target import load_target

    d = run.stage_dir(STAGE)
    stats = {"samples": 0, "tokens": 0, "computed": 0, "padded": 0, "seconds": 0.0, "bytes": 0, "padding": 0.0}
    if any(todo[s] for s in shards) and target is None:
        with prog.busy("loading target"):
            target = load_target(cfg.target, cfg.device, cfg.dtype, cfg.trust_remote_code, log=prog.log)
    capture = HiddenCapture(target.model, layers) if target is not None else None
    writer = ShardWriter(d, layers, on_written=prog.advance)
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


# -------------------------------------------------------------------------------------------------
# Reading the store (offline training)


class ExtractStore:
    """Random access to extracted samples: `store[i]` -> {input_ids, loss_mask, aux_hidden, last_hidden}.

    `run_or_path`: a RunDir, a run folder, or its extract/ folder. `.lengths` (tokens per sample)
    and `.meta` come from extract/meta.json, so batching by length opens no sample file.
    """

    def __init__(self, run_or_path: RunDir | str | os.PathLike):
        p = run_or_path.path if isinstance(run_or_path, RunDir) else Path(run_or_path).expanduser().resolve()
        if not (p / META).is_file() and (p / STAGE / META).is_file():
            p = p / STAGE
        meta_path = p / META
        if not meta_path.is_file():
            raise DraftsmithError(f"{p}: no extract/meta.json; run `draftsmith extract` first")
        try:
            self.meta: dict = json.loads(meta_path.read_text())
        except json.JSONDecodeError as e:
            raise DraftsmithError(f"{meta_path}: invalid JSON ({e.msg})") from None
        self.dir = p
        self.lengths: list[int] = list(self.meta["lengths"])
        self.layers: list[int] = list(self.meta["layers"])
        self.hidden_size: int = int(self.meta["hidden_size"])
        self.shard_size: int = int(self.meta["shard_size"])

    def __len__(self) -> int:
        return len(self.lengths)

    def complete(self) -> bool:
        return (self.dir / "manifest.json").is_file()

    def path(self, i: int) -> Path:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {i} out of range (store has {n})")
        start = (i // self.shard_size) * self.shard_size
        return self.dir / shard_name(start, min(start + self.shard_size, n)) / sample_name(i)

    def __getitem__(self, i: int) -> dict:
        from safetensors import safe_open

        p = self.path(i)
        try:
            with safe_open(str(p), framework="pt") as f:
                return {k: f.get_tensor(k) for k in f.keys()}
        except FileNotFoundError:
            raise DraftsmithError(f"{p}: missing; extract has not finished (rerun `draftsmith extract`)") from None

    def metadata(self, i: int) -> dict:
        from safetensors import safe_open

        with safe_open(str(self.path(i)), framework="pt") as f:
            return dict(f.metadata() or {})


# -------------------------------------------------------------------------------------------------
# CLI
