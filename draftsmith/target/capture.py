"""The target's hidden states, captured during its own forward: the input of decoder layer k (= HF
`output_hidden_states[k]`, vLLM's aux layer id k) by a forward pre-hook on that layer, and the base model's
final normed state; the LM head never runs and the other states are never kept. The layers are found through
the family's layout (layout.py).

HiddenCapture serves extract's hf backend and online training (train.mode=online), so the states trained on
online equal what the store holds; LayerInputs serves eval's local engine, so the drafter reads at inference
the states it was trained on.
"""

from typing import Any

import torch

from draftsmith.target.layout import layout_of_model


class LayerInputs:
    """Forward pre-hooks on decoder layers `layers` that keep each one's input: the residual
    stream after layers 0..k-1, HF's hidden_states[k], vLLM's aux layer id k. Whatever runs the
    model (a base-model forward here, eval's cached decoding steps) then `take()`s them."""

    def __init__(self, model, layers: list[int]):
        _, decoder_layers = layout_of_model(model).decoder(model)
        self.layers = list(layers)
        self._captured: dict[int, Any] = {}
        self._handles = [decoder_layers[k].register_forward_pre_hook(self._hook(k), with_kwargs=True)
                         for k in self.layers]

    def _hook(self, k: int):
        def hook(module, args, kwargs):
            # Llama-style layers take the hidden state positionally, others by keyword.
            self._captured[k] = args[0] if args else kwargs["hidden_states"]
        return hook

    def take(self):
        """[B, T, A, H] of the last forward, in layer-id order (the order fc is trained on); cleared."""
        missing = [k for k in self.layers if k not in self._captured]
        if missing:
            raise RuntimeError(f"the inputs of decoder layers {missing} were not captured")
        out = torch.stack([self._captured[k] for k in self.layers], dim=2)
        self._captured.clear()
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class HiddenCapture:
    """Runs the target's base model once per batch and returns the states training needs.

    `__call__(input_ids [B, T], position_ids [B, T]) -> (aux [B, T, A, H], last [B, T, H])`,
    on the model's device and in its dtype; aux in layer-id order.
    """

    def __init__(self, model, layers: list[int]):
        self.base, _ = layout_of_model(model).decoder(model)
        self.inputs = LayerInputs(model, layers)

    def __call__(self, input_ids, position_ids):
        # No attention_mask on purpose: rows are right-padded, so under the causal mask a real
        # token never sees a pad; leaving it out keeps SDPA on its fast is_causal path.
        out = self.base(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        return self.inputs.take(), out.last_hidden_state

    def remove(self) -> None:
        self.inputs.remove()
