"""Token sources (embedded corpus, a text file, a token file) and deterministic batches.

The batch of step ``n`` is a pure function of ``(seed, n)``: random windows drawn with a
generator seeded from both. Resuming at step ``n`` therefore needs only ``n`` — the data
position is exact without saving any iterator state.
"""

from __future__ import annotations

import errno
import gzip
import os
import pickle
import stat
import warnings
from importlib import resources
from pathlib import Path

import torch

from hybridtrain.data.tokenizer import ByteTokenizer

_TOKEN_FILE_DTYPES = {".bin": torch.uint16, ".u16": torch.uint16, ".i32": torch.int32, ".i64": torch.int64}


def load_tokens(path: str | Path | None = None) -> torch.Tensor:
    """Tokens of a dataset as a 1-D tensor.

    Args:
        path: ``None`` for the embedded corpus; a ``.bin``/``.u16`` (uint16), ``.i32`` or
            ``.i64`` raw token file, a ``.pt`` file holding a 1-D tensor, a ``.npy`` NumPy
            array, or any text file (byte-tokenized).

    Raises:
        ValueError: the file does not exist or holds no usable tokens (too few, negative,
            not integers); one line naming the file.
    """
    tokenizer = ByteTokenizer()
    if path is None:
        blob = resources.files("hybridtrain.data").joinpath("corpus.txt.gz").read_bytes()
        return tokenizer.encode(gzip.decompress(blob).decode("utf-8"))
    path = Path(path)
    _check_regular_file(path)
    suffix = path.suffix.lower()
    if suffix in _TOKEN_FILE_DTYPES:
        dtype = _TOKEN_FILE_DTYPES[suffix]
        raw = bytearray(path.read_bytes())
        if not raw:
            raise ValueError(f"data.path = {str(path)!r} is empty; it should hold {dtype} token ids")
        if len(raw) % dtype.itemsize:
            raise ValueError(f"data.path = {str(path)!r} is not a whole number of {dtype} tokens")
        # uint16 (nanoGPT's format) supports few operations (max, comparisons): widen it.
        tokens = torch.frombuffer(raw, dtype=dtype).to(torch.int32 if dtype == torch.uint16 else dtype)
    elif suffix == ".pt":
        tokens = _load_pt(path)
    elif suffix == ".npy":
        tokens = _load_npy(path)
    else:
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text:
            raise ValueError(f"data.path = {str(path)!r} is empty; give a text file with at least data.seq_len + 1 "
                             "characters, or a token file")
        tokens = tokenizer.encode(text)
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise ValueError(f"data.path = {str(path)!r} holds {tokens.dtype} values; token ids are integers")
    if tokens.numel() < 2:
        raise ValueError(f"data.path = {str(path)!r} holds {tokens.numel()} tokens; need at least 2")
    lowest = int(tokens.min())
    if lowest < 0:
        raise ValueError(f"data.path = {str(path)!r} holds negative token ids (the smallest is {lowest}); "
                         "token ids are 0 or more")
    return tokens


