"""What the target is, from its config.json alone (no torch, no transformers: `estimate` reads it too).

One `Identity` holds the config once: the whole file, its language model's config (a multimodal wrapper's
`text_config`) under the names the drafter's rules read (the family's layout maps its own, layout.py), and the
family's facts every stage asks: MLA or not, a wrapper or not, the stop tokens, and its layout (layout.py: where
its decoder stack sits). target_info (load.py) adds transformers' reading of the same file (`hf_config`,
`hf_text_config`), so that a stage needing the config by attribute, with transformers' defaults, asks `view()`
instead of reading it again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from draftsmith import DraftsmithError
from draftsmith.bounds import check_model_numbers, model_config
from draftsmith.target.layout import Layout, layout_of


def is_mla(config: Any) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3/R1, Kimi-K2): keys and values come from a compressed latent
    of width kv_lora_rank. `config`: a text config, as a dict (config.json's) or by attribute (transformers')."""
    return bool(config.get("kv_lora_rank") if isinstance(config, dict) else getattr(config, "kv_lora_rank", None))


@dataclass
class Identity:
    path: Path  # the config file
    config: dict  # the whole file
    text: dict  # the language model's config (a wrapper's text_config), in the drafter rules' names
    layout: Layout
    hf_config: Any = field(default=None, repr=False)  # transformers' config and its text config, where read
    hf_text_config: Any = field(default=None, repr=False)

    @property
    def folder(self) -> Path:
        return self.path.parent

    @property
    def is_mla(self) -> bool:
        return is_mla(self.text)

    @property
    def is_wrapper(self) -> bool:
        """A language model beside a vision or audio tower (Kimi-K2.5, Gemma 3, Llama 4, Qwen3-VL)."""
        return "text_config" in self.config and any(k in self.config for k in ("vision_config", "audio_config"))

    @property
    def norm_adds_one(self) -> bool:
        """Its RMSNorms scale by (1 + weight), computed in float32 (Gemma's families), not by the weight."""
        return str(self.text.get("model_type") or self.config.get("model_type") or "").startswith("gemma")

    def view(self) -> Any:
        """The text config by attribute, as the drafter's sizing rules read it: transformers' (with its
        defaults) where target_info read it, else config.json's own fields."""
        return self.hf_text_config if self.hf_text_config is not None else SimpleNamespace(**self.text)

    def stop_token_ids(self) -> set[int]:
        """Token ids the target stops generating at: the eos ids of generation_config.json and of config.json
        (its text config's too) (Llama 3 ends turns with <|eot_id|>, Gemma with <end_of_turn>)."""
        ids: set[int] = set()
        sources = [self.config, self.text]
        gen = self.folder / "generation_config.json"
        try:
            sources.append(json.loads(gen.read_text()))
        except (OSError, ValueError):
            pass  # none, or not JSON: config.json's ids alone
        for source in sources:
            eos = source.get("eos_token_id") if isinstance(source, dict) else None
            ids.update(x for x in (eos if isinstance(eos, list) else [eos]) if isinstance(x, int))
        return ids


def read_identity(config_json: str | Path, required: tuple[str, ...] = ()) -> Identity:
    """The Identity of a config.json (a model folder's, or any file of that format: estimate's --target-config),
    every size checked (bounds.py) and `required` present; a bad file is one line naming it."""
    path = Path(config_json)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DraftsmithError(f"{path}: cannot read the model config ({e})") from None
    top, text = model_config(data, str(path))
    layout = layout_of(text.get("model_type") or top.get("model_type"))
    # the family's own names of the fields the drafter rules read (GPT-2's n_embd), where it has no Llama one
    text = {**text, **{ours: text[theirs] for ours, theirs in layout.config_keys.items()
                       if text.get(theirs) is not None and ours not in text}}
    check_model_numbers(text, str(path), required)
    return Identity(path=path, config=top, text=text, layout=layout)
