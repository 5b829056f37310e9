"""The extract store's layout and sizes, without torch: what `estimate` and `status` need of it (extract/store.py
writes and reads the files themselves, and imports these names from here).

RUN/extract/rows_{start}-{end}/{i}.safetensors, one file per sample; its tensors and their dtypes by store format:
bf16 (aux and last hidden states in bfloat16) or fp8 (float8 e4m3 with a float32 scale per token and layer).
"""

FORMAT_VERSION = 1
FIELDS = ("input_ids", "loss_mask", "aux_hidden", "last_hidden")
STORE_DTYPE = "bfloat16"
STORE_FORMATS = ("bf16", "fp8")
FORMAT_FIELDS = {
    "bf16": FIELDS,
    # aux/last as float8 e4m3 with one float32 scale per row (per token and layer): x ~= q * scale
    "fp8": ("input_ids", "loss_mask", "aux_hidden", "aux_scale", "last_hidden", "last_scale"),
}
FORMAT_DTYPE = {"bf16": STORE_DTYPE, "fp8": "float8_e4m3fn"}  # meta.json's `dtype`: what the state tensors hold
FILE_OVERHEAD = 1024  # bytes per sample file beyond the tensors: safetensors header + metadata


def shard_ranges(num_samples: int, shard_size: int) -> list[tuple[int, int]]:
    """[(start, end)] covering 0..num_samples-1, end exclusive."""
    return [(s, min(s + shard_size, num_samples)) for s in range(0, num_samples, shard_size)]


def shard_name(start: int, end: int) -> str:
    return f"rows_{start}-{end}"


def sample_name(index: int) -> str:
    return f"{index}.safetensors"


def bytes_per_token(num_aux: int, hidden_size: int, store_format: str = "bf16") -> int:
    """Bytes on disk per token: (aux + last) states, an int32 id and a uint8 mask. bf16: 2 bytes
    per value; fp8: 1 byte per value and a float32 scale per row (token and layer)."""
    if store_format == "fp8":
        return (num_aux + 1) * (hidden_size + 4) + 4 + 1
    return (num_aux + 1) * hidden_size * 2 + 4 + 1
