"""The run directory: one folder per run, one subfolder per stage.

Layout (see docs/run-directory.md):

    RUN/run.json                   marks the folder as a draftsmith run
    RUN/<stage>/config.yaml        resolved config the stage ran with
    RUN/<stage>/manifest.json      written last, on completion: fingerprint, counts, timings, outputs
    RUN/<stage>/progress*.jsonl    the progress journal (draftsmith.progress)
    RUN/<stage>/stage.log          the stage's log lines

Every file a stage produces is written atomically (temporary name in the same folder, fsync,
rename), so a crash never leaves a half-written file under its final name.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from draftsmith import DraftsmithError, __version__
from draftsmith.redact import has_secrets, redact_secrets
from draftsmith.stages import names as stage_names

MANIFEST = "manifest.json"
RUN_MARKER = "run.json"
LOCKS = ".locks"  # RUN/.locks/<folder>.lock: RunDir.stage_lock's and run_lock's files


# ---------------------------------------------------------------------------------------------
# A full disk


DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


class DiskFull(DraftsmithError):
    """Writing `path` failed because its file system is full (or the user's quota is used up)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        super().__init__(f"{path}: no space left on device; free some space and run the same command again "
                         "(finished work is kept)")


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether `exc`, or an error it was raised from, is a full disk: an OSError with ENOSPC or
    EDQUOT, or a library error that says so (safetensors: "No space left on device (os error 28)";
    torch.save into a Python file object chains the OSError)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            return True
        if "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@contextlib.contextmanager
def naming_full_disk(path: str | os.PathLike) -> Iterator[None]:
    """Turn a full-disk error raised while writing `path` into a one-line DiskFull naming it."""
    try:
        yield
    except DraftsmithError:
        raise
    except Exception as e:
        if is_disk_full(e):
            raise DiskFull(path) from e
        raise


@contextlib.contextmanager
def cannot_write(path: str | os.PathLike, what: str) -> Iterator[None]:
    """One line naming `path` for a folder or file that cannot be made (a path under a file, a
    read-only file system, no permission), instead of a traceback from deep in the write."""
    try:
        with naming_full_disk(path):
            yield
    except DraftsmithError:
        raise
    except OSError as e:
        where = e.filename if getattr(e, "filename", None) else path
        raise DraftsmithError(f"{where}: cannot {what} ({e.strerror or type(e).__name__})") from None


def append_bytes(fd: int, data: bytes, path: str | os.PathLike) -> None:
    """Append `data` (whole lines) to the O_APPEND file `fd`, opened on `path`.

    One os.write when the OS takes it all (lines of concurrent writers never interleave; a crash
    cuts at most the last line); a short write is continued. When the disk fills part-way, the
    file is cut back to where it was, so no torn line is left behind for the next append to
    glue onto, and DiskFull names `path`. Text, so that a registered secret (redact.py: the API key, if a server
    echoed it into an answer, an id or an error) is written as *** whatever it came in.
    """
    if has_secrets():
        data = redact_secrets(data.decode("utf-8", "surrogatepass")).encode("utf-8", "surrogatepass")
    size = os.fstat(fd).st_size
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError as e:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, size)
        if e.errno in DISK_FULL_ERRNOS:
            raise DiskFull(path) from e
        raise


def append_text(path: str | os.PathLike, text: str, fsync: bool = False) -> None:
    """Append whole lines to a file (see append_bytes); `fsync` when the line records finished work."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        append_bytes(fd, text.encode("utf-8"), path)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def append_json_line(path: str | os.PathLike, obj: Any, fsync: bool = False) -> None:
    """One JSON object as one line, written with a single write(2) on an O_APPEND descriptor: lines
    of concurrent writers never interleave and a crash can only cut the last one."""
    append_text(path, jsonl_text([obj]), fsync=fsync)


# ---------------------------------------------------------------------------------------------
# JSONL files that a stage appends to (one whole line per write, see append_bytes)


def repair_jsonl_tail(path: str | os.PathLike, log: Callable[[str], None] | None = None) -> int:
    """Cut what a crash left of the last line of an appended JSONL file, so that the next append
    starts on a clean line: bytes after the last newline (a write cut short, or whole JSON whose
    newline never reached the disk: not done), and a last line that is not a JSON object. Returns
    the bytes removed; reads only the file's end, however big it is."""
    path = Path(path)
    if not path.is_file():
        return 0
    size = path.stat().st_size
    with open(path, "r+b") as f:
        end = _last_newline_end(f, size)
        if end > 0:  # the last whole line must be an object too: a torn write never is
            start = _last_newline_end(f, end - 1)
            f.seek(start)
            if not _is_json_object(f.read(end - start)):
                end = start
        if end < size:
            if log:
                log(f"{path.name}: removing a line cut by an earlier crash ({size - end} bytes)")
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    return size - end


