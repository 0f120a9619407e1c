"""Demo data that needs no download: an embedded corpus, a byte-level tokenizer, batches."""

from hybridtrain.data.loader import TokenBatches, load_tokens
from hybridtrain.data.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "TokenBatches", "load_tokens"]
