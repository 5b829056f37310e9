"""A tiktoken tokenizer in the form of Kimi's (moonshotai's `tokenization_kimi.py`: a Python tokenizer
loaded as the folder's own code through `auto_map`, over `tiktoken.model`), for the tiny Kimi-K2.5
test family. Written for draftsmith's tests; it reads the SmolLM2 vocabulary that tests/families.py
converts into `tiktoken.model` (base64 token bytes and rank per line, Kimi's file format).

It is a "slow" tokenizer: transformers gives it no offset mapping, which is what prepare must cope with.
"""

import base64
from pathlib import Path

import tiktoken
from transformers import PreTrainedTokenizer

# GPT-2's pre-tokenizer split (SmolLM2's ByteLevel regex)
PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _read_ranks(path: str) -> dict[bytes, int]:
    ranks = {}
    for line in Path(path).read_text().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


class TinyKimiTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, special_tokens: dict | None = None, **kwargs):
        self.vocab_file = vocab_file
        ranks = _read_ranks(vocab_file)
        specials = {k: int(v) for k, v in (special_tokens or {}).items()}
        self.model = tiktoken.Encoding(name=Path(vocab_file).parent.name, pat_str=PAT, mergeable_ranks=ranks,
                                       special_tokens=specials)
        # tokens as latin-1 strings of their bytes: transformers' Python tokenizers pass strings around
        self.decoder = {r: b.decode("latin-1") for b, r in ranks.items()} | {i: s for s, i in specials.items()}
        self.encoder = {s: i for i, s in self.decoder.items()}
        self.special = specials
        super().__init__(special_tokens=special_tokens, **kwargs)

    @property
    def vocab_size(self) -> int:
        return max(self.decoder) + 1

    def get_vocab(self) -> dict[str, int]:
        return dict(self.encoder)

    def _tokenize(self, text, **kwargs):
        return [self.decoder[i] for i in self.model.encode_ordinary(text)]

    def _convert_token_to_id(self, token):
        return self.encoder.get(token, self.encoder.get(self.unk_token, 0))

    def _convert_id_to_token(self, index):
        return self.decoder.get(index, "")

    def convert_tokens_to_string(self, tokens):
        out, buf = [], bytearray()
        for t in tokens:
            if t in self.special:
                out.append(buf.decode("utf-8", errors="replace") + t)
                buf = bytearray()
            else:
                buf += t.encode("latin-1")
        return "".join(out) + buf.decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        dest = Path(save_directory) / ((filename_prefix + "-" if filename_prefix else "") + "tiktoken.model")
        if Path(self.vocab_file).resolve() != dest.resolve():
            dest.write_bytes(Path(self.vocab_file).read_bytes())
        return (str(dest),)
