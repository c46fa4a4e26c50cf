"""TinyGPT: a small GPT-2 style causal language model for latent fine-tuning (FLITE) on text.

Pre-LayerNorm blocks ``x + Attn(LN(x))`` then ``x + MLP(LN(x))``; causal self-attention with separate
``q``, ``k``, ``v`` and output ``o`` projections; a two-layer MLP (``4 n_embd`` hidden, GELU); learned
token and position embeddings; a final LayerNorm; an LM head tied to the token embedding.

The only ``nn.Linear`` modules are the six projections of each block, in the order
``attn.q, attn.k, attn.v, attn.o, mlp.fc_in, mlp.fc_out``. So FLITE's ``layers: linear`` maps exactly
``6 n_layer`` weight matrices (36 for the 6 layers of the FLITE paper's TinyGPT) and nothing else: the LM
head reuses the embedding matrix through :func:`torch.nn.functional.linear` and is neither a module nor a
second parameter. Biases, LayerNorms and embeddings are never mapped (the mapping maps weights only).

Parameters (``bias=True``, ``E = n_embd``, ``V = vocab_size``, ``C = context``)::

    per block   4 (E^2 + E)  +  (4E^2 + 4E) + (4E^2 + E)  +  2 * 2E  =  12 E^2 + 13 E
    total       n_layer (12 E^2 + 13 E)  +  2E (final LN)  +  V E  +  C E

The FLITE paper's size (6 layers, E=384, 6 heads) has 10,647,552 parameters besides the embeddings.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q, k, v and output projections."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.q = nn.Linear(n_embd, n_embd, bias=bias)
        self.k = nn.Linear(n_embd, n_embd, bias=bias)
        self.v = nn.Linear(n_embd, n_embd, bias=bias)
        self.o = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, e = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.n_head, e // self.n_head).transpose(1, 2)  # (B, H, T, E/H)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, e)  # (B, T, E)
        return self.resid_drop(self.o(y))


class MLP(nn.Module):
    """``fc_out(GELU(fc_in(x)))`` with a ``4 n_embd`` hidden layer."""

    def __init__(self, n_embd: int, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        self.fc_in = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.fc_out = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc_out(F.gelu(self.fc_in(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """GPT-2 style causal language model: token ids ``(B, T)`` in, next-token logits ``(B, T, vocab_size)`` out.

    The FLITE paper's size is the default (6 layers, 384 wide, 6 heads). The LM head is tied to the token
    embedding (``logits = LN(h) @ wte.weight^T``), so the model's only ``nn.Linear`` modules are the
    ``6 n_layer`` projections that FLITE's ``layers: linear`` maps.

    Args:
        vocab_size: Number of token ids.
        n_layer: Transformer blocks.
        n_embd: Width of the residual stream.
        n_head: Attention heads; must divide ``n_embd``.
        context: Longest sequence (number of learned positions); longer inputs are refused.
        dropout: Dropout on embeddings, attention weights and residual branches (training only).
        bias: Biases in the projections and LayerNorms.
    """

    def __init__(
        self,
        vocab_size: int,
        n_layer: int = 6,
        n_embd: int = 384,
        n_head: int = 6,
        context: int = 256,
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        if min(vocab_size, n_layer, n_embd, n_head, context) < 1:
            raise ValueError(
                "model.vocab_size, n_layer, n_embd, n_head and context must be >= 1, got "
                f"{vocab_size}, {n_layer}, {n_embd}, {n_head}, {context}"
            )
        if n_embd % n_head:
            raise ValueError(f"model.n_head={n_head} must divide model.n_embd={n_embd}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {dropout}")
        self.vocab_size, self.context = vocab_size, context
        self.wte = nn.Embedding(vocab_size, n_embd)  # token embedding, also the LM head (tied)
        self.wpe = nn.Embedding(context, n_embd)  # learned positions
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        # GPT-2 initialisation: N(0, 0.02), zero biases, residual output projections scaled by 1/sqrt(2 n_layer).
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            for proj in (block.attn.o, block.mlp.fc_out):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / (2 * n_layer) ** 0.5)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.dim() != 2:
            raise ValueError(f"TinyGPT expects token ids of shape (batch, time), got {tuple(idx.shape)}")
        t = idx.shape[1]
        if t > self.context:
            raise ValueError(
                f"sequence of {t} tokens is longer than the model's context of {self.context}; "
                "crop the input or raise model.context"
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, E)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # (B, T, V): head tied to the embedding

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Extend ``idx`` ``(B, T)`` by ``max_new_tokens`` tokens; returns ``(B, T + max_new_tokens)``.

        See :func:`generate`; runs without dropout (eval mode) and restores the training mode afterwards.
        """
        was_training = self.training
        self.eval()
        try:
            return generate(self, idx, max_new_tokens, self.context, temperature, top_k, generator)
        finally:
            self.train(was_training)


@torch.no_grad()
def generate(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    idx: torch.Tensor,
    max_new_tokens: int,
    context: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Extend ``idx`` ``(B, T)`` by ``max_new_tokens`` tokens of ``logits_fn`` (ids ``(B, T)`` -> ``(B, T, V)``).

    Each step conditions on the last ``context`` tokens only. ``temperature == 0`` is greedy (argmax);
    otherwise tokens are sampled from ``softmax(logits / temperature)``, restricted to the ``top_k`` most
    likely ones when given (ties with the k-th are kept), drawing from ``generator``.
    """
    if idx.dim() != 2 or idx.shape[1] < 1:
        raise ValueError(f"generate expects a non-empty prompt of shape (batch, time), got {tuple(idx.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    for _ in range(max_new_tokens):
        logits = logits_fn(idx[:, -context:])[:, -1, :].float()  # (B, V)
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.shape[-1]:
                kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)  # (B, 1)
        idx = torch.cat([idx, nxt], dim=1)
    return idx
