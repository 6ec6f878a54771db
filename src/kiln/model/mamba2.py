"""The Mamba-2 mixer of a hybrid model's 'M' layers (Nemotron-H), as a pure nn.Module.

    in_proj: x -> z (gate), xBC, dt              (d_model -> inner + conv_dim + heads)
    xBC -> causal depthwise conv (kernel K) -> SiLU -> x (heads x head_dim), B, C (groups x state each)
    dt -> softplus(dt + dt_bias), clamped to mamba.dt_limit;  A = -exp(A_log)
    y = SSD scan (kiln.model.ssd) + D x;  y = RMSNorm per group of (y * SiLU(z));  out_proj: inner -> d_model

Parameter names and shapes are Hugging Face's `NemotronHMamba2Mixer`'s (conv1d.weight is (conv_dim, 1, K)),
so weights map one to one. With `docs` (b, T), the document of each position of a packed row, neither the
convolution nor the scan looks across a document's start: each document gives what it gives alone.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from kiln.config import ModelConfig
from kiln.model.ssd import ssd_scan


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                docs: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution: x (b, T, C), weight (C, K), bias (C,) -> (b, T, C) in fp32,
    out_t = bias + sum_j weight[:, K-1-j] x_{t-j}, where positions before the row's start, or before the start of
    position t's document (docs (b, T)), count as zero. K shifted products, which the compiler fuses into one pass."""
    K, T = weight.shape[-1], x.shape[1]
    w = weight.float()
    xf = x.float()
    padded = F.pad(xf, (0, 0, K - 1, 0))  # (b, T + K - 1, C)
    doc_padded = None if docs is None else F.pad(docs, (K - 1, 0), value=-1)
    out = xf * w[:, K - 1]
    for j in range(1, K):  # the tap j positions back
        term = padded[:, K - 1 - j:K - 1 - j + T] * w[:, K - 1 - j]
        if doc_padded is not None:
            term = term * (doc_padded[:, K - 1 - j:K - 1 - j + T] == docs)[..., None]
        out = out + term
    return out if bias is None else out + bias.float()


class GatedRMSNorm(nn.Module):
    """weight * RMSNorm(y * SiLU(z)), normalised over groups of `group` channels, in fp32."""

    def __init__(self, dim: int, group: int, eps: float):
        super().__init__()
        self.group, self.eps = group, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = y.float() * F.silu(z.float())
        h = F.rms_norm(h.unflatten(-1, (-1, self.group)), (self.group,), eps=self.eps).flatten(-2)
        return (self.weight * h.to(z.dtype)).to(z.dtype)


def init_dt_bias(t: torch.Tensor, dt_min: float, dt_max: float, floor: float,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """dt_bias such that softplus(dt_bias) is log-uniform in [dt_min, dt_max] (at least `floor`): Mamba-2's init."""
    u = torch.rand(t.shape, generator=generator, device=t.device, dtype=torch.float32)
    dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=floor)
    with torch.no_grad():
        return t.copy_(dt + torch.log(-torch.expm1(-dt)))  # the inverse of softplus


def init_a_log(t: torch.Tensor) -> torch.Tensor:
    """A_log = log(1 .. heads): the heads' decay rates spread over two orders of magnitude."""
    with torch.no_grad():
        return t.copy_(torch.log(torch.arange(1, t.numel() + 1, dtype=torch.float32, device=t.device)))


class Mamba2(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.mamba
        self.heads, self.head_dim, self.groups, self.state = cfg.mamba_heads, m.head_dim, m.groups, m.state
        self.chunk, self.dt_limit = m.chunk, m.dt_limit
        self.inner = self.heads * self.head_dim
        self.conv_dim = self.inner + 2 * self.groups * self.state
        self.in_proj = nn.Linear(cfg.d_model, self.inner + self.conv_dim + self.heads, bias=m.proj_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, m.conv_kernel, groups=self.conv_dim,
                                padding=m.conv_kernel - 1, bias=m.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        self.A_log = nn.Parameter(torch.zeros(self.heads))
        self.D = nn.Parameter(torch.ones(self.heads))
        self.norm = GatedRMSNorm(self.inner, self.inner // self.groups, cfg.norm_eps)
        self.out_proj = nn.Linear(self.inner, cfg.d_model, bias=m.proj_bias)
        self._dt_init = (m.dt_min, m.dt_max, m.dt_floor)

    def forward(self, x: torch.Tensor, docs: torch.Tensor | None = None) -> torch.Tensor:
        b, T, _ = x.shape
        H, P, G, N = self.heads, self.head_dim, self.groups, self.state
        z, xBC, dt = self.in_proj(x).split([self.inner, self.conv_dim, H], dim=-1)
        dtype = xBC.dtype
        xBC = F.silu(causal_conv(xBC, self.conv1d.weight[:, 0], self.conv1d.bias, docs)).to(dtype)
        xs, B, C = xBC.split([self.inner, G * N, G * N], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(self.dt_limit[0], self.dt_limit[1])  # (b, T, H)
        A = -torch.exp(self.A_log.float())
        xs = xs.view(b, T, H, P)
        y = ssd_scan(xs, dt, A, B.view(b, T, G, N), C.view(b, T, G, N), self.chunk, docs)  # (b, T, H, P) fp32
        y = y + xs.float() * self.D.float()[:, None]
        return self.out_proj(self.norm(y.reshape(b, T, self.inner), z))  # (b, T, d)

    def init_order(self, normal, resid) -> list:
        """Parameters with their initialisers (see Transformer.init_order): projections normal (the output one
        scaled for depth), the convolution uniform in +-1/sqrt(K) as torch's default, Mamba-2's dt, A and D."""
        bound = 1.0 / math.sqrt(self.conv1d.kernel_size[0])
        uniform = functools.partial(nn.init.uniform_, a=-bound, b=bound)
        order = [(self.in_proj.weight, normal), (self.conv1d.weight, uniform)]
        order += [(self.conv1d.bias, uniform)] if self.conv1d.bias is not None else []
        order += [(self.dt_bias, functools.partial(init_dt_bias, dt_min=self._dt_init[0], dt_max=self._dt_init[1],
                                                   floor=self._dt_init[2])),
                  (self.A_log, init_a_log), (self.D, nn.init.ones_), (self.norm.weight, nn.init.ones_),
                  (self.out_proj.weight, resid)]
        order += [(lin.bias, nn.init.zeros_) for lin in (self.in_proj, self.out_proj) if lin.bias is not None]
        return order
