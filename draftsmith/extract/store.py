"""The extract store: what offline training reads, one safetensors file per prepared sample.

Layout (docs/run-directory.md, "extract/"):

    extract/meta.json                        target, layers, prepare fingerprint, lengths, ...
    extract/rows_{start}-{end}/{i}.safetensors   one file per sample i (global prepare index)
    extract/rows_{start}-{end}/shard.json    written once every file of the shard is complete
    extract/manifest.json                    written when every shard is complete

A sample file holds input_ids [L] int32, loss_mask [L] uint8 and the states aux [L, A, H] (entering
the A auxiliary layers) and last [L, H] (the final normed state), each as the parts of the store's
format (store_format.py: bf16, fp8 with a scale per row; meta.json's `store_format` says which,
absent = bf16), encoded and decoded by its codec (codecs.py); the reader returns bf16 for every format.
Here: the layout, the prepared samples read by offset, the writer (threads + a committer that
fsyncs groups of files before naming them done), the shard records, --verify, and the reader
(ExtractStore). Both backends (hf.py, vllm_backend.py) write through ShardWriter, so their stores
are the same bytes.
"""

import contextlib
import json
import os
import shutil
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from draftsmith import DraftsmithError
from draftsmith.host import sized_torch_threads
from draftsmith.prepared_format import Prepared
from draftsmith.progress import log
from draftsmith.rundir import (DiskFull, RunDir, atomic_write_json, file_lock, file_sha256, fsync_dir, fsync_paths,
                              is_disk_full, is_temp_name, write_hashed)
from draftsmith.extract.codecs import codec_of, encoded_states
# the layout and sizes live in a torch-free module (estimate reads them); the names are the store's API too
from draftsmith.store_format import (FILE_OVERHEAD, FORMAT_VERSION, LEGACY, STATES, StoreFormat,  # noqa: F401
                                     bytes_per_token, field, format_name, format_of, sample_name, shard_name,
                                     shard_ranges)

STAGE = "extract"
META = "meta.json"
SHARD_RECORD = "shard.json"
FAILURES = "failures.jsonl"  # backend vllm: samples that failed in the last attempt
LOCK = ".extract.lock"  # ranks_lock's file (RunDir.stage_lock's .lock is another lock)
# Meta keys that must match for files of two attempts to live in one store.
COMPAT_KEYS = ("format", "store_format", "target_fingerprint", "layers", "hidden_size", "dtype", "compute_dtype",
               "prepare_fingerprint", "num_samples", "shard_size")


# -------------------------------------------------------------------------------------------------
# Encoding a sample file: the safetensors layout written straight from the tensors' memory


def sample_tensors(sample: dict, aux, last, fmt: StoreFormat = LEGACY) -> dict:
    """The tensors of one sample file (on the CPU); aux [T, A, H] and last [T, H] are cut to its
    length L. Encoded on their device first (a GPU casts/quantises before the copy to host)."""
    L = len(sample["input_ids"])
    out = {"input_ids": torch.tensor(sample["input_ids"], dtype=torch.int32),
           "loss_mask": torch.tensor(sample["loss_mask"], dtype=torch.uint8)}
    codec = codec_of(fmt)
    for state, x in zip(STATES, (aux, last)):
        out.update(codec.file_tensors(state, tuple(p.cpu() for p in codec.encode(x[:L]))))
    return out


# safetensors' dtype names, and the rank by which it orders tensors in a file (its Dtype enum,
# larger first, then by name): reproduced so that files are byte-equal to safetensors.torch.save
_ST_DTYPES = {torch.float64: ("F64", 12), torch.float32: ("F32", 11), torch.int32: ("I32", 9),
              torch.bfloat16: ("BF16", 8), torch.float16: ("F16", 7), torch.float8_e4m3fn: ("F8_E4M3", 4),
              torch.uint8: ("U8", 1), torch.int64: ("I64", 13)}


def safetensors_parts(tensors: dict, metadata: dict) -> list:
    """A safetensors file as buffers to write one after the other: [header, tensor bytes...].

    The tensors' bytes are views of their memory (no copy, no serialised blob to re-slice); the
    JSON header's keys are sorted, so equal tensors give byte-equal files whichever process or
    rank wrote them (safetensors.torch.save emits them from a hash map). The header is padded
    with spaces to a multiple of 8 bytes. Equal to canonical_safetensors(save(tensors, metadata))."""
    names = sorted(tensors, key=lambda k: (-_ST_DTYPES[tensors[k].dtype][1], k))
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    bufs, off = [], 0
    for k in names:
        t = tensors[k].contiguous()
        b = t.reshape(-1).view(torch.uint8).numpy()
        header[k] = {"dtype": _ST_DTYPES[t.dtype][0], "shape": list(t.shape), "data_offsets": [off, off + b.nbytes]}
        off += b.nbytes
        bufs.append(b)
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return [struct.pack("<Q", len(text)) + text, *bufs]


