"""LoRA on a mixture of experts' stacked projections (kiln.model.moe), one adapter per expert, stacked too.

lora.targets gate, up and down adapt, in a mixture-of-experts block, every expert's gate, up and down projection:
each expert e gets its own A_e (r x in) and B_e (out x r), held stacked over the experts,

    layers.N.mlp.experts.gate_adapter.lora_A.weight  (E, r, d)    ...experts.gate_adapter.lora_B.weight  (E, h, r)
    layers.N.mlp.experts.up_adapter.lora_A.weight    (E, r, d)    ...experts.up_adapter.lora_B.weight    (E, h, r)
    layers.N.mlp.experts.down_adapter.lora_A.weight  (E, r, h)    ...experts.down_adapter.lora_B.weight  (E, d, r)

and each adapter's two products run as grouped GEMMs over the tokens sorted by expert, like the base's. The base
weights keep their names (`experts.gate_up_proj`, `experts.down_proj`); a shared expert's linear layers take the
ordinary LoraLinear (kiln.model.lora). Merging adds (alpha / r) B_e A_e to expert e's rows (`merge_experts`).
PEFT has no per-expert adapter form Kiln writes: such adapters export merged into the model (kiln.model.lora_peft).
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from kiln.model.moe import GroupedExperts, _compute_dtype, grouped_mm

PARTS = {"mlp.gate_proj": "gate", "mlp.up_proj": "up", "mlp.down_proj": "down"}  # lora target -> expert part


class _Stacked(nn.Module):
    """One stacked adapter matrix under the name `weight` (so its key reads `...lora_A.weight`, as PEFT's do)."""

    def __init__(self, *shape: int, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape, device=device, dtype=torch.float32))


class StackedLora(nn.Module):
    """Per-expert adapters of one projection: A (E, r, in), B (E, out, r)."""

    def __init__(self, n: int, fan_in: int, fan_out: int, rank: int, device=None):
        super().__init__()
        self.lora_A, self.lora_B = _Stacked(n, rank, fan_in, device=device), _Stacked(n, fan_out, rank, device=device)
        if self.lora_A.weight.device.type != "meta":
            self.reset_lora()

    @torch.no_grad()
    def reset_lora(self) -> None:
        """Each expert's A as nn.Linear's Kaiming-uniform (PEFT's), B zero: the adapters start as a no-op."""
        for a in self.lora_A.weight:
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor, offs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x (N, in) sorted by expert -> (N, out): each row through its expert's B A, in `dtype` (bf16 on a GPU:
        the grouped kernel; the fp32 adapters are cast as autocast casts a linear layer's)."""
        return grouped_mm(grouped_mm(x, self.lora_A.weight.to(dtype), offs), self.lora_B.weight.to(dtype), offs)

    def delta(self) -> torch.Tensor:
        """B_e A_e for every expert, fp32 (E, out, in)."""
        return self.lora_B.weight.float() @ self.lora_A.weight.float()


class LoraGroupedExperts(nn.Module):
    """GroupedExperts with per-expert adapters (`{part}_adapter`) on some of gate, up, down; the base frozen."""

    def __init__(self, base: GroupedExperts, parts: list[str], rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.n_experts, self.hidden = base.n_experts, base.hidden
        self.gate_up_proj, self.down_proj = base.gate_up_proj, base.down_proj  # same Parameters: keys stay
        self.rank, self.scaling = rank, alpha / rank
        n, (h, d), dev = base.n_experts, base.down_proj.shape[2:0:-1], base.down_proj.device
        shapes = {"gate": (d, h), "up": (d, h), "down": (h, d)}
        for part in parts:
            setattr(self, f"{part}_adapter", StackedLora(n, *shapes[part], rank, device=dev))
        self.parts = list(parts)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def _delta(self, part: str, x: torch.Tensor, offs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        if part not in self.parts:
            return None
        return getattr(self, f"{part}_adapter")(self.lora_dropout(x), offs, dtype) * self.scaling

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        dtype = _compute_dtype(x, self.gate_up_proj)
        x = x.to(dtype)
        gate, up = grouped_mm(x, self.gate_up_proj.to(dtype), offs).chunk(2, dim=-1)  # (N, h) each
        dg, du = self._delta("gate", x, offs, dtype), self._delta("up", x, offs, dtype)
        gate = gate if dg is None else gate + dg
        up = up if du is None else up + du
        mid = F.silu(gate) * up
        out = grouped_mm(mid, self.down_proj.to(dtype), offs)
        dd = self._delta("down", mid, offs, dtype)
        return out if dd is None else out + dd

    def merged(self) -> GroupedExperts:
        """A plain GroupedExperts (fp32) of the base weights plus each expert's (alpha / r) B A."""
        plain = GroupedExperts(self.n_experts, self.down_proj.shape[1], self.hidden).to(self.down_proj.device)
        state = merge_experts({"gate_up_proj": self.gate_up_proj, "down_proj": self.down_proj,
                               **{f"{p}_adapter.{k}": v for p in self.parts
                                  for k, v in getattr(self, f"{p}_adapter").state_dict().items()}},
                              self.scaling)
        plain.load_state_dict(state)
        return plain

    def extra_repr(self) -> str:
        return f"experts={self.n_experts}, adapters on {', '.join(self.parts)}, rank={self.rank}"


def adapt_experts(block: nn.Module, paths: list[str], rank: int, alpha: float, dropout: float) -> list[str]:
    """Per-expert adapters on the experts of `block`'s mixture of experts for the MLP targets among `paths`; the
    paths it took (the rest are the caller's, on ordinary linear layers). A dense block is left alone."""
    experts = getattr(getattr(block, "mlp", None), "experts", None)  # a hybrid model's blocks may have no MLP
    if not isinstance(experts, GroupedExperts):
        return []
    taken = [p for p in paths if p in PARTS]
    if taken:
        block.mlp.experts = LoraGroupedExperts(experts, [PARTS[p] for p in taken], rank, alpha, dropout)
    return taken


_STACKED = re.compile(r"^(|.*\bexperts\.)(gate|up|down)_adapter\.lora_[AB]\.weight$")


def stacked_adapter(key: str) -> tuple[str, str] | None:
    """(prefix up to and with 'experts.', part: gate, up or down) of a stacked expert adapter's key; None for any
    other key (a shared expert's or attention's LoraLinear keys included)."""
    m = _STACKED.match(key)
    return (m.group(1), m.group(2)) if m else None


def merge_experts(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """`state` with each stacked expert adapter merged into its base (fp32) and its keys dropped: `P.gate_adapter`
    adds scale * B_e A_e to expert e's gate rows of `P.gate_up_proj` (up: its up rows; down: `P.down_proj`).
    Other keys pass as they are."""
    out = {k: v for k, v in state.items() if stacked_adapter(k) is None}
    for key in state:
        found = stacked_adapter(key)
        if found is None or not key.endswith("lora_A.weight"):
            continue
        prefix, part = found
        delta = scale * (state[f"{prefix}{part}_adapter.lora_B.weight"].float() @ state[key].float())  # (E, out, in)
        base = f"{prefix}{'down_proj' if part == 'down' else 'gate_up_proj'}"
        merged = out[base].float().clone()
        h = merged.shape[1] // 2
        rows = {"gate": slice(0, h), "up": slice(h, 2 * h), "down": slice(None)}[part]
        merged[:, rows] += delta.to(merged.device)
        out[base] = merged
    return out
