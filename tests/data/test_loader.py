"""Embedded corpus, byte tokenizer, token files and deterministic batches."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from hybridtrain.data import ByteTokenizer, TokenBatches, load_tokens


def test_embedded_corpus_is_real_text() -> None:
    tokens = load_tokens()
    assert 400_000 < tokens.numel() < 2_000_000
    text = ByteTokenizer().decode(tokens[:2000])
    assert "the" in text and text.isprintable() or "\n" in text


def test_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("héllo ✓")) == "héllo ✓"


def test_text_and_token_files(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("abc" * 100)
    assert load_tokens(tmp_path / "a.txt")[:3].tolist() == [97, 98, 99]
    ids = torch.arange(1000, dtype=torch.int32) * 7
    (tmp_path / "t.i32").write_bytes(ids.numpy().tobytes())
    assert torch.equal(load_tokens(tmp_path / "t.i32"), ids)
    torch.save(ids.long(), tmp_path / "t.pt")
    assert torch.equal(load_tokens(tmp_path / "t.pt"), ids.long())
    with pytest.raises(ValueError, match="does not exist"):
        load_tokens(tmp_path / "missing.txt")
    (tmp_path / "odd.u16").write_bytes(b"abc")
    with pytest.raises(ValueError, match="whole number"):
        load_tokens(tmp_path / "odd.u16")


def test_batches_are_a_function_of_the_step() -> None:
    data = TokenBatches(torch.arange(5000), seq_len=16, seed=3)
    x, y = data.train_batch(7, 4)
    assert x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(data.train_batch(7, 4)[0], x)
    assert not torch.equal(data.train_batch(8, 4)[0], x)
    assert int(data.eval_batch(0, 4)[0].min()) >= int(5000 * 0.95)
    with pytest.raises(ValueError, match="seq_len"):
        TokenBatches(torch.arange(50), seq_len=64)


def test_token_files_in_every_documented_format(tmp_path: Path) -> None:
    import numpy as np

    ids = np.arange(300, dtype=np.uint16) * 200  # up to 59,800: needs all 16 bits
    (tmp_path / "t.bin").write_bytes(ids.tobytes())
    (tmp_path / "t.u16").write_bytes(ids.tobytes())
    np.save(tmp_path / "t.npy", ids.astype(np.int32))
    for name in ("t.bin", "t.u16", "t.npy"):
        tokens = load_tokens(tmp_path / name)
        assert int(tokens.max()) == 59_800 and tokens[1] == 200
        data = TokenBatches(tokens, seq_len=8)
        x, y = data.train_batch(0, 2)
        assert data.max_token == 59_800 and x.dtype == y.dtype == torch.int64


def test_bad_token_files_are_one_line(tmp_path: Path) -> None:
    import numpy as np

    np.save(tmp_path / "neg.npy", np.array([1, -3, 2], dtype=np.int64))
    np.save(tmp_path / "float.npy", np.array([1.0, 2.0]))
    np.save(tmp_path / "two.npy", np.zeros((2, 2), dtype=np.int64))
    torch.save(torch.tensor([4, -1, 2]), tmp_path / "neg.pt")
    (tmp_path / "empty.bin").write_bytes(b"")
    for name, needle in (("neg.npy", "negative token ids (the smallest is -3)"), ("float.npy", "float64 values"),
                         ("two.npy", "2-D array"), ("neg.pt", "the smallest is -1"), ("empty.bin", "is empty")):
        with pytest.raises(ValueError, match=re.escape(needle)):
            load_tokens(tmp_path / name)