def canonical_safetensors(data: bytes) -> bytes:
    """The same safetensors file with its JSON header's keys sorted (what safetensors_parts writes)."""
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8: 8 + n])
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data[8 + n:]


def sample_metadata(index: int, sample: dict, layers: list[int]) -> dict:
    return {"id": str(sample["id"]), "index": str(index), "layers": json.dumps(list(layers))}


def encode_sample(index: int, sample: dict, aux, last, layers: list[int], fmt: StoreFormat = LEGACY) -> bytes:
    """One sample file's bytes (tests and tools; the writer writes the parts without joining them)."""
    parts = safetensors_parts(sample_tensors(sample, aux, last, fmt), sample_metadata(index, sample, layers))
    return b"".join(bytes(memoryview(p)) for p in parts)


# -------------------------------------------------------------------------------------------------
# Writing: writer threads that encode, hash and write sample files; a committer that makes them done


COMMIT_S = 1.0  # written files are fsynced and named done at least this often (and at each shard's end)
COMMIT_BYTES = 1 << 30  # ... or as soon as this many bytes of one shard wait


@dataclass
class _Shard:
    jobs: int = 0  # sample files queued or being written
    pending: list = None  # written, not yet synced: (tmp path, final path, name, size, sha256)
    pending_bytes: int = 0
    finish: bool = False  # finish_shard was called: seal it once its jobs are done

    def __post_init__(self):
        self.pending = []


