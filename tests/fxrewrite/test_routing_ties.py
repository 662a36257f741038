"""``fxrewrite.testing.routing_near_ties``: the tokens an MoE comparison leaves out are those whose
top-k choice a rounding can flip, found at router modules and at linear ``gate`` children."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from fxrewrite.testing import routing_near_ties


class Router(nn.Module):
    """transformers 5's spelling: the router owns its weight and returns (logits, ...)."""

    def __init__(self, weight: torch.Tensor, top_k: int) -> None:
        super().__init__()
        self.weight, self.top_k = nn.Parameter(weight), top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.to(self.weight.dtype), self.weight)  # float32 tokens into either precision
        return logits, logits.softmax(-1)


class GatedBlock(nn.Module):
    """The older spelling: the block holds ``top_k`` and a linear ``gate``."""

    def __init__(self, weight: torch.Tensor, top_k: int) -> None:
        super().__init__()
        self.gate, self.top_k = nn.Linear(weight.shape[1], weight.shape[0], bias=False), top_k
        self.gate.weight.data.copy_(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x.to(self.gate.weight.dtype)).softmax(-1)


WEIGHT = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])  # three experts; logits = the token's two values
TOKENS = torch.tensor([[1.0, 0.999], [1.0, 0.0]])  # a near-tie of experts 0 and 1 (0.999 rounds to 1 in bf16); a clear choice


def test_a_near_tie_is_flagged_and_a_clear_choice_is_not() -> None:
    for model in (Router(WEIGHT, 1), GatedBlock(WEIGHT, 1)):
        near = routing_near_ties(model, copy.deepcopy(model).to(torch.bfloat16), TOKENS.clone())
        assert near is not None and near.tolist() == [True, False], type(model).__name__


def test_no_router_or_no_choice_flags_nothing() -> None:
    """A model without routers: None; a router that picks every expert: nothing to flip."""
    dense = nn.Linear(2, 3)
    assert routing_near_ties(dense, dense, TOKENS.clone()) is None
    every = Router(WEIGHT, 3)
    near = routing_near_ties(every, copy.deepcopy(every).to(torch.bfloat16), TOKENS.clone())
    assert near is not None and near.tolist() == [False, False]


def test_causal_marks_the_later_tokens_of_a_marked_sequence() -> None:
    """Two sequences of three tokens; a near-tie at the second token of the first: its third
    token is marked too (attention), the second sequence not at all."""
    tokens = torch.tensor([[1.0, 0.0], [1.0, 0.999], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    model = Router(WEIGHT, 1)
    near = routing_near_ties(model, copy.deepcopy(model).to(torch.bfloat16), tokens, causal=(2, 3))
    assert near is not None and near.tolist() == [[False, True, True], [False, False, False]]
