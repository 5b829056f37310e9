"""The extract store's layout and its formats, without torch: what `estimate` and `status` need of it
(extract/store.py writes and reads the files, extract/codecs.py encodes and decodes the states).

RUN/extract/rows_{start}-{end}/{i}.safetensors, one file per sample. A file holds input_ids [L] int32,
loss_mask [L] uint8 and two states, `aux` [L, A, H] (entering the A auxiliary layers) and `last` [L, H]
(the final normed state), each stored as the parts its format names: field `{state}_{part}`.

A store format is a StoreFormat in FORMATS, found by name (extract.store_format, meta.json's
`store_format`). Adding one: its facts here, its codec (same name) in extract/codecs.py; nothing
else names a format.
"""

from dataclasses import dataclass

from draftsmith import DraftsmithError

FORMAT_VERSION = 1
STATES = ("aux", "last")  # the states of a sample file, in field order
FILE_OVERHEAD = 1024  # bytes per sample file beyond the tensors: safetensors header + metadata
TOKEN_BYTES = 4 + 1  # per token beside the states: an int32 id and a uint8 mask


@dataclass(frozen=True)
class StoreFormat:
    """How a store's sample files hold the states (the torch-free facts; the codec is extract/codecs.py's)."""

    name: str  # extract.store_format and meta.json's `store_format`
    dtype: str  # meta.json's `dtype`: what the state values are stored in (a torch dtype's name)
    parts: tuple[str, ...]  # each state's tensors in the file, the values first: field `{state}_{part}`
    value_bytes: int  # bytes per stored value
    row_bytes: int  # bytes per row (a token's state of one layer) beside its values, e.g. a float32 scale
    quantised: bool  # the values are computed from the states (scales, rounding), not cast: host work on a CPU

    @property
    def fields(self) -> tuple[str, ...]:
        """The tensors of a sample file (meta.json's `fields`), in order."""
        return ("input_ids", "loss_mask", *(field(state, p) for state in STATES for p in self.parts))

    def bytes_per_token(self, num_aux: int, hidden_size: int) -> int:
        """Bytes on disk per token: A aux rows and the last row of H values, an id and a mask."""
        return (num_aux + 1) * (hidden_size * self.value_bytes + self.row_bytes) + TOKEN_BYTES

    @property
    def settings(self) -> dict:
        """What the extract manifest's settings record of the format (absent for the legacy one, so that
        a store made before the key stays current when it is asked for)."""
        return {} if self is LEGACY else {"store_format": self.name}


def field(state: str, part: str) -> str:
    """A sample file's tensor name for one part of a state ('aux', 'hidden' -> 'aux_hidden')."""
    return f"{state}_{part}"


BF16 = StoreFormat("bf16", dtype="bfloat16", parts=("hidden",), value_bytes=2, row_bytes=0, quantised=False)
# float8 e4m3 with one float32 scale per row (token and layer): x ~= q * scale
FP8 = StoreFormat("fp8", dtype="float8_e4m3fn", parts=("hidden", "scale"), value_bytes=1, row_bytes=4,
                  quantised=True)
FORMATS = {f.name: f for f in (BF16, FP8)}
FORMAT_NAMES = tuple(FORMATS)  # extract.store_format's choices
LEGACY = BF16  # what a store holds whose meta.json (or manifest) predates the `store_format` key


def store_format(name: str, where: str = "extract.store_format") -> StoreFormat:
    """The format of that name; an unknown one is a one-line error naming `where`."""
    fmt = FORMATS.get(name)
    if fmt is None:
        raise DraftsmithError(f"{where}: store format {name!r} is not one this draftsmith knows ({', '.join(FORMATS)})")
    return fmt


def format_name(record: dict) -> str:
    """The name of the format a meta.json (or the extract manifest's settings) records; LEGACY's when none."""
    return str(record.get("store_format") or LEGACY.name)


def format_of(record: dict, where: str = "extract/meta.json") -> StoreFormat:
    """The format a meta.json (or the extract manifest's settings) records; an unknown one: an error naming `where`."""
    return store_format(format_name(record), f"{where}: store_format")


def shard_ranges(num_samples: int, shard_size: int) -> list[tuple[int, int]]:
    """[(start, end)] covering 0..num_samples-1, end exclusive."""
    return [(s, min(s + shard_size, num_samples)) for s in range(0, num_samples, shard_size)]


def shard_name(start: int, end: int) -> str:
    return f"rows_{start}-{end}"


def sample_name(index: int) -> str:
    return f"{index}.safetensors"


def bytes_per_token(num_aux: int, hidden_size: int, name: str = LEGACY.name) -> int:
    """Bytes on disk per token of a store in the format of that name (extract.store_format)."""
    return store_format(name).bytes_per_token(num_aux, hidden_size)
