"""A mixture of experts in place of a block's MLP (Mixtral, Qwen2-MoE, Qwen3-MoE), as a pure nn.Module.

    y = sum over the token's top-k experts e of  p_e * down_e(silu(gate_e(x)) * up_e(x))   (+ a shared expert)

The router (`gate`, a linear layer to the experts) gives each token a softmax over the experts, of which it
keeps the top k, renormalised to sum to one where the model does (Mixtral; Qwen's norm_topk_prob).

The experts' weights are stacked, one parameter per projection over every expert, as transformers 5 holds
them: `experts.gate_up_proj` (E, 2 * hidden, d: each expert's gate rows, then its up rows) and
`experts.down_proj` (E, d, hidden). FSDP shards them like any parameter of the block (dim 0: the experts).
The tokens are sorted by expert and each projection is one grouped matrix product over the sorted rows
(`kiln.model.grouped_mm`): torch's grouped GEMM on a Hopper GPU in bf16, with no Python loop over experts and
no host sync, so the block compiles whole; elsewhere a loop over the experts' row ranges in one custom operator,
which a compiled block keeps whole too, with each row multiplied by its own expert only (it warns on a GPU).

The layer returns its output and its routing statistics (`router_stats`): each expert's count of top-k
assignments, the sum of its router probabilities, and the sum of the squared log-sum-exp of the logits. The
model sums them over its layers into the load-balancing loss of transformers' `load_balancing_loss_func`
(counts and probabilities over every layer's tokens together) and the router z-loss (`router_losses`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.config import ModelConfig
from kiln.model.grouped_mm import grouped_mm, grouped_mm_loop, hopper_or_newer, kernel_refusal
from kiln.model.hf_moe import RouterAux

__all__ = ["GroupedExperts", "Router", "RouterAux", "SparseMoE", "grouped_mm", "grouped_mm_loop", "hopper_or_newer",
           "kernel_refusal", "router_losses", "swiglu_experts"]


def _compute_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """The dtype the experts' products run in: autocast's where it is on (bf16 weights under FSDP), else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def swiglu_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x (N, d) sorted by expert, gate_up (E, 2h, d), down (E, d, h), offs (E,) int32 ends -> (N, d): each row
    through its own expert's SwiGLU (kiln.parallel.experts runs it on a process's own experts too)."""
    gate, up = grouped_mm(x, gate_up, offs).chunk(2, dim=-1)  # (N, h) each
    return grouped_mm(F.silu(gate) * up, down, offs)  # (N, d)


class GroupedExperts(nn.Module):
    """E SwiGLU experts whose weights are stacked: gate_up_proj (E, 2h, d), down_proj (E, d, h)."""

    def __init__(self, n_experts: int, d: int, hidden: int):
        super().__init__()
        self.n_experts, self.hidden = n_experts, hidden
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * hidden, d))
        self.down_proj = nn.Parameter(torch.empty(n_experts, d, hidden))

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """x (N, d): rows sorted by expert, offs (E,) int32 the end of each expert's rows -> (N, d)."""
        dtype = _compute_dtype(x, self.gate_up_proj)
        return swiglu_experts(x.to(dtype), self.gate_up_proj.to(dtype), self.down_proj.to(dtype), offs)

    def extra_repr(self) -> str:
        return f"experts={self.n_experts}, d={self.down_proj.shape[1]}, hidden={self.hidden}"


class Router(nn.Module):
    """Linear scores of each token for each expert (no bias), kept as transformers names it (`mlp.gate`)."""

    def __init__(self, d: int, n_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)  # (N, E)


class SparseMoE(nn.Module):
    """The block's MLP as a mixture of experts. forward(x (B, T, d)) -> (y (B, T, d), stats (2E + 1,) fp32)."""

    def __init__(self, cfg: ModelConfig, shared_expert: nn.Module | None = None):
        super().__init__()
        m = cfg.moe
        assert m is not None
        self.n_experts, self.top_k, self.norm_topk = m.n_experts, m.top_k, m.norm_topk
        self.gate = Router(cfg.d_model, m.n_experts)
        self.experts = GroupedExperts(m.n_experts, cfg.d_model, m.expert_hidden)
        self.shared_expert = shared_expert  # Qwen2-MoE: every token, scaled by sigmoid(shared_expert_gate(x))
        self.shared_expert_gate = nn.Linear(cfg.d_model, 1, bias=False) if shared_expert is not None else None

    def init_order(self, normal, resid) -> list:
        """(parameter, initialiser) pairs in drawing order: the router, the experts (their output projection as
        a residual one), the shared expert and its gate."""
        order = [(self.gate.weight, normal), (self.experts.gate_up_proj, normal), (self.experts.down_proj, resid)]
        if self.shared_expert is not None:
            se = self.shared_expert
            order += [(se.gate_proj.weight, normal), (se.up_proj.weight, normal), (se.down_proj.weight, resid),
                      (self.shared_expert_gate.weight, normal)]
        return order

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, d) -> (logits (N, E) fp32, probabilities (N, E) fp32, top-k weights (N, k) fp32, top-k experts)."""
        logits = self.gate(x).float()
        probs = torch.softmax(logits, dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, probs, weights, experts

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, d = x.shape
        flat = x.reshape(-1, d)  # (N, d)
        logits, probs, weights, experts = self.route(flat)
        # sort the N * k (token, expert) pairs by expert: each expert's rows are one range of the sorted rows
        chosen = experts.reshape(-1)  # (N k,)
        order = torch.argsort(chosen, stable=True)
        token = order // self.top_k  # the token of each sorted row
        counts = torch.zeros(self.n_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, chosen, torch.ones_like(chosen))  # static shapes: no bincount, no host sync
        offs = counts.cumsum(0).to(torch.int32)
        rows = self.experts(flat[token], offs)  # (N k, d), sorted by expert
        # back in (token, choice) order, then each token's k rows weighted and summed in fp32: no atomic adds
        # (deterministic), and a compiled block fuses the cast, product and sum
        rows = torch.empty_like(rows).index_copy_(0, order, rows).view(-1, self.top_k, d)  # (N, k, d)
        out = (rows.float() * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)  # (N, d)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.reshape(B, T, d), router_stats(logits, probs, counts)


def router_stats(logits: torch.Tensor, probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """One layer's routing in a vector (2E + 1,) fp32: top-k counts per expert, summed router probabilities per
    expert (these carry the gradient), and the summed squared log-sum-exp of the logits (the z-loss)."""
    z = torch.logsumexp(logits, dim=-1).square().sum().reshape(1)
    return torch.cat([counts.float(), probs.sum(dim=0), z])


def router_losses(stats: list[torch.Tensor], n_experts: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(load-balancing loss, z-loss) of a forward pass from its MoE layers' `router_stats` over `tokens` tokens.

    Load balancing as transformers' load_balancing_loss_func: with f_e the share of all top-k assignments of
    every layer's tokens that went to expert e (times k) and P_e its mean router probability over them,
    E * sum_e f_e P_e (k when perfectly balanced). Z-loss: the mean over layers and tokens."""
    total = torch.stack(stats).sum(dim=0)
    rows = tokens * len(stats)
    counts, probs, z = total[:n_experts], total[n_experts:2 * n_experts], total[-1]
    aux = n_experts * torch.sum((counts / rows) * (probs / rows))
    return aux, z / rows
