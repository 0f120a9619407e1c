"""Byte-level tokenizer: every UTF-8 byte is a token, so any text encodes and nothing is
out of vocabulary."""

from __future__ import annotations

import torch


class ByteTokenizer:
    """Maps text to its UTF-8 bytes (ids 0–255) and back."""

    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        """Token ids of ``text`` as a 1-D ``uint8`` tensor."""
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).clone()

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        """Text of ``ids`` (invalid UTF-8 sequences are replaced)."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return bytes(int(v) for v in values).decode("utf-8", errors="replace")
