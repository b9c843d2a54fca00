"""A small decoder-only transformer for byte-level text (``--model transformer``).

GPT-2's shape at a size a few CPU cores can train: token and learned position embeddings,
``layers`` pre-LayerNorm blocks of causal multi-head self-attention and a GELU MLP four
times as wide, a final LayerNorm and a linear head to the vocabulary. The default size
(vocabulary 256, context 64, d_model 256, 2 layers, 4 heads) has 1,727,744 parameters,
chosen as the largest whose default ``gemq run`` on ``pysource`` ends well below the
unigram baseline on a 2-core machine in minutes (docs/performance.md, "The text workload").
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t sees positions 0 to t only."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        # (B, T, 3, heads, head width) -> three (B, heads, T, head width)
        q, k, v = (self.qkv(x).view(batch, length, 3, self.heads, width // self.heads)
                   .permute(2, 0, 3, 1, 4).unbind(0))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    """x + attention(LayerNorm(x)), then x + MLP(LayerNorm(x)), the MLP four times as wide
    as the model, with GELU."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class Transformer(nn.Module):
    """A decoder-only, pre-LayerNorm transformer language model.

    ``forward(x)`` takes token ids shaped (B, T), T at most ``context``, and returns the
    next-token logits shaped (B, vocab, T): ``F.cross_entropy(model(x), y)``, y the next
    tokens shaped (B, T), is the mean loss per token, gemq's default loss unchanged.

    Parameters: ``12 d² + 13 d`` per layer, plus ``(vocab + context) d`` embeddings, ``2 d``
    for the final LayerNorm and ``(d + 1) vocab`` for the head (d = ``d_model``): 1,727,744
    parameters at the default size (vocab 256, context 64, d_model 256, 2 layers, 4 heads).
    Initialised as GPT-2: weights normal with std 0.02, biases zero, LayerNorms one and zero,
    and the projections that add to the residual stream (attention output and MLP output)
    with std 0.02 / sqrt(2 layers).
    """

    def __init__(self, vocab: int = 256, context: int = 64, d_model: int = 256,
                 layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")
        self.context = context
        self.token = nn.Embedding(vocab, d_model)
        self.position = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.apply(_init_weights)
        residual_std = 0.02 / math.sqrt(2 * layers)
        for block in self.blocks:
            assert isinstance(block, Block)
            nn.init.normal_(block.attn.proj.weight, std=residual_std)
            nn.init.normal_(block.proj.weight, std=residual_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        if length > self.context:
            raise ValueError(f"{length} tokens: this model's context is {self.context}")
        positions = torch.arange(length, device=x.device)
        h = self.token(x) + self.position(positions)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h)).transpose(1, 2)


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
