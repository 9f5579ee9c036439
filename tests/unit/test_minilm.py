"""The real MiniLM (offline weights, CPU): a batch of mixed lengths runs in
passes by length, and every input still gets its own embedding, in order."""

from __future__ import annotations

import pytest
import torch

from models.minilm import MAX_SEQ_LENGTH, MiniLMEmbed

SHORT = [f"Short sentence number {i}." for i in range(31)]
LONG = " ".join(f"word{i}" for i in range(600))  # far past the 256-word-piece window


@pytest.fixture(scope="module")
def model():
    m = MiniLMEmbed(device="cpu", dtype="fp32")
    m.load()
    return m


def test_a_long_input_pads_only_its_own_pass(model, monkeypatch):
    passes = []
    forward = model._forward

    def recording(token_ids):
        passes.append((len(token_ids), max(len(t) for t in token_ids)))
        return forward(token_ids)

    monkeypatch.setattr(model, "_forward", recording)
    model.embed(SHORT[:15] + [LONG] + SHORT[15:])
    assert (1, MAX_SEQ_LENGTH) in passes  # the long input, truncated, alone
    assert sum(rows for rows, _ in passes) == 32
    assert all(length < 20 for rows, length in passes if (rows, length) != (1, MAX_SEQ_LENGTH))


def test_each_input_gets_its_own_embedding_in_order(model, monkeypatch):
    texts = SHORT[:5] + [LONG] + ["A cat sits on the mat.", "x"] + SHORT[5:9]
    alone = torch.stack([model.embed([t])[0] for t in texts])
    monkeypatch.setattr(model, "pass_tokens", (0, 40))  # many small passes
    together = model.embed(texts)
    assert torch.allclose(together, alone, atol=1e-5)


def test_text_past_the_window_is_ignored(model):
    a, b = model.embed([LONG + " tail one", LONG + " something else entirely"])
    assert torch.equal(a, b)


@pytest.mark.parametrize("device, error", [("gpu", ValueError), ("cuda:1", ValueError),
                                           ("cuda", None if torch.cuda.is_available() else RuntimeError)])
def test_a_device_it_cannot_honour_stops_the_model_rather_than_falling_back_to_the_cpu(device, error):
    if error is None:
        pytest.skip("a GPU is present")
    with pytest.raises(error, match="SLUICE_DEVICE"):
        MiniLMEmbed(device=device)


def test_an_unknown_dtype_is_named():
    with pytest.raises(ValueError, match="SLUICE_MINILM_DTYPE='fp16'"):
        MiniLMEmbed(device="cpu", dtype="fp16")
