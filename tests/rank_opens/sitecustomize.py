"""Test hook, active only when DRAFTSMITH_TEST_OPENS names a folder (tests/test_train_ranks.py puts
this folder on PYTHONPATH of the ranks it starts): each torchrun rank appends to
opens.rank{RANK}.txt one line per file it opens, "open PATH" (Python's open event: torch.load,
json, builtins) or "safe_open PATH" (safetensors, whose Rust reader raises no Python event), one
"tensor PATH" per tensor read from a safetensors file, and one line when it leaves its process
group (below)."""

import os
import sys

_folder = os.environ.get("DRAFTSMITH_TEST_OPENS")
_rank = os.environ.get("RANK")
if _folder and _rank is not None:
    _log = open(os.path.join(_folder, f"opens.rank{_rank}.txt"), "a", buffering=1)

    def _record(kind, path):
        _log.write(f"{kind} {os.path.abspath(os.fsdecode(path))}\n")

    def _audit(event, args):
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            _record("open", args[0])

    sys.addaudithook(_audit)

    # before anything imports `safe_open` by name (safetensors.torch, draftsmith), so that every
    # reader goes through the recording wrapper
    import safetensors

    _safe_open = safetensors.safe_open

    class _RecordingHandle:
        """A safe_open handle that also records each tensor read from it ("tensor PATH"): listing a file's names
        (its header) is not reading its weights."""

        def __init__(self, handle, path):
            self._handle, self._path = handle, path

        def __enter__(self):
            self._handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self._handle.__exit__(*exc)

        def get_tensor(self, name):
            _record("tensor", self._path)
            return self._handle.get_tensor(name)

        def get_slice(self, name):
            _record("tensor", self._path)
            return self._handle.get_slice(name)

        def __getattr__(self, name):
            return getattr(self._handle, name)

    def _recording_safe_open(filename, *args, **kwargs):
        _record("safe_open", filename)
        return _RecordingHandle(_safe_open(filename, *args, **kwargs), filename)

    safetensors.safe_open = _recording_safe_open

    # The models a rank still holds wrapped for DDP/FSDP when it leaves its process group: one line
    # "destroy_process_group live_wrapped=N". Counted among all objects the collector tracks, garbage
    # included: a wrapped model freed only after the group is gone hung a rank at exit (train/stage.py _train).
    import gc

    import torch.distributed as _dist

    _destroy = _dist.destroy_process_group

    def _recording_destroy(*args, **kwargs):
        from torch.distributed.fsdp import FSDPModule
        from torch.nn.parallel import DistributedDataParallel

        live = sum(isinstance(o, (DistributedDataParallel, FSDPModule)) for o in gc.get_objects())
        _log.write(f"destroy_process_group live_wrapped={live}\n")
        return _destroy(*args, **kwargs)

    _dist.destroy_process_group = _recording_destroy
