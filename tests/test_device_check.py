"""The GPU check rehearsed on the CPU (issue 39): bench/device_check.sh as the GPU machine runs it, in a fresh
venv that sees only what that machine has (torch, transformers and the rest of ../shared/FACTS.md's list, not
pydantic), so that the one thing it lacks must come from the carried wheels with --no-index: a wheel missing
there fails here, not on the GPU. Without CUDA every part runs its CPU fallback."""

import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
import torch
import torch.nn.attention.flex_attention as fa

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / "bench" / "device" / "wheels"
# what the GPU machine lacks (FACTS.md), hidden from the fresh venv although draftsmith's .venv has them
HIDDEN = ("pydantic", "pydantic_core", "annotated_types", "typing_inspection", "vllm", "gguf")

HIDER = '''
import importlib.abc, sys
SITE = {site!r}
HIDDEN = {hidden!r}
sys.path.append(SITE)


class Hide(importlib.abc.MetaPathFinder):
    """The GPU machine's environment: draftsmith's .venv less what that machine lacks."""

    def find_spec(self, name, path=None, target=None):
        if path is None and name in HIDDEN:
            from importlib.machinery import PathFinder
            spec = PathFinder.find_spec(name, [p for p in sys.path if p != SITE])
            if spec is None:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return spec
        return None


sys.meta_path.insert(0, Hide())
'''


@pytest.fixture(scope="module")
def gpu_like_python(tmp_path_factory) -> Path:
    """A fresh venv (its own pip) whose imports reach draftsmith's .venv except the HIDDEN packages."""
    d = tmp_path_factory.mktemp("gpu-like") / "venv"
    venv.EnvBuilder(with_pip=True).create(d)
    py = d / "bin" / "python"
    site = Path(subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    (site / "_gpu_machine.py").write_text(HIDER.format(site=sysconfig.get_paths()["purelib"], hidden=HIDDEN))
    (site / "_gpu_machine.pth").write_text("import _gpu_machine\n")
    probe = subprocess.run([str(py), "-c", "import torch, transformers, typer; import pydantic"], capture_output=True,
                           text=True)
    assert probe.returncode != 0 and "No module named 'pydantic'" in probe.stderr  # like the GPU machine
    return py


# the parts the suite runs through the script (each limit generous for a loaded 2-core CPU). In the full rehearsal
# only (`DEVICE_TIMEOUT_SCALE=4 bash bench/device_check.sh OUT`, ~12 minutes here): `online` (~50 s here; online
# training is tested by test_train.py and test_families.py) and `ranks` (six 2-rank trainings, ~4 minutes; two-rank
# resume on gloo: test_train_ranks.py). soak and extract run in-process below, sparing two interpreters' start-up.
SUITE_PARTS = "pipeline:600 flex:300 memory:300 speed:300"


def check(python: Path, out: Path, **env):
    return subprocess.run(["bash", "bench/device_check.sh", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=1500, env={**os.environ, "PYTHON": str(python), "PYTHONPATH": "",
                                             "DEVICE_PARTS": SUITE_PARTS, **env})


@pytest.mark.skipif(not WHEELS.is_dir(), reason="bench/device/wheels: run bash bench/device/fetch_wheels.sh "
                    "(scripts/setup.sh does)")
def test_the_device_check_runs_from_the_carried_wheels_in_a_gpu_like_env(gpu_like_python, tmp_path):
    p = check(gpu_like_python, tmp_path / "out")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert ("installing pydantic pydantic-core annotated-types typing-inspection typing-extensions "
            "from bench/device/wheels") in p.stdout
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("device check on cpu fallback (no CUDA)") and "PASSED" in last
    result = json.loads((tmp_path / "out" / "device_check.json").read_text())
    assert result["ok"] and set(result["parts"]) == {"pipeline", "flex", "memory", "speed"}  # what SUITE_PARTS ran
    pipe = result["parts"]["pipeline"]
    assert set(pipe["stage_seconds"]) == {"generate", "prepare", "vocab", "extract", "train", "export", "eval"}
    assert pipe["tau"] >= 1.0 and pipe["train_tokens"] > 0
    names = [c["name"] for c in result["parts"]["flex"]["checks"]]
    # every GPU recipe's drafter: Llama-8B's and Kimi-K2's (GQA), Kimi-K2.5's (MLA), float32 and bf16 each
    for drafter in ("llama-8b eagle3 drafter (gqa", "kimi-k2 eagle3 drafter (gqa", "kimi-k2.5 eagle3 drafter (mla"):
        assert sum(drafter in n for n in names) == 2, (drafter, names)
    assert result["parts"]["speed"]["sdpa_tokens_per_s"] > 0


def test_a_wheel_missing_from_the_carried_folder_fails_here_in_one_line(gpu_like_python, tmp_path):
    empty = tmp_path / "wheels"
    empty.mkdir()
    p = check(gpu_like_python, tmp_path / "out", DEVICE_WHEELS=str(empty))
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1].startswith("device check: the carried wheels do not provide pydantic")
    assert not (tmp_path / "out" / "device_check.json").exists()  # no part ran


def test_the_soak_and_the_extraction_host_part_rehearsed_at_toy_widths(tmp_path):
    """device_parts' soak of the MLA drafter (the real data path from a synthetic fp8 store, rows of varying length, a
    one-row tail, two epochs; the Llama drafter's soak runs in the full rehearsal) and extract (run_extract's vllm
    backend on synthetic connector files in /dev/shm), in this process."""
    sys.path.insert(0, str(REPO / "bench"))
    import device_check  # bench/ is no package: importable once on sys.path, as the script's own folder is for it
    import device_parts

    checks = device_check.Checks(tmp_path / "soak.json", "soak")
    soak = device_parts.soak(tmp_path, tmp_path / "work", checks, drafters=("kimi-k2.5 mla",))  # the full: both
    assert checks.ok, checks.items
    assert [(r["drafter"], r["attention"]) for r in soak["drafters"]] == [("kimi-k2.5 mla", "mla")]
    for r in soak["drafters"]:
        assert r["steps"] >= 6 and r["shapes"] >= 4 and r["tokens_per_s"] > 0 and r["estimate"] > 0
    assert json.loads((tmp_path / "soak.json").read_text())["checks"] == checks.items  # written as each check ends

    # the soak's guard catches torch's own warning for unfused flex (here: flex called uncompiled)
    getattr(fa, "_WARNINGS_SHOWN", set()).discard("flex_attention_performance")  # torch warns once a process
    q = torch.randn(1, 1, 128, 16)
    with pytest.raises(UserWarning, match="without torch.compile"), device_parts.unfused_flex_is_an_error():
        fa.flex_attention(q, q, q)

    checks = device_check.Checks(tmp_path / "extract.json", "extract")
    staging = set(Path("/dev/shm").glob("draftsmith-device-check-*"))
    ex = device_parts.extract(tmp_path, tmp_path / "work", checks)
    assert checks.ok, checks.items
    assert ex["samples_per_s"] > 0
    # the threads the stage sized, not the configured ones: servers elsewhere leave every core to extraction
    detail = checks.items[-1]["detail"]
    assert "extraction host threads: " in detail and "0 for the vLLM server" in detail
    assert set(Path("/dev/shm").glob("draftsmith-device-check-*")) <= staging  # its staging folder removed