class ShardWriter:
    """Writes sample files and shard records off the compute thread, at the disk's speed.

    - `threads` writer threads each take one sample: encode it in `fmt` (cast or quantise), lay the
      safetensors file out from the tensors' memory, write it under a temp name while hashing it
      (hashlib and os.write release the GIL), no fsync;
    - a committer thread, every COMMIT_S seconds (or COMMIT_BYTES of a shard, or its end), fsyncs
      the group of written files side by side, renames them to their final names, fsyncs the
      folder, reports them to `on_written`; a shard's shard.json is written (fsynced) only after
      all its files were committed. So a file under its final name is always whole and synced, a
      crash loses at most the uncommitted temp files (which resume removes), and no file is
      fsynced alone.
    - `torch_threads`: the torch intra-op threads of each writer thread (host.extract_threads sizes them beside
      vLLM); None: the process's count;
    - at most `depth` batches (default: one per thread) are held in memory; an error on any
      thread is raised in the caller at its next `write_batch` or at `close`. On an error the
      files already written whole are still committed (the next attempt keeps them).
    """

    def __init__(self, stage_dir: Path, layers: list[int], on_written=None, threads: int = 4, depth: int | None = None,
                 fmt: StoreFormat = LEGACY, torch_threads: int | None = None):
        self.stage_dir = stage_dir
        self.layers = layers
        self.fmt = fmt
        self.on_written = on_written or (lambda n: None)
        self.threads = max(1, int(threads))
        self.error: BaseException | None = None
        self.records: dict[tuple[int, int], dict[str, dict]] = {}  # shard -> name -> {size, sha256}, committed
        self.bytes_written = 0  # committed bytes
        self.files_written = 0
        self._slots = threading.Semaphore(depth or max(2, self.threads))
        self._cv = threading.Condition()
        self._shards: dict[tuple[int, int], _Shard] = {}
        self._stop = False
        self._job = self._write_one if torch_threads is None else sized_torch_threads(self._write_one, torch_threads)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="extract-writer")
        self._sync_pool = ThreadPoolExecutor(self.threads, thread_name_prefix="extract-fsync")
        self._committer = threading.Thread(target=self._commit_loop, name="extract-commit", daemon=True)
        self._committer.start()
        self._closed = False

    # -- the caller's side ---------------------------------------------------------------------------
    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def _fail(self, e: BaseException) -> None:
        with self._cv:
            if self.error is None:
                self.error = e
            self._cv.notify_all()

    def write_batch(self, shard: tuple[int, int], indices: list[int], samples: list[dict], aux, last) -> None:
        """Queue the samples of a batch: aux [B, T, A, H], last [B, T, H] (any device, any float dtype)."""
        while not self._slots.acquire(timeout=0.5):
            self._check()
        try:
            self._check()
        except BaseException:
            self._slots.release()
            raise
        left = [len(indices)]
        with self._cv:
            self._shards.setdefault(shard, _Shard()).jobs += len(indices)
        for b, (i, s) in enumerate(zip(indices, samples)):
            self._pool.submit(self._job, shard, i, s, aux, last, b, left)

    def finish_shard(self, shard: tuple[int, int]) -> None:
        """Every sample of the shard was queued (or is on disk from an earlier attempt): seal it."""
        self._check()
        with self._cv:
            self._shards.setdefault(shard, _Shard()).finish = True
            self._cv.notify_all()

    def close(self) -> None:
        """Write and commit everything queued, seal the finished shards; raise a thread's error."""
        self._shutdown(cancel=False)
        self._check()

    def abort(self) -> None:
        """Stop without raising (the caller is already failing): drop what is queued, commit the
        files already written whole."""
        self._shutdown(cancel=True)

    def _shutdown(self, cancel: bool) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=cancel)
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._committer.join()
        self._sync_pool.shutdown(wait=True)

    # -- writer threads -------------------------------------------------------------------------------
    def _write_one(self, shard, index: int, sample: dict, aux, last, b: int, left: list) -> None:
        try:
            if self.error is not None:
                return
            with torch.inference_mode():
                tensors = sample_tensors(sample, aux[b], last[b], self.fmt)
            parts = safetensors_parts(tensors, sample_metadata(index, sample, self.layers))
            d = self.stage_dir / shard_name(*shard)
            d.mkdir(parents=True, exist_ok=True)
            name = sample_name(index)
            tmp = d / f".{name}.{os.getpid()}-{threading.get_ident()}.tmp"
            size, sha = write_hashed(tmp, parts)
            with self._cv:
                st = self._shards[shard]
                st.pending.append((tmp, d / name, name, size, sha))
                st.pending_bytes += size
        except BaseException as e:
            if is_disk_full(e):  # named by the file's final name, not its temp name
                e = DiskFull(self.stage_dir / shard_name(*shard) / sample_name(index))
            self._fail(e)
        finally:
            with self._cv:
                self._shards[shard].jobs -= 1
                left[0] -= 1
                if left[0] == 0:
                    self._slots.release()
                self._cv.notify_all()

    # -- the committer --------------------------------------------------------------------------------
    def _commit_loop(self) -> None:
        last = time.monotonic()
        while True:
            with self._cv:
                while True:
                    now = time.monotonic()
                    due = now - last >= COMMIT_S or self._stop
                    groups, seal = [], []
                    for shard, st in self._shards.items():
                        ready = st.finish and st.jobs == 0
                        if st.pending and (due or ready or st.pending_bytes >= COMMIT_BYTES):
                            groups.append((shard, st.pending))
                            st.pending, st.pending_bytes = [], 0
                        if ready and self.error is None:
                            seal.append(shard)
                    for shard in seal:
                        del self._shards[shard]
                    if groups or seal:
                        break
                    if self._stop:
                        return
                    self._cv.wait(timeout=max(0.01, COMMIT_S - (now - last)))
                if due:
                    last = time.monotonic()
            for shard, files in groups:
                self._commit(shard, files)
            for shard in seal:
                if self.error is None:
                    try:
                        write_shard_record(self.stage_dir, shard, self.layers, self.records.pop(shard, {}))
                        fsync_dir(self.stage_dir / shard_name(*shard))
                    except BaseException as e:
                        self._fail(e)

    def _commit(self, shard, files: list) -> None:
        """fsync the written files together, then give them their final names (then fsync the folder)."""
        try:
            fsync_paths([f[0] for f in files], self._sync_pool)
            for tmp, final, _, _, _ in files:
                os.replace(tmp, final)
            fsync_dir(self.stage_dir / shard_name(*shard))
        except BaseException as e:
            for f in files:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f[0])
            if is_disk_full(e):
                e = DiskFull(files[0][1])
            self._fail(e)
            return
        rec = self.records.setdefault(shard, {})
        for _, _, name, size, sha in files:
            rec[name] = {"size": size, "sha256": sha}
            self.bytes_written += size
        self.files_written += len(files)
        try:
            self.on_written(len(files))
        except BaseException as e:
            self._fail(e)


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
                damaged.append(f"{d.name}/{p.name}: "
                               + ("missing" if size is None else f"{size} bytes, {sizes.get(p.name)} recorded"))
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