def _last_newline_end(f, size: int, chunk: int = 1 << 16) -> int:
    """The offset just past the last b"\\n" in the first `size` bytes of `f` (0 when none)."""
    pos = size
    while pos > 0:
        start = max(0, pos - chunk)
        f.seek(start)
        k = f.read(pos - start).rfind(b"\n")
        if k >= 0:
            return start + k + 1
        pos = start
    return 0


def _is_json_object(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        return False


def iter_jsonl(path: str | os.PathLike, hint: str = "fix or remove that line") -> Iterator[tuple[int, dict]]:
    """(line number from 1, object) for each non-empty line, streamed; a line that is not a JSON
    object is a one-line error naming it (with `hint`, what to do). Run repair_jsonl_tail first on
    a file a crash may have cut."""
    path = Path(path)
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except ValueError as e:
                raise DraftsmithError(f"{path}:{n}: invalid JSON ({getattr(e, 'msg', e)}); {hint}") from None
            if not isinstance(rec, dict):
                raise DraftsmithError(f"{path}:{n}: not a JSON object; {hint}")
            yield n, rec


def read_jsonl(path: str | os.PathLike, log: Callable[[str], None] | None = None,
               hint: str = "fix or remove that line", require: tuple[str, ...] = ()) -> list[dict]:
    """The records of an appended JSONL file ([] when it does not exist), its torn tail cut first;
    a record without one of the keys `require` is an error naming its line."""
    if not Path(path).is_file():
        return []
    repair_jsonl_tail(path, log)
    records = []
    for n, rec in iter_jsonl(path, hint):
        if missing := [k for k in require if k not in rec]:
            raise DraftsmithError(f"{path}:{n}: a record without {', '.join(missing)}; {hint}")
        records.append(rec)
    return records


def jsonl_text(records) -> str:
    """Records as JSONL text, one compact line each (what append_json_line writes)."""
    return "".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n" for r in records)


# ---------------------------------------------------------------------------------------------
# Locks


@contextlib.contextmanager
def file_lock(path: str | os.PathLike, busy: str | None = None) -> Iterator[None]:
    """An exclusive flock on `path` (created, with its folder) for the context; the holder's pid is
    written into the file. Without `busy` it waits for another holder; with it, another holder is a
    DraftsmithError `busy (pid N)` at once. flock is per open file: the lock goes with the
    process, however it dies, and two opens in one process exclude each other too."""
    path = Path(path)
    with cannot_write(path, "create the lock file"):
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a+")
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (fcntl.LOCK_NB if busy else 0))
        except BlockingIOError:
            f.seek(0)
            raise DraftsmithError(f"{busy} (pid {f.read().strip() or '?'})") from None
        # the pid is the lock's first write: a disk already full names the lock file (written past Python's buffer,
        # which would otherwise raise again, unnamed, when the file closes)
        with naming_full_disk(path):
            os.ftruncate(f.fileno(), 0)
            os.pwrite(f.fileno(), str(os.getpid()).encode(), 0)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def lock_holder(path: str | os.PathLike) -> str | None:
    """The pid (as written) of the process holding file_lock(path), or None when nobody does. Probes
    with a non-blocking flock that is released at once."""
    try:
        f = open(path, "r")
    except OSError:
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return f.read().strip() or "?"
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


# ---------------------------------------------------------------------------------------------
# Atomic writes


