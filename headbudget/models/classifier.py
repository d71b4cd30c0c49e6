"""The budgeted classifier: gated encoder, pooling, linear head, and the learned gate controller."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from headbudget.models.budget import GateParams, head_order
from headbudget.models.config import ModelConfig
from headbudget.models.encoder import Encoder
from headbudget.models.plan import BudgetPolicy, soft_cost_weights


class GateController(nn.Module):
    """Per-unit logit a_lu and budget sensitivity beta_lu = softplus(raw_lu) (docs/method.md §2 and §4).

    Units per layer: the H heads, then (whole-model scope) the feed-forward neuron groups.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        shape = (cfg.n_layers, cfg.units_per_layer)
        self.logit = nn.Parameter(torch.full(shape, cfg.gate.init_logit))
        self.raw_beta = nn.Parameter(torch.full(shape, cfg.gate.init_raw_beta))

    def forward(self, budget: torch.Tensor) -> torch.Tensor:
        """budget (B,) -> soft gates g(b), shape (B, L, U), monotone non-decreasing in b."""
        eps = self.cfg.gate.eps
        b = budget.clamp(eps, 1.0 - eps).to(self.logit.dtype)
        lb = torch.log(b / (1.0 - b))[:, None, None]  # (B, 1, 1)
        beta = F.softplus(self.raw_beta)
        return torch.sigmoid((self.logit[None] + beta[None] * lb) / self.cfg.gate.tau)

    def params(self) -> GateParams:
        """The current a and beta as float64 arrays, for the torch-free mask policy."""
        a = self.logit.detach().double().cpu().numpy()
        beta = F.softplus(self.raw_beta.detach().double()).cpu().numpy()
        return GateParams(a=a, beta=beta)

    def order(self) -> np.ndarray:
        """Flat unit ranking by crossing budget (see models/budget.py)."""
        return head_order(self.params())

    def policy(self) -> BudgetPolicy:
        """The serving policy of the current gates: budget -> hard mask and plan."""
        return BudgetPolicy(self.cfg, self.order())

    def hard_mask(self, budget: float) -> np.ndarray:
        """The serving mask for ``budget``: bool (L, U), nested across budgets by construction."""
        return self.policy().mask(budget)


