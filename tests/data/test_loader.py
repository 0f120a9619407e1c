"""Embedded corpus, byte tokenizer, token files and deterministic batches."""

from __future__ import annotations

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
