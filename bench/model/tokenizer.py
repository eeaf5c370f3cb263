"""Byte-level BPE tokenizer of SmolLM2, built from the vocabulary and merges in its GGUF file.

GGUF `tokenizer.ggml.pre = smollm`: digits are split one by one, then the GPT-2 pattern splits
the rest; each piece is mapped to byte-level unicode and merged by rank.
"""
from __future__ import annotations

import functools

import regex

_DIGITS = regex.compile(r"\p{N}")
_GPT2 = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _split_digits(text: str) -> list[str]:
    """Digits(individual_digits=True): every digit its own piece, the text between kept."""
    out, last = [], 0
    for m in _DIGITS.finditer(text):
        if m.start() > last:
            out.append(text[last:m.start()])
        out.append(m.group())
        last = m.end()
    if last < len(text):
        out.append(text[last:])
    return out


class Tokenizer:
    def __init__(self, tokens: list[str], merges: list[str], bos_id: int, eos_id: int):
        self.tokens = tokens
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
        self.bos_id = bos_id
        self.eos_id = eos_id
        self._byte_enc = bytes_to_unicode()
        self._byte_dec = {c: b for b, c in self._byte_enc.items()}
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def from_gguf(cls, reader) -> "Tokenizer":
        f = reader.fields
        return cls(list(f["tokenizer.ggml.tokens"].contents()),
                   list(f["tokenizer.ggml.merges"].contents()),
                   int(f["tokenizer.ggml.bos_token_id"].contents()),
                   int(f["tokenizer.ggml.eos_token_id"].contents()))

    def _bpe(self, word: str) -> list[int]:
        hit = self._cache.get(word)
        if hit is not None:
            return hit
        parts = list(word)
        while len(parts) > 1:
            best, best_rank = -1, None
            for i in range(len(parts) - 1):
                r = self.ranks.get((parts[i], parts[i + 1]))
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = i, r
            if best < 0:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        ids = [self.ids[p] for p in parts]
        self._cache[word] = ids
        return ids

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for piece in _split_digits(text):
            for m in _GPT2.finditer(piece):
                word = "".join(self._byte_enc[b] for b in m.group().encode("utf-8"))
                out.extend(self._bpe(word))
        return out

    def decode(self, ids) -> str:
        data = bytes(self._byte_dec[c] for i in ids for c in self.tokens[int(i)])
        return data.decode("utf-8", errors="replace")

    def delimiter_ids(self, marks: str = ".,;:!?\n") -> list[int]:
        """Ids of the tokens that end in a punctuation mark or a newline (surrounding
        whitespace aside): where boundary chunking may cut."""
        out = []
        for i, t in enumerate(self.tokens):
            try:
                text = bytes(self._byte_dec[c] for c in t).decode("utf-8")
            except (KeyError, UnicodeDecodeError):
                continue  # special and partial-byte tokens
            stripped = text.rstrip(" \t")
            if stripped and (stripped[-1] in marks or "\n" in text):
                out.append(i)
        return out