def _check_regular_file(path: Path) -> None:
    """One line naming ``path`` and what it is, when it is not a readable regular file
    (a directory, a FIFO, a symbolic-link loop, missing, unreadable)."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError(f"data.path = {str(path)!r} is a symbolic link loop; point it at the data file itself") \
                from None
        if exc.errno == errno.ENOENT:
            raise ValueError(f"data.path = {str(path)!r} does not exist") from None
        raise ValueError(f"data.path = {str(path)!r} cannot be read: {exc.strerror}") from None
    if stat.S_ISDIR(mode):
        raise ValueError(f"data.path = {str(path)!r} is a directory; give the text or token file inside it")
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
        raise ValueError(f"data.path = {str(path)!r} is {kind}, not a regular file; the data is read whole and "
                         "sampled at random, so give a file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"data.path = {str(path)!r} cannot be read (permission denied)")


def _load_pt(path: Path) -> torch.Tensor:
    """A ``.pt`` file's 1-D dense tensor of token ids, read with ``weights_only`` (no code runs)."""
    try:
        with warnings.catch_warnings():  # torch warns about the pickle protocol before refusing
            warnings.simplefilter("ignore", UserWarning)
            tokens = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        with open(path, "rb") as fh:
            pickled = fh.read(1) == b"\x80"  # a pickle's protocol opcode; torch.save writes a zip
        if not pickled:
            raise ValueError(f"data.path = {str(path)!r} is not a readable torch.save file of a token tensor "
                             f"({' '.join(str(exc).split()).split('. ')[0][:120]})") from None
        raise ValueError(f"data.path = {str(path)!r} is a pickle of something other than tensors (only "
                         "tensors are loaded: unpickling anything else could run code); save the tokens "
                         "with torch.save(tensor, path)") from None
    except (RuntimeError, EOFError, ValueError, IndexError, KeyError, AttributeError, TypeError, OSError) as exc:
        # Random bytes, a truncated zip, an object torch cannot rebuild.
        words = " ".join(str(exc).split()).split(". ")[0][:160] or type(exc).__name__
        raise ValueError(f"data.path = {str(path)!r} is not a readable torch.save file of a token tensor "
                         f"({words})") from None
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.layout != torch.strided:
        what = (f"a {tokens.layout} tensor" if isinstance(tokens, torch.Tensor) and tokens.layout != torch.strided
                else f"a {tokens.dim()}-D tensor" if isinstance(tokens, torch.Tensor) else type(tokens).__name__)
        raise ValueError(f"data.path = {str(path)!r} holds {what}; it must hold a dense 1-D tensor of token ids")
    return tokens


def _load_npy(path: Path) -> torch.Tensor:
    """A NumPy ``.npy`` array of token ids (1-D)."""
    try:
        import numpy as np
    except ImportError:
        raise ValueError(f"data.path = {str(path)!r} is a NumPy file; install numpy to read it") from None
    try:
        array = np.load(path, allow_pickle=False)
    except ValueError as exc:
        raise ValueError(f"data.path = {str(path)!r} is not a readable .npy array: {exc}") from None
    if array.ndim != 1:
        raise ValueError(f"data.path = {str(path)!r} holds a {array.ndim}-D array; token ids are 1-D")
    if array.dtype.kind not in "iu":
        raise ValueError(f"data.path = {str(path)!r} holds {array.dtype} values; token ids are integers")
    widened = array.astype(np.int64 if array.dtype.itemsize > 4 or array.dtype == np.uint32 else np.int32)
    return torch.from_numpy(widened)


class TokenBatches:
    """Deterministic ``(inputs, targets)`` batches of next-token prediction windows.

    Args:
        tokens: 1-D token ids.
        seq_len: tokens per sample.
        val_fraction: tail fraction of the tokens held out for :meth:`eval_batch`.
        seed: mixes into every batch's generator.
        source: the file the tokens came from, named in errors.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, val_fraction: float = 0.05, seed: int = 0,
                 source: str | Path | None = None) -> None:
        split = int(tokens.numel() * (1.0 - val_fraction))
        self.train_tokens = tokens[:split]
        self.val_tokens = tokens[split:] if val_fraction > 0 else tokens[:split]
        self.seq_len = seq_len
        self.seed = seed
        for name, part in (("training", self.train_tokens), ("held-out", self.val_tokens)):
            if part.numel() <= seq_len:
                where = f"data.path = {str(source)!r}: " if source is not None else ""
                raise ValueError(f"{where}the {name} data has {part.numel()} tokens, fewer than data.seq_len + 1 = "
                                 f"{seq_len + 1}; use a shorter seq_len or more data")

    @property
    def max_token(self) -> int:
        """Largest token id (the model's vocabulary must exceed it)."""
        return int(max(self.train_tokens.max(), self.val_tokens.max()))

    def train_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The training batch of optimizer step ``step`` (0-based)."""
        return self._windows(self.train_tokens, step, batch_size, stream=0)

    def eval_batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out batch number ``index`` (the same for every evaluation)."""
        return self._windows(self.val_tokens, index, batch_size, stream=1)

    def _windows(self, tokens: torch.Tensor, index: int, batch_size: int,
                 stream: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + index) * 2 + stream)
        starts = torch.randint(0, tokens.numel() - self.seq_len, (batch_size,), generator=gen)
        offsets = torch.arange(self.seq_len + 1)
        windows = tokens[starts[:, None] + offsets].long()  # (B, T + 1)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
