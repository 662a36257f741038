"""``fxrewrite.testing.routing_near_ties``: the tokens an MoE comparison leaves out are those whose
top-k choice a rounding can flip, found at router modules and at linear ``gate`` children,
wherever a router's output holds its logits (first, after its scores as Llama 4's, or not at
all: then its weight and bias applied to its input)."""

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


class ScoresFirstRouter(nn.Linear):
    """Llama 4's spelling: a linear subclass returning (scores, logits), the scores the sigmoid of
    the top-k logits scattered over -inf (0 for every expert not chosen)."""

    def __init__(self, weight: torch.Tensor, top_k: int) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias=False)
        self.weight.data.copy_(weight)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = super().forward(x.to(self.weight.dtype))
        values, ids = logits.topk(self.top_k, dim=-1)
        return torch.full_like(logits, float("-inf")).scatter(-1, ids, values).sigmoid(), logits


class ChoiceOnlyRouter(Router):
    """A router with a bias (gpt-oss's) whose output holds only the choice: (weights, ids)."""

    def __init__(self, weight: torch.Tensor, top_k: int) -> None:
        super().__init__(weight, top_k)
        self.bias = nn.Parameter(torch.tensor([0.0, 0.0, 0.5]))  # expert 2's bias: 0.5 below the others

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        values, ids = F.linear(x.to(self.weight.dtype), self.weight, self.bias).topk(self.top_k, dim=-1)
        return values.softmax(-1), ids


WEIGHT = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])  # three experts; logits = the token's two values
TOKENS = torch.tensor([[1.0, 0.999], [1.0, 0.0]])  # a near-tie of experts 0 and 1 (0.999 rounds to 1 in bf16); a clear choice


def test_a_near_tie_is_flagged_and_a_clear_choice_is_not() -> None:
    for model in (Router(WEIGHT, 1), GatedBlock(WEIGHT, 1), ScoresFirstRouter(WEIGHT, 1), ChoiceOnlyRouter(WEIGHT, 1)):
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


def test_the_bias_is_part_of_the_logits() -> None:
    """Negative twin of the choice-only router: a bias that lifts expert 2 to 1.0 makes the
    clear choice (1.0 against 0.0) a tie of experts 0 and 2, seen only with the bias added."""
    model = ChoiceOnlyRouter(WEIGHT, 1)
    model.bias.data[2] = 0.999
    near = routing_near_ties(model, copy.deepcopy(model).to(torch.bfloat16), TOKENS.clone())
    assert near is not None and near.tolist() == [True, True]
