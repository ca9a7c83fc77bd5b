"""A small causal language model: token + position embeddings, pre-norm transformer blocks, LM head.

Trainer (demo) and reference engine build it from the same `TinyLMConfig`, so their parameter
names, shapes and order agree, which is what a refit plan is made of.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class TinyLMConfig:
    vocab_size: int = 256
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    max_positions: int = 64

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class Block(nn.Module):
    def __init__(self, cfg: TinyLMConfig):
        super().__init__()
        h = cfg.hidden_size
        self.ln_1 = nn.LayerNorm(h)
        self.attn = nn.MultiheadAttention(h, cfg.num_heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(h)
        self.mlp = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        y = self.ln_1(x)
        x = x + self.attn(y, y, y, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class TinyLM(nn.Module):
    def __init__(self, cfg: TinyLMConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_emb = nn.Embedding(cfg.max_positions, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        pos = torch.arange(n, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        mask = torch.triu(torch.full((n, n), float("-inf"), device=tokens.device), diagonal=1)
        for block in self.blocks:
            x = block(x, mask)
        return self.lm_head(self.ln_f(x))

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """Greedy decoding. Single-threaded so every process computes bit-identical logits."""
        tokens = list(prompt)
        with _one_thread():
            for _ in range(max_new_tokens):
                window = torch.tensor([tokens[-self.cfg.max_positions:]])
                tokens.append(int(self(window)[0, -1].argmax()))
        return tokens[len(prompt):]

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Parameters and buffers in state_dict order: the refit plan's order."""
        yield from self.state_dict(keep_vars=False).items()


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
