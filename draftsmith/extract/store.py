"""The extract store: what offline training reads, one safetensors file per prepared sample.

Layout (docs/run-directory.md, "extract/"):

    extract/meta.json                        target, layers, prepare fingerprint, lengths, ...
    extract/rows_{start}-{end}/{i}.safetensors   one file per sample i (global prepare index)
    extract/rows_{start}-{end}/shard.json    written once every file of the shard is complete
    extract/manifest.json                    written when every shard is complete

A sample file holds input_ids [L] int32, loss_mask [L] uint8, aux_hidden [L, A, H] bf16 (the
states entering the A auxiliary layers) and last_hidden [L, H] bf16 (the final normed state).
Here: the layout, the prepared samples read by offset, the writer thread, the shard records,
--verify, and the reader (ExtractStore). Both backends (hf.py, vllm_backend.py) write through
ShardWriter, so their stores are the same bytes.
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
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save

from draftsmith import DraftsmithError
from draftsmith.progress import log
from draftsmith.rundir import RunDir, atomic_write_bytes, atomic_write_json, file_sha256, is_temp_name

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

# -------------------------------------------------------------------------------------------------
# Writing: a thread that serialises, hashes and atomically writes sample files and shard records


def sample_tensors(sample: dict, aux, last) -> dict:
    """The tensors of one sample file; aux [T, A, H] and last [T, H] are cut to its length L."""
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


def remove_damaged(stage_dir: Path, shards: list[tuple[int, int]]) -> tuple[list[str], set[tuple[int, int]]]:
    """Files of sealed shards that are missing or whose size differs from their shard.json (a disk
    error, a copy cut short, a file deleted by hand), found by stat alone: they and their shard's
    record are removed, so that the next attempt extracts them again. Returns ('rows_*/i.safetensors:
    why' for each, the shards whose record is gone: only opening their files can tell)."""
    damaged, unrecorded = [], set()
    for shard in shards:
        d = stage_dir / shard_name(*shard)
        try:
            files = json.loads((d / SHARD_RECORD).read_text())["files"]
            sizes = {f["name"]: int(f["size"]) for f in files}
        except FileNotFoundError:
            damaged.append(f"{d.name}/{SHARD_RECORD}: missing")
            unrecorded.add(shard)
            continue
        except (ValueError, KeyError, TypeError):
            damaged.append(f"{d.name}/{SHARD_RECORD}: unreadable")
            unrecorded.add(shard)
            (d / SHARD_RECORD).unlink(missing_ok=True)  # (missing_ok: ranks check the store side by side)
            continue
        bad = []
        for i in range(*shard):
            p = d / sample_name(i)
            size = p.stat().st_size if p.is_file() else None
            if size != sizes.get(p.name):
                bad.append(p)
                damaged.append(f"{d.name}/{p.name}: " + ("missing" if size is None else f"{size} bytes, {sizes.get(p.name)} recorded"))
        if bad:
            (d / SHARD_RECORD).unlink(missing_ok=True)
            for p in bad:
                p.unlink(missing_ok=True)
    return damaged, unrecorded


def read_shard_record(stage_dir: Path, shard: tuple[int, int]) -> dict:
    """rows_*/shard.json as write_shard_record wrote it."""
    return json.loads((stage_dir / shard_name(*shard) / SHARD_RECORD).read_text())


# -------------------------------------------------------------------------------------------------
# Checking finished files (--verify)


def check_sample_file(path: Path, index: int, sample: dict, layers: list[int], hidden_size: int) -> str | None:
    """None when the file is a complete, consistent sample file; else what is wrong with it."""
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
# The store across attempts and ranks


@contextlib.contextmanager
def stage_lock(stage_dir: Path) -> Iterator[None]:
    """Serialise store set-up and the final manifest between ranks sharing the run folder."""
    with open(stage_dir / LOCK, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def clear_store(stage_dir: Path) -> None:
    for p in stage_dir.iterdir():
        if p.is_dir() and p.name.startswith("rows_"):
            shutil.rmtree(p)
    for name in (META, "manifest.json"):
        with contextlib.suppress(FileNotFoundError):
            (stage_dir / name).unlink()


def check_store(stage_dir: Path, meta: dict, overwrite: bool) -> None:
    """Refuse to mix this attempt's files with a store built differently (its meta.json differs
    in a COMPAT_KEYS key); with `overwrite`, delete that store instead. Call under stage_lock."""
    meta_path = stage_dir / META
    old = _read_meta(meta_path)
    has_files = any(p.is_dir() and p.name.startswith("rows_") for p in stage_dir.iterdir())
    if old is None and not has_files:
        return
    diff = [k for k in COMPAT_KEYS if (old or {}).get(k) != meta[k]]
    if not diff:
        return
    if not overwrite:
        what = ", ".join(f"{k} {(old or {}).get(k)!r} -> {meta[k]!r}" if k not in ("prepare_fingerprint", "target_fingerprint")
                         else f"{k} changed" for k in diff)
        raise DraftsmithError(
            f"{meta_path}: the existing store was built differently ({what}); use a new run dir, "
            "or --set extract.overwrite=true to delete it and start over")
    log(f"replacing the store in {stage_dir}: it was built differently ({', '.join(diff)} changed)", stage=STAGE)
    clear_store(stage_dir)


def write_meta(stage_dir: Path, meta: dict) -> None:
    """extract/meta.json for this attempt (left alone when it already says the same)."""
    if _read_meta(stage_dir / META) != meta:
        atomic_write_json(stage_dir / META, meta)


def _read_meta(path: Path) -> dict | None:
    """meta.json as written, {} when unreadable (a store of unknown make), None when absent."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return {}


def present(stage_dir: Path, shard: tuple[int, int]) -> set[int]:
    """Indices of the shard's files under their final names (temp files are not counted)."""
    d = stage_dir / shard_name(*shard)
    out = set()
    with contextlib.suppress(FileNotFoundError), os.scandir(d) as it:
        for e in it:
            if e.name.endswith(".safetensors") and not is_temp_name(e.name):
                with contextlib.suppress(ValueError):
                    out.add(int(e.name.split(".")[0]))
    return out & set(range(*shard))


def remove_temps(stage_dir: Path, shard: tuple[int, int]) -> int:
    d = stage_dir / shard_name(*shard)
    n = 0
    with contextlib.suppress(FileNotFoundError), os.scandir(d) as it:
        for e in it:
            if is_temp_name(e.name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(e.path)
                    n += 1
    return n


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
        p = self.path(i)
        try:
            with safe_open(str(p), framework="pt") as f:
                return {k: f.get_tensor(k) for k in f.keys()}
        except FileNotFoundError:
            raise DraftsmithError(f"{p}: missing; extract has not finished (rerun `draftsmith extract`)") from None
        except Exception as e:  # safetensors raises its own error types for a damaged file
            raise DraftsmithError(f"{p}: unreadable ({type(e).__name__}: {e}); `draftsmith extract --run "
                                  f"{self.dir.parent}` redoes files cut short or missing, `--verify` any other damage") from None

    def metadata(self, i: int) -> dict:
        with safe_open(str(self.path(i)), framework="pt") as f:
            return dict(f.metadata() or {})