def current_umask() -> int:
    """The process's umask, read without changing it (os.umask can only be read by setting it, which
    races with other threads creating files); temporary files and folders are made private, and get
    these permissions back before they take their final names."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # no /proc (not Linux): the racy way, put back at once
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success fsync it and rename it over `path`.

    On an exception the temporary file is removed and `path` is left as it was; a full disk is
    reported as DiskFull naming `path`. The temporary name starts with '.' and contains '.tmp',
    so readers that list a folder can skip it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with naming_full_disk(path):
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        with naming_full_disk(path):
            yield tmp_path
            with open(tmp_path, "rb+") as f:
                os.fsync(f.fileno())
            os.chmod(tmp_path, 0o666 & ~current_umask())  # mkstemp makes it 0600: readable as umask says
            os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


WRITE_CHUNK = 1 << 20


def write_hashed(path: str | os.PathLike, parts, hasher=None) -> tuple[int, str]:
    """Create `path` (which must not exist) from the byte buffers `parts` (bytes, memoryviews),
    hashing each buffer as it is written: (size, sha256 hex). No fsync: the caller syncs a group
    of files at once (fsync_all) before giving them their final names. On any error the file is
    removed; a full disk is reported as DiskFull naming `path`. hashlib and os.write release the
    GIL, so several threads write side by side."""
    h = hasher or hashlib.sha256()
    size = 0
    with naming_full_disk(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for part in parts:
                whole = memoryview(part).cast("B")
                size += len(whole)
                for at in range(0, len(whole), WRITE_CHUNK):  # hashed, then written while still in cache
                    view = whole[at: at + WRITE_CHUNK]
                    h.update(view)
                    while view:
                        view = view[os.write(fd, view):]
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        os.close(fd)
    return size, h.hexdigest()


def fsync_paths(paths, pool=None) -> None:
    """fsync each file of `paths` (on `pool`, a ThreadPoolExecutor, side by side: the file
    system then commits them in few journal transactions instead of one per file)."""
    def sync(p):
        with naming_full_disk(p):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    if pool is None:
        for p in paths:
            sync(p)
    else:
        for f in [pool.submit(sync, p) for p in paths]:
            f.result()


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a folder, so that the renames and creations in it survive a power cut."""
    with contextlib.suppress(OSError):  # some file systems refuse O_RDONLY fsync of a folder; best effort
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """A text file, atomically (atomic_path), with every registered secret redacted (redact.py)."""
    atomic_write_bytes(path, redact_secrets(text).encode("utf-8") if has_secrets() else text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def replace_dir(built: str | os.PathLike, dest: str | os.PathLike) -> None:
    """Put the complete folder `built` (same parent) at `dest`, replacing an older one.

    Two renames with the old folder parked under a dot-name in between, so `dest` is never a
    mix of old and new files; the parked copy is removed afterwards (a crash may leave it,
    under a name readers skip)."""
    built, dest = Path(built), Path(dest)
    # mkdtemp makes the folder 0700 and some writers (safetensors) their files 0600: a vLLM service
    # account must read an export, so the folder gets what the umask says, as a plain mkdir would
    umask = current_umask()
    for sub, _, files in os.walk(built):
        os.chmod(sub, 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(sub, name), 0o666 & ~umask)
    if dest.is_symlink():
        raise ValueError(f"replace_dir: {dest} is a link; replace the folder it points to")
    # parked copies a crash left between the two renames (this process's or an earlier one's): never read, removed
    for stale in dest.parent.glob(f".{dest.name}.old-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if dest.exists():
        old = dest.parent / f".{dest.name}.old-{os.getpid()}"
        os.replace(dest, old)
        os.replace(built, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(built, dest)


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")


# ---------------------------------------------------------------------------------------------
# Fingerprints


def fingerprint(obj: Any) -> str:
    """sha256 of the canonical JSON of `obj` (sorted keys): equal settings give equal prints."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def regular_file(path: str | os.PathLike) -> Path:
    """`path`, when it is a regular file (through any link); else a one-line error naming it: a FIFO, a device or a
    folder where a stage expects a file would hang its read or read something else."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise DraftsmithError(f"{path}: missing") from None
    if not stat.S_ISREG(st.st_mode):
        what = "folder" if stat.S_ISDIR(st.st_mode) else "FIFO" if stat.S_ISFIFO(st.st_mode) else "special file"
        raise DraftsmithError(f"{path}: a {what}, not a regular file")
    return path


def read_json_object(path: str | os.PathLike) -> dict:
    """A JSON object from `path`; a missing or malformed file is a one-line error naming it."""
    path = regular_file(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DraftsmithError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DraftsmithError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise DraftsmithError(f"{path}: expected a JSON object")
    return data


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(regular_file(path), "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def folder_sha256(files: list[Path]) -> str:
    """sha256 over `files` (each its name, a NUL, its bytes), in the order given: what identifies a drafter folder
    from elsewhere (its config.json, then its weight files: eval.drafter, train.init_from)."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(regular_file(f), "rb") as fh:  # a FIFO would hang this read
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def published_path(path: str | os.PathLike, root: str | os.PathLike) -> str:
    """`path` relative to `root` when inside it, else its last two parts: what a published file (an export, its
    provenance) may record of a local path, never the absolute one."""
    try:
        return str(Path(path).resolve().relative_to(Path(root).resolve()))
    except ValueError:
        return str(Path(*Path(path).parts[-2:]))


# ---------------------------------------------------------------------------------------------
# The run directory


class RunDir:
    """A run folder. Stages talk to each other only through the files documented here."""

    def __init__(self, path: str | os.PathLike):
        if not str(path).strip():  # Path("") is the current folder: a run would land wherever the shell is
            raise DraftsmithError("--run: an empty path; name the run's folder (e.g. --run runs/r1)")
        self.path = Path(path).expanduser().resolve()

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # -- creation / recognition ---------------------------------------------------------------
    def ensure(self) -> "RunDir":
        """Create the run folder (and its marker) if needed."""
        if self.path.exists() and not self.path.is_dir():
            raise DraftsmithError(f"{self.path}: exists and is not a folder")
        marker = self.path / RUN_MARKER
        with cannot_write(self.path, "create the run directory"):
            self.path.mkdir(parents=True, exist_ok=True)
            if not marker.exists():
                atomic_write_json(
                    marker,
                    {"created": time.time(), "host": socket.gethostname(), "draftsmith": __version__},
                )
        return self

    def is_run(self) -> bool:
        return (self.path / RUN_MARKER).is_file() or any(
            (self.path / s).is_dir() for s in stage_names()
        )

    # -- stage folders ------------------------------------------------------------------------
    def stage_dir(self, stage: str, create: bool = True) -> Path:
        d = self.path / stage
        if create:
            self.ensure()
            with cannot_write(d, "create the stage folder"):
                d.mkdir(parents=True, exist_ok=True)
        return d

    # -- one process at a time ------------------------------------------------------------------
    # The locks live in RUN/.locks/, not in the stage folders: export replaces its whole folder, and a
    # lock file renamed away with it would no longer exclude anyone.
    def _lock_path(self, folder: str, rank: int = 0) -> Path:
        return self.path / LOCKS / (f"{folder}.lock" if rank == 0 else f"{folder}.rank{rank}.lock")

    def stage_lock(self, folder: str, by: str, rank: int = 0):
        """One process per stage folder and rank (a single process is rank 0): a second `by` on this
        run is refused at once, in one line naming the first one's pid, before it writes anything."""
        self.ensure()
        return file_lock(self._lock_path(folder, rank),
                         busy=f"{self.path / folder}: another `{by}` is running on this run")

    def run_lock(self):
        """One `draftsmith run` per run folder (refused at once, like a second stage)."""
        self.ensure()
        return file_lock(self.path / LOCKS / "run.lock", busy=f"{self.path}: another `draftsmith run` is running on it")

    def refuse_if_busy(self) -> None:
        """A one-line error when any stage of this run is being run by a live process (its lock is
        held), so that `run` starts nothing, and touches none of its files, while one is."""
        for path in sorted((self.path / LOCKS).glob("*.lock")):
            if path.name == "run.lock":
                continue
            pid = lock_holder(path)
            if pid is not None:
                stage = path.name.split(".")[0]
                raise DraftsmithError(f"{self.path / stage}: `draftsmith {stage.split('-')[0]}` is running on this run "
                                      f"(pid {pid}); wait for it to end or stop it first")

    def manifest_path(self, stage: str) -> Path:
        return self.path / stage / MANIFEST

    def read_manifest(self, stage: str) -> dict | None:
        p = self.manifest_path(stage)
        try:
            data = json.loads(regular_file(p).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DraftsmithError(f"{p}: not a valid manifest ({e})") from None
        except (DraftsmithError, FileNotFoundError):
            if not p.exists():  # never written, or removed meanwhile (invalidate): the stage is not done
                return None
            raise
        if not isinstance(data, dict):  # `[1]`: every reader would fail on its first field, as a bug
            raise DraftsmithError(f"{p}: not a valid manifest (a JSON {type(data).__name__}, not an object); "
                                  f"rerun `draftsmith {stage}`")
        return data

    def require_manifest(self, stage: str, by: str) -> dict:
        """The completed manifest of an upstream stage, or a clear error naming what to run."""
        m = self.read_manifest(stage)
        if m is None:
            raise DraftsmithError(
                f"{self.path / stage}: stage '{stage}' has not completed; "
                f"run `draftsmith {stage} --run {self.path}` before `{by}`"
            )
        return m

    def invalidate(self, stage: str) -> None:
        """Remove a stage's manifest so that it counts as not done (its files stay for resume)."""
        with contextlib.suppress(FileNotFoundError):
            self.manifest_path(stage).unlink()

    def write_manifest(
        self,
        stage: str,
        *,
        fingerprint: str,
        inputs: dict[str, Any],
        settings: dict[str, Any],
        counts: dict[str, Any],
        started: float,
        outputs: list[str] | None = None,
        extra: dict[str, Any] | None = None,
        checked: list[str] | None = None,
    ) -> dict:
        """Write `<stage>/manifest.json`: the record that the stage completed.

        `fingerprint` covers the stage's inputs and settings; `run` compares it to decide what to
        skip. `outputs` are paths relative to the stage folder (default: every file in it). `files`
        records the size and sha256 of each of `checked` (default: the outputs that are files) as
        written, so that a file edited, emptied or removed since is found by what it is (check_files),
        not trusted because a manifest says the stage completed.
        """
        d = self.stage_dir(stage)
        if outputs is None:
            outputs = sorted(
                str(p.relative_to(d))
                for p in d.rglob("*")
                if p.is_file() and p.name != MANIFEST and not is_temp_name(p.name)
                and not p.name.startswith("progress") and p.name != "stage.log"
            )
        files = {rel: file_record(d / rel) for rel in (outputs if checked is None else checked) if (d / rel).is_file()}
        now = time.time()
        manifest = {
            "stage": stage,
            "fingerprint": fingerprint,
            "inputs": inputs,
            "settings": settings,
            "counts": counts,
            "started": started,
            "finished": now,
            "seconds": round(now - started, 3),
            "outputs": outputs,
            "files": files,
            "host": socket.gethostname(),
            "draftsmith": __version__,
            **(extra or {}),
        }
        atomic_write_json(self.manifest_path(stage), manifest)
        return manifest


HASH_WHOLE_BYTES = 2 << 30  # a file up to 2 GiB is hashed whole; a larger one by its size and its first and last MiB
_ENDS = 1 << 20


def file_record(path: Path) -> dict:
    """{size, sha256, whole}: what a stage's output file is as written (sha256 of its ends only when it is larger
    than HASH_WHOLE_BYTES: a multi-GB optimizer state is checked by size and ends, not read through every time)."""
    size = regular_file(path).stat().st_size
    if size <= HASH_WHOLE_BYTES:
        return {"size": size, "sha256": file_sha256(path), "whole": True}
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(_ENDS))
        f.seek(size - _ENDS)
        h.update(f.read(_ENDS))
    return {"size": size, "sha256": h.hexdigest(), "whole": False}


def check_files(manifest: dict, stage_dir: Path, only: set[str] | None = None) -> str | None:
    """The first of a manifest's recorded files (`files`; `only`: those of these paths, relative to the stage's
    folder, that it recorded) that is no longer what the stage wrote: "PATH: missing", "PATH: N bytes, written with
    M" or "PATH: its content changed since"; None when all check (or none is recorded: a manifest written before
    the record)."""
    files = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
    for rel, rec in files.items():
        if only is not None and rel not in only:
            continue
        path = stage_dir / rel
        if not isinstance(rec, dict) or not path.is_file():
            return f"{path}: missing"
        size = path.stat().st_size
        if size != rec.get("size"):
            return f"{path}: {size} bytes, written with {rec.get('size')}"
        if file_record(path)["sha256"] != rec.get("sha256"):
            return f"{path}: its content changed since it was written"
    return None


def write_stage_config(run: RunDir, stage: str, config) -> Path:
    """Write the resolved config next to what the stage produces: RUN/<stage>/config.yaml."""
    path = run.stage_dir(stage) / "config.yaml"
    atomic_write_text(path, config.to_yaml())
    return path


def stage_fingerprint(settings: dict[str, Any], upstream: dict[str, dict | None]) -> str:
    """What a stage's result depends on: its settings plus the fingerprints of its inputs."""
    return fingerprint({"settings": settings,
                        "upstream": {k: (m or {}).get("fingerprint") for k, m in upstream.items()}})


def fingerprinted(section: dict[str, Any], ignore: tuple[str, ...] = (),
                  later_defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """A stage's config section as its fingerprint sees it: without the keys that do not change
    what it writes (`ignore`), and without knobs added after runs were made while they hold their
    defaults (`later_defaults`), so that those runs stay current."""
    later = later_defaults or {}
    return {k: v for k, v in section.items() if k not in ignore and not (k in later and v == later[k])}
