"""A transformer's layers as the steps of an ODE: the residual stream is the state.

A pre-LayerNorm block, ``Y = X + A + MLP(LN2(X + A))`` with ``A = SA(LN1(X))``, is one forward
Euler step ``X + h f(X)`` of step size 1 with ``f(X) = phi1(X) + phi2(X + phi1(X))``,
``phi1 = SA o LN1`` and ``phi2 = MLP o LN2`` (as Jiang, Salvado-Benasco, Cyr, Kopanicakova,
Krause and Schroder write it, "Layer-Parallel Training for Transformers", 2026).  So
:class:`TransformerStep` is ``f``: a ``LayerParallelModule`` whose step layers are these, with
``dt = 1`` (``t_final`` = the number of layers), computes the usual pre-LN stack exactly, and
MGRIT's coarse levels step ``f`` with a larger step.  The open layer embeds tokens and positions
(:class:`TokenEmbedding`), the close layer normalizes and projects to the vocabulary
(:class:`LMHead`).
"""

from typing import Optional

import torch
from torch import nn

__all__ = ["LMHead", "TokenEmbedding", "TransformerStep"]


class TransformerStep(nn.Module):
    """``f(X) = phi1(X) + phi2(X + phi1(X))`` of one pre-LN transformer layer, on states of
    shape (batch, sequence, d_model).

    Args:
        d_model: the width of the residual stream.
        n_heads: attention heads (``d_model`` must be a multiple).
        d_ff: the MLP's hidden width (default ``4 * d_model``).
        causal: mask each position's attention to itself and the positions before it (a
            decoder, a language model); False: every position sees all (an encoder, a ViT).
        dropout: must be 0.  MGRIT runs a step several times per solve (and the exact path's
            backward may run it again); each run would draw another mask, so the gradient
            would not be the loss's.  Refused rather than silently wrong.
        bias: whether the linear maps have biases.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: Optional[int] = None,
        causal: bool = True,
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        if dropout != 0:
            raise ValueError(
                f"TransformerStep(dropout={dropout!r}): dropout is not supported in "
                "layer-parallel steps: MGRIT runs a step several times per solve, and each "
                "run would draw another mask; use dropout=0 (regularize in the open or "
                "close layer instead)"
            )
        if d_model % n_heads:
            raise ValueError(
                f"TransformerStep: d_model={d_model} is not a multiple of n_heads={n_heads}"
            )
        self.causal = causal
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_heads, bias=bias, batch_first=True)
        self.ln2 = nn.LayerNorm(d_model)
        hidden = d_ff if d_ff is not None else 4 * d_model
        self.mlp = nn.Sequential(
            nn.Linear(d_model, hidden, bias=bias), nn.GELU(), nn.Linear(hidden, d_model, bias=bias)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        mask = None
        if self.causal:  # True where a position may not look: the ones after it
            n = x.shape[1]
            mask = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        return a + self.mlp(self.ln2(x + a))


class TokenEmbedding(nn.Module):
    """The open layer of a language model: token and learned position embeddings, summed;
    token ids (batch, sequence) to states (batch, sequence, d_model)."""

    def __init__(self, vocab: int, d_model: int, max_len: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(max_len, d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        if n > self.positions.num_embeddings:
            raise ValueError(
                f"a sequence of {n} tokens is longer than the {self.positions.num_embeddings} "
                "positions this embedding has (max_len)"
            )
        where = torch.arange(n, device=ids.device)
        return self.tokens(ids) + self.positions(where)


class LMHead(nn.Module):
    """The close layer of a language model: a final LayerNorm and the map to the vocabulary's
    logits, (batch, sequence, d_model) to (batch, sequence, vocab)."""

    def __init__(self, d_model: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))
