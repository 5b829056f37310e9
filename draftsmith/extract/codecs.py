"""The store formats' codecs: how each format of draftsmith/store_format.py turns a state block into
the tensors of a sample file, and back into the compute dtype.

A state block is [T, ..., D] (aux [L, A, H], last [L, H]: one row per token and layer); its parts,
in the order of the format's `parts`, each keep the leading [T, ...] so that they pack into rows
token by token like the block itself. The writer encodes (on the states' device, before the copy
to the host); the reader and the training batch decode, the batch on the training device. Nothing
outside this module and store_format.py asks which format a store holds.
"""

import torch

from draftsmith.store_format import BF16, FP8, STATES, StoreFormat, field


class Codec:
    """A store format's encoding of state blocks (its torch side)."""

    fmt: StoreFormat

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, ..., D] (any float dtype and device) -> the parts as stored, on x's device."""
        raise NotImplementedError

    def decode(self, parts: tuple, dtype: torch.dtype) -> torch.Tensor:
        """The parts (on any device) -> the block [T, ..., D] in `dtype` on their device. All-zero parts decode
        to zeros (the training batch pads rows with them)."""
        raise NotImplementedError

    def specs(self, shape: tuple) -> list[tuple[torch.dtype, tuple]]:
        """(dtype, shape) of each stored part of a block of `shape`."""
        raise NotImplementedError

    def problem(self, states: dict[str, tuple]) -> str | None:
        """What is wrong with a file's decoded-to-be states ({state: parts}), None when they are sound."""
        raise NotImplementedError

    def file_tensors(self, state: str, parts: tuple) -> dict[str, torch.Tensor]:
        """A state's parts under their sample-file names."""
        return {field(state, p): t for p, t in zip(self.fmt.parts, parts)}

    def parts_of(self, tensors: dict, state: str) -> tuple:
        """A state's parts from a sample file's tensors (the inverse of file_tensors)."""
        return tuple(tensors[field(state, p)] for p in self.fmt.parts)


class Bf16Codec(Codec):
    """The states cast to bfloat16."""

    fmt = BF16

    def encode(self, x):
        return (x.to(torch.bfloat16).contiguous(),)

    def decode(self, parts, dtype):
        return parts[0].to(dtype)

    def specs(self, shape):
        return [(torch.bfloat16, tuple(shape))]

    def problem(self, states):
        if not all(torch.isfinite(parts[0]).all() for parts in states.values()):
            return "non-finite hidden states"
        return None


FP8_MAX = 448.0  # the largest finite float8 e4m3fn


def quantize_fp8(x):
    """x [..., H] -> (q float8_e4m3fn [..., H], scale float32 [...]): per row, scale = max|x| / 448,
    so the row's largest value maps to e4m3's largest; an all-zero row gets scale 1."""
    # max|x| from the max and min in x's own dtype (exact) instead of an abs() copy, and one float32
    # temporary divided in place: 2.7x the values/s of abs + divide copies on a CPU, same bytes
    # (copy=True: a float32 x must not be divided in place, it is the caller's)
    amax = torch.maximum(x.amax(-1), x.amin(-1).neg()).float()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = x.to(torch.float32, copy=True).div_(scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q, scale, dtype=torch.bfloat16):
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


class Fp8Codec(Codec):
    """float8 e4m3 values with one float32 scale per row (quantize_fp8): x ~= q * scale."""

    fmt = FP8

    def encode(self, x):
        return quantize_fp8(x)

    def decode(self, parts, dtype):
        return dequantize_fp8(*parts, dtype)

    def specs(self, shape):
        return [(torch.float8_e4m3fn, tuple(shape)), (torch.float32, tuple(shape[:-1]))]

    def problem(self, states):
        for state, (_, scale) in states.items():
            if not (torch.isfinite(scale).all() and (scale > 0).all()):
                return f"{field(state, 'scale')}: scales must be finite and positive"
        if not all(torch.isfinite(q.float()).all() for q, _ in states.values()):
            return "non-finite hidden states (NaN in float8)"
        return None


CODECS: dict[str, Codec] = {c.fmt.name: c for c in (Bf16Codec(), Fp8Codec())}  # one per store_format.FORMATS


def codec_of(fmt: StoreFormat) -> Codec:
    """The codec of a store format."""
    return CODECS[fmt.name]


def encoded_states(codec: Codec, tensors: dict) -> dict[str, tuple]:
    """{state: parts} of a sample file's tensors."""
    return {state: codec.parts_of(tensors, state) for state in STATES}