def check_sample_file(path: Path, index: int, sample: dict, layers: list[int], hidden_size: int,
                      fmt: StoreFormat = LEGACY) -> str | None:
    """None when the file is a complete, consistent sample file of format `fmt`; else what is wrong with it."""
    L = len(sample["input_ids"])
    fields = fmt.fields
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            meta = f.metadata() or {}
            if keys != set(fields):
                return f"fields {sorted(keys)}, expected {list(fields)} (store format {fmt.name})"
            t = {k: f.get_tensor(k) for k in fields}
    except Exception as e:  # safetensors raises its own error type for cut or garbled files
        return f"unreadable ({type(e).__name__}: {e})"
    codec = codec_of(fmt)
    expect = {"input_ids": (torch.int32, (L,)), "loss_mask": (torch.uint8, (L,))}
    for state, shape in zip(STATES, ((L, len(layers), hidden_size), (L, hidden_size))):
        expect.update(zip((field(state, p) for p in fmt.parts), codec.specs(shape)))
    for k, (dt, shape) in expect.items():
        if t[k].dtype != dt or tuple(t[k].shape) != shape:
            return f"{k} is {t[k].dtype} {tuple(t[k].shape)}, expected {dt} {shape}"
    if (meta.get("index") != str(index) or meta.get("id") != str(sample["id"])
            or meta.get("layers") != json.dumps(list(layers))):
        return f"metadata {meta} does not match sample {index} ({sample['id']!r}, layers {layers})"
    if t["input_ids"].tolist() != list(sample["input_ids"]) or t["loss_mask"].tolist() != list(sample["loss_mask"]):
        return "input_ids/loss_mask differ from prepare/samples.jsonl"
    return codec.problem(encoded_states(codec, t))


def verify_shard(stage_dir: Path, shard: tuple[int, int], prepared: Prepared, layers: list[int], hidden_size: int,
                 log, fmt: StoreFormat = LEGACY) -> int:
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
        problem = check_sample_file(d / sample_name(i), i, samples[i], layers, hidden_size, fmt)
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


def ranks_lock(stage_dir: Path):
    """Serialise store set-up and the final manifest between the ranks sharing the run folder
    (they wait for each other: several extract processes on one run is the design)."""
    return file_lock(stage_dir / LOCK)


def clear_store(stage_dir: Path) -> None:
    for p in stage_dir.iterdir():
        if p.is_dir() and p.name.startswith("rows_"):
            shutil.rmtree(p)
    for name in (META, "manifest.json"):
        with contextlib.suppress(FileNotFoundError):
            (stage_dir / name).unlink()


def check_store(stage_dir: Path, meta: dict, overwrite: bool) -> None:
    """Refuse to mix this attempt's files with a store built differently (its meta.json differs
    in a COMPAT_KEYS key); with `overwrite`, delete that store instead. Call under ranks_lock."""
    meta_path = stage_dir / META
    old = _read_meta(meta_path)
    has_files = any(p.is_dir() and p.name.startswith("rows_") for p in stage_dir.iterdir())
    if old is None and not has_files:
        return
    if old:
        old = {**old, "store_format": format_name(old)}  # a store made before the key holds the legacy format
    diff = [k for k in COMPAT_KEYS if (old or {}).get(k) != meta[k]]
    if not diff:
        return
    if not overwrite:
        what = ", ".join(f"{k} {(old or {}).get(k)!r} -> {meta[k]!r}"
                         if k not in ("prepare_fingerprint", "target_fingerprint") else f"{k} changed" for k in diff)
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
    Whatever the store format (`.format`: meta.json's `store_format`, bf16 when absent; `.codec` its
    codec), `store[i]` holds bf16 aux_hidden [L, A, H] and last_hidden [L, H], decoded on read;
    `store.raw(i)` gives the file's own tensors, `store.states(i)` its encoded states.
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
        self.format: StoreFormat = format_of(self.meta, str(meta_path))
        self.codec = codec_of(self.format)

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
        t, states = self.states(i)
        return {"input_ids": t["input_ids"], "loss_mask": t["loss_mask"],
                **{field(state, "hidden"): self.codec.decode(parts, torch.bfloat16) for state, parts in states.items()}}

    def states(self, i: int) -> tuple[dict, dict[str, tuple]]:
        """(sample i's file tensors, its encoded states {'aux': parts, 'last': parts}: the codec decodes them)."""
        t = self.raw(i)
        return t, encoded_states(self.codec, t)

    def raw(self, i: int) -> dict:
        """Sample i's tensors as stored in its file."""
        p = self.path(i)
        try:
            with safe_open(str(p), framework="pt") as f:
                return {k: f.get_tensor(k) for k in f.keys()}
        except FileNotFoundError:
            raise DraftsmithError(f"{p}: missing; extract has not finished (rerun `draftsmith extract`)") from None
        except Exception as e:  # safetensors raises its own error types for a damaged file
            raise DraftsmithError(f"{p}: unreadable ({type(e).__name__}: {e}); `draftsmith extract --run "
                                  f"{self.dir.parent}` redoes files cut short or missing, "
                                  "`--verify` any other damage") from None

    def metadata(self, i: int) -> dict:
        with safe_open(str(self.path(i)), framework="pt") as f:
            return dict(f.metadata() or {})