class BudgetedClassifier(nn.Module):
    """Encoder classifier that runs dense, with soft gates, with a hard mask, or with straight-through gates."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.classifier = nn.Linear(cfg.hidden_size, cfg.n_labels)
        self.dropout = nn.Dropout(cfg.dropout)
        # Only checkpoints converted from a fine-tuned Hugging Face classifier carry one (cfg.pooler).
        self.pooler = nn.Linear(cfg.hidden_size, cfg.hidden_size) if cfg.pooler != "none" else None
        self.gates = GateController(cfg)
        # One linear head per exit depth (cfg.gate.exits): a plan that stops at layer d answers with it.
        self.exits = nn.ModuleList(nn.Linear(cfg.hidden_size, cfg.n_labels) for _ in cfg.gate.exits)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, head_gate: torch.Tensor | None = None,
        depth: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, attention_mask (B, N); head_gate (B, L, U), (L, U) or None (dense) -> logits (B, C).

        ``depth``: the layers run before answering (an int, (B,) per text, or None: all), as ``depth_of`` gives.
        """
        return self.logits_and_states(input_ids, attention_mask, head_gate, depth)[0]

    def logits_and_states(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, head_gate: torch.Tensor | None = None,
        depth: int | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """As ``forward``, plus the hidden states of the layers run (tensors (B, N, D)) for hidden-state distillation."""
        if head_gate is not None and head_gate.dim() == 2:
            head_gate = head_gate.expand(input_ids.shape[0], -1, -1)
        n_layers = self.cfg.n_layers
        if isinstance(depth, torch.Tensor):
            depths = sorted({int(d) for d in depth.tolist()})
            if depths == [n_layers]:
                depth = None
            elif len(depths) == 1:
                depth = depths[0]
        if depth is None or isinstance(depth, int):
            states = self.encoder.layer_states(input_ids, attention_mask, head_gate, depth)
            return self.answer(states[-1], attention_mask, len(states)), states
        states = self.encoder.layer_states(input_ids, attention_mask, head_gate, depths[-1])
        parts = [self.answer(states[d - 1], attention_mask, d) for d in depths]  # each (B, C)
        pick = torch.stack(parts)  # (n_depths, B, C): each text takes the answer at its own depth
        index = torch.as_tensor([depths.index(int(d)) for d in depth.tolist()], device=pick.device)
        return pick[index, torch.arange(pick.shape[1], device=pick.device)], states

    def answer(self, h: torch.Tensor, attention_mask: torch.Tensor, depth: int) -> torch.Tensor:
        """Logits (B, C) from layer ``depth``'s output (B, N, D): the exit's head there, or the classifier on top."""
        pooled = self.pool(h, attention_mask)
        if depth == self.cfg.n_layers:
            return self.head(pooled)
        return self.exits[self.cfg.gate.exits.index(depth)](self.dropout(pooled))  # ValueError: no exit there

    @torch.no_grad()
    def init_exits(self) -> None:
        """Every exit head becomes a copy of the classifier: a start that already reads pooled states."""
        for head in self.exits:
            head.weight.copy_(self.classifier.weight)
            head.bias.copy_(self.classifier.bias)

    def hard_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, budget: float) -> torch.Tensor:
        """What the checkpoint answers at ``budget``: its hard mask, stopping at the plan's exit if it has one."""
        return self(input_ids, attention_mask, self.hard_gates(budget), self.hard_depth(budget))

    def hard_depth(self, budget: float) -> int | None:
        """Layers the budget's plan runs when it stops at an exit; None when it runs every layer."""
        return self.gates.policy().plan(budget).depth if self.cfg.gate.exits else None

    def depth_of(self, budgets: list[float] | tuple[float, ...], policy: BudgetPolicy | None = None) -> torch.Tensor:
        """Layers each budget's plan runs, (n,) int64 (n_layers where it stops at no exit); ``policy``: the
        current gates' policy, when the caller already has it (a training step builds it once)."""
        policy = policy or self.gates.policy()
        n = self.cfg.n_layers
        return torch.as_tensor([policy.plan(b).depth or n for b in budgets], dtype=torch.int64)

    def pool(self, h: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Hidden states (B, N, D) -> (B, D): the [CLS] vector, or the mean over real tokens."""
        if self.cfg.pooling == "cls":
            return h[:, 0]
        m = attention_mask.to(h.dtype)[:, :, None]  # (B, N, 1)
        return (h * m).sum(1) / m.sum(1).clamp_min(1.0)

    def head(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooled vectors (B, D) -> logits (B, C): the optional pooler layer, dropout, the linear classifier."""
        if self.pooler is not None:
            pooled = self.pooler(pooled)
            pooled = torch.tanh(pooled) if self.cfg.pooler == "tanh" else F.relu(pooled)
        return self.classifier(self.dropout(pooled))

    def soft_gates(self, budget: torch.Tensor) -> torch.Tensor:
        """Soft gates for a (B,) tensor of budgets, shape (B, L, U)."""
        return self.gates(budget)

    def soft_cost(self, gates: torch.Tensor) -> torch.Tensor:
        """C(b) of gates (B, L, U) -> (B,): the mean gate, or the MAC-weighted mean over all units (model scope)."""
        weights = soft_cost_weights(self.cfg)
        if weights is None:
            return gates.mean(dim=(1, 2))
        return (gates * torch.as_tensor(weights, dtype=gates.dtype, device=gates.device)).sum(dim=(1, 2))

    def hard_gates(self, budget: float) -> torch.Tensor:
        """The hard mask for one budget as a float (L, U) tensor of 0s and 1s."""
        mask = self.gates.hard_mask(budget)
        return torch.as_tensor(mask, dtype=self.classifier.weight.dtype, device=self.classifier.weight.device)

    def ste_gates(self, budget: torch.Tensor, policy: BudgetPolicy | None = None) -> torch.Tensor:
        """Straight-through gates for (B,) budgets: forward is the hard mask, gradient flows through g(b)."""
        g = self.gates(budget)  # (B, L, U)
        policy = policy or self.gates.policy()
        hard = np.stack([policy.mask(float(b)) for b in budget])
        hard_t = torch.as_tensor(hard, dtype=g.dtype, device=g.device)
        return hard_t + (g - g.detach())  # exactly the hard mask forward (g - g is exactly 0)

    def hard_cost(self, budget: float) -> float:
        """What the hard mask keeps: k / (L * H) heads, or its share of the unit MACs (whole-model scope)."""
        return self.gates.policy().hard_cost(budget)
