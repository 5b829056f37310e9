"""train's check of the GPU's free memory before the first step (draftsmith/train/device_memory.py), on the CPU with
the device's answers stood in for: a GPU another process holds is one line naming it, before any data or drafter is
loaded; a device too small by the estimate alone is a note; a CPU run asks nothing. What only a GPU can settle: that
torch.cuda.mem_get_info and nvidia-smi answer as stood in for here, and the estimate's margin at real widths."""

import os
import stat

import pytest
import torch

from draftsmith import DraftsmithError
from draftsmith.config import load_config
from draftsmith.target import target_info
from draftsmith.train.device_memory import check_free_memory, compute_processes, step_bytes
from draftsmith.train.distributed import Ranks

GPU = Ranks(rank=0, world=1, device=torch.device("cuda", 0))


@pytest.fixture(scope="module")
def setup(tiny8):
    cfg = load_config(None, [f"target={tiny8}"])
    return cfg, target_info(str(tiny8))


def test_a_gpu_another_process_holds_is_refused_in_one_line_naming_it(setup):
    cfg, info = setup
    need = step_bytes(cfg, info, 64, 3, 1, 80e9)
    said = []
    with pytest.raises(DraftsmithError) as e:
        check_free_memory(cfg, info, 64, 3, GPU, said.append, mem_get_info=lambda d: (need / 2, 80e9),
                          holders=lambda: ["pid 4242 (python3) 61,440 MiB"])
    line = str(e.value)
    assert "\n" not in line and line.startswith("train: one step needs ~") and "on cuda:0" in line
    assert "held by pid 4242 (python3) 61,440 MiB" in line and "train.batch_tokens" in line and not said
    # enough free: nothing said, nothing refused; nothing else holding it: a note, not a refusal
    check_free_memory(cfg, info, 64, 3, GPU, said.append, mem_get_info=lambda d: (2 * need, 80e9),
                      holders=lambda: pytest.fail("asked for holders with memory enough"))
    assert not said
    check_free_memory(cfg, info, 64, 3, GPU, said.append, mem_get_info=lambda d: (need / 2, need / 2),
                      holders=lambda: [])
    assert len(said) == 1 and said[0].startswith("note: one step needs") and "draftsmith estimate" in said[0]


def test_a_cpu_run_asks_the_device_nothing(setup):
    cfg, info = setup
    check_free_memory(cfg, info, 64, 3, Ranks(0, 1, torch.device("cpu")), pytest.fail,
                      mem_get_info=lambda d: pytest.fail("asked a CPU for GPU memory"))


def test_the_step_needs_more_with_a_larger_batch(setup):
    cfg, info = setup
    big = load_config(None, [f"target={cfg.target}", "train.batch_tokens=65536", "train.seq_len=8192"])
    assert step_bytes(big, info, 64, 3, 1, 80e9) > step_bytes(cfg, info, 64, 3, 1, 80e9) > 0


def test_compute_processes_from_nvidia_smi(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '4242, /usr/bin/python3, 61440\\n%s, /x/python, 512\\nbad line\\n' "
                   f"{os.getpid()}\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert compute_processes() == ["pid 4242 (python3) 61,440 MiB"]  # this process left out
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert compute_processes() == []
