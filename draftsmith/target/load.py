"""The target described (target_info: its identity, sizes and fingerprint, without its weights) and loaded
(load_target: its language model for inference, load_tokenizer). Its folder comes from gguf.resolve_target, its
config facts from identity.py, its tensor and module names from layout.py, the device and dtype from host.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, GenerationMixin
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.auto import modeling_auto as auto
from transformers.utils import logging as hf_logging

from draftsmith import DraftsmithError
from draftsmith.bounds import check_model_numbers
from draftsmith.host import local_world_size, pick_device, pick_dtype
from draftsmith.target.gguf import HUB_IDS, quiet_transformers, resolve_target
from draftsmith.target.identity import Identity, read_identity
from draftsmith.target.layout import LLAMA, Layout, first_sentence, language_model_names

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
    identity: Identity | None = field(default=None, repr=False, compare=False)  # its config, read once

    @property
    def layout(self) -> Layout:
        """Where its language model sits (layout.py): its family's adapter."""
        return self.identity.layout if self.identity is not None else LLAMA

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
    # every size a real model can have (bounds.py): a config edited to nonsense is refused here, not later
    identity = read_identity(folder / "config.json")
    identity.hf_config, identity.hf_text_config = cfg, text_cfg
    # what kind of model it is (a vision-only or encoder model is named as such)
    check_followable(cfg, text_cfg, folder / "config.json", trust_remote_code)
    has_template = False
    tc = folder / "tokenizer_config.json"
    if tc.is_file():
        with contextlib.suppress(json.JSONDecodeError):
            has_template = bool(json.loads(tc.read_text()).get("chat_template"))
    if not has_template:
        has_template = (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file()
    heads = text_cfg.num_attention_heads
    info = TargetInfo(
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
        identity=identity,
    )
    # its checkpoint laid out as its family's adapter says (layout.py), told by the first stage, not at training, and
    # before its fields are held to the drafter rules' names (which the adapter maps)
    language_model_names(info)
    # required as transformers reads them (a field left to its class default counts), in the drafter rules' names
    check_model_numbers({**text_cfg.to_dict(), **identity.text}, str(folder / "config.json"),
                        required=("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads"))
    return info


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
        raise DraftsmithError(f"{info.path}: cannot load the tokenizer ({first_sentence(e)})") from None


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
        """Token ids that end an answer: the tokenizer's EOS and the target's stop tokens (identity.py: often
        several, Llama 3's <|eot_id|> beside <|end_of_text|>)."""
        ids = set(self.info.identity.stop_token_ids()) if self.info.identity is not None else set()
        if isinstance(self.tokenizer.eos_token_id, int):
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def final_norm_weight(self):
        norm = self.info.layout.final_norm(self.model)
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
    cfg, text_cfg = info.identity.hf_config, info.identity.hf_text_config
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
        raise DraftsmithError(f"{info.path}: cannot load the model ({first_sentence(e)})") from None
    model.eval().requires_grad_(False)
    tok = load_tokenizer(info, trust_remote_code)
    return Target(model=model, tokenizer=tok, info=info, device=dev, dtype=dt)