"""A Llama-family decoder as a pure nn.Module: no distribution, precision or checkpoint logic.

Module names follow Hugging Face's `LlamaForCausalLM` (without its `model.` prefix), and rotary
embeddings use the same half-rotation layout, so weights map one to one in both directions.

The options of the other architectures Kiln imports (biases, a gateless squared-ReLU MLP, LayerNorm1p,
partial rotary, scaled rotary frequencies, a sliding window, q/k norms, fused projections; Gemma's layers from
kiln.model.gemma: see ModelConfig) are chosen when a module is built, as different submodules or flags read
once, so the default Llama path runs the same code.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kiln.config import ModelConfig, RopeScaling
from kiln.model import gemma, loss, masks, moe
from kiln.model.mamba2 import Mamba2
from kiln.model.masks import attend
from kiln.model.softcap import softcap


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 for stability, return in the input dtype (as HF Llama does)
        return (self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class LayerNorm1P(nn.LayerNorm):
    """LayerNorm whose scale is stored minus one (Nemotron): weight 0 is the identity scale. Computed in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps=eps)  # calls reset_parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.normalized_shape, self.weight.float() + 1.0, self.bias.float(),
                            self.eps).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)
        nn.init.zeros_(self.bias)


def _norm_order(norm: nn.Module) -> list:
    """A norm's parameters with their initialiser: RMSNorm's scale at one, LayerNorm1P's weight and bias and
    RMSNorm1P's scale at zero."""
    init = nn.init.zeros_ if isinstance(norm, (LayerNorm1P, gemma.RMSNorm1P)) else nn.init.ones_
    return [(p, init) for p in norm.parameters()]


def make_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    """The norm cfg.norm names over `dim` features (None: d_model)."""
    kind = {"layernorm1p": LayerNorm1P, "rmsnorm1p": gemma.RMSNorm1P}.get(cfg.norm, RMSNorm)
    return kind(dim or cfg.d_model, cfg.norm_eps)


def scale_frequencies(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Rotary frequencies stretched for a longer context, as Hugging Face's 'linear' and 'llama3' rope types."""
    if s.type == "linear":
        return inv_freq / s.factor
    old = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotary_tables(head_dim: int, seq_len: int, theta: float, device=None,
                  scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (T, head_dim) in the half-rotation layout (head_dim: the rotated dims)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    scale = 1.0
    if scaling is not None and scaling.type == "longrope":  # Phi-3: the long factors for a longer sequence
        long = seq_len > scaling.original_max_position_embeddings
        factors = scaling.long_factor if long else scaling.short_factor
        inv_freq = 1.0 / (torch.tensor(factors, device=device, dtype=torch.float32) * (1.0 / inv_freq))
        scale = scaling.attention_factor
    elif scaling is not None:
        inv_freq = scale_frequencies(inv_freq, scaling)
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # (T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
    return emb.cos() * scale, emb.sin() * scale


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, T, H, hd); cos, sin: (T, hd). Rotates in fp32, returns x's dtype."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, hd)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates the first cos.shape[-1] dims of each head, passes the rest through (Nemotron)."""
    r = cos.shape[-1]
    return torch.cat((apply_rotary(x[..., :r], cos, sin), x[..., r:]), dim=-1)


def no_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Attention without position embeddings (a hybrid model's: its Mamba layers carry the order)."""
    return x


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: bool = True):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        d, qkv_bias = cfg.d_model, cfg.attention_bias != "none"
        self.widths = [self.n_heads * self.hd, self.n_kv * self.hd, self.n_kv * self.hd]  # of q, k, v
        if cfg.fused_projections:  # Phi-3: one projection gives (q | k | v)
            self.qkv_proj = nn.Linear(d, sum(self.widths), bias=qkv_bias)
        else:
            self.q_proj = nn.Linear(d, self.widths[0], bias=qkv_bias)
            self.k_proj = nn.Linear(d, self.widths[1], bias=qkv_bias)
            self.v_proj = nn.Linear(d, self.widths[2], bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.hd, d, bias=cfg.attention_bias == "all")
        # Qwen3, Gemma 3: each head's queries and keys normalised, before rotation
        self.q_norm = make_norm(cfg, self.hd) if cfg.qk_norm else nn.Identity()
        self.k_norm = make_norm(cfg, self.hd) if cfg.qk_norm else nn.Identity()
        self.rotate = apply_rotary if cfg.rotary_fraction == 1.0 else apply_partial_rotary
        scale = None if cfg.attn_scale_dim is None else cfg.attn_scale_dim ** -0.5  # Gemma's query scale, cap
        self.attend = attend if scale is None and cfg.attn_softcap is None else \
            functools.partial(attend, scale=scale, cap=cfg.attn_softcap)
        if not rotary:
            self.rotate = no_rotary

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, d) -> q (B, T, H, hd), k and v (B, T, KV, hd)."""
        B, T, _ = x.shape
        if hasattr(self, "qkv_proj"):
            q, k, v = self.qkv_proj(x).split(self.widths, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return (q.view(B, T, self.n_heads, self.hd), k.view(B, T, self.n_kv, self.hd),
                v.view(B, T, self.n_kv, self.hd))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.project(x)  # (B, T, H|KV, hd)
        q, k = self.q_norm(q), self.k_norm(k)
        # rotate in the (B, T, H, hd) layout the projections write: contiguous, so the fused
        # elementwise kernels (and their backward) read and write memory in order
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|KV, T, hd)
        y = self.attend(q, k, v, mask)  # (B, H, T, hd); mask: see kiln.model.masks
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, d)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, hidden: int | None = None):
        super().__init__()
        d, h, b = cfg.d_model, hidden or cfg.mlp_hidden, cfg.mlp_bias
        self.gate_proj = nn.Linear(d, h, bias=b)
        self.up_proj = nn.Linear(d, h, bias=b)
        self.down_proj = nn.Linear(h, d, bias=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ReluSquaredMLP(nn.Module):
    """Nemotron's MLP without a gate: down(relu(up(x))**2)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, h, b = cfg.d_model, cfg.mlp_hidden, cfg.mlp_bias
        self.up_proj = nn.Linear(d, h, bias=b)
        self.down_proj = nn.Linear(h, d, bias=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.square(F.relu(self.up_proj(x))))


class FusedMLP(nn.Module):
    """SwiGLU with gate and up in one projection (Phi-3): gate_up(x) = (gate | up)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, h, b = cfg.d_model, cfg.mlp_hidden, cfg.mlp_bias
        self.gate_up_proj = nn.Linear(d, 2 * h, bias=b)
        self.down_proj = nn.Linear(h, d, bias=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def make_mlp(cfg: ModelConfig, index: int) -> nn.Module:
    """The MLP of block `index`: a mixture of experts (kiln.model.moe) where model.moe puts one, else dense."""
    if cfg.moe is not None and index not in cfg.moe.dense_layers:
        shared = cfg.moe.shared_expert_hidden
        return moe.SparseMoE(cfg, MLP(cfg, shared) if shared else None)
    if cfg.mlp == "relu2":
        return ReluSquaredMLP(cfg)
    if cfg.mlp == "geglu":
        return gemma.GeGLU(cfg)
    return FusedMLP(cfg) if cfg.fused_projections else MLP(cfg)


class Block(nn.Module):
    """forward -> x; a block whose MLP is a mixture of experts returns (x, its router statistics)."""

    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.input_layernorm = make_norm(cfg)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = make_norm(cfg)
        self.mlp = make_mlp(cfg, index)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        y = self.mlp(self.post_attention_layernorm(x))
        if isinstance(y, tuple):  # kiln.model.moe: (output, router statistics)
            return x + y[0], y[1]
        return x + y


class HybridBlock(nn.Module):
    """A layer of a hybrid model (model.layer_pattern; Nemotron-H): x + mixer(norm(x)), the mixer Mamba-2 ('M'),
    attention without position embeddings ('*') or the MLP ('-'). Module names are Hugging Face's (norm, mixer)."""

    def __init__(self, cfg: ModelConfig, kind: str):
        super().__init__()
        self.kind = kind
        self.norm = make_norm(cfg)
        if kind == "M":
            self.mixer = Mamba2(cfg)
        elif kind == "*":
            self.mixer = Attention(cfg, rotary=False)
        else:
            self.mixer = ReluSquaredMLP(cfg) if cfg.mlp == "relu2" else MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None,
                docs: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm(x)
        if self.kind == "M":
            return x + self.mixer(h, docs)  # docs (B, T): the scan and convolution restart at each document
        if self.kind == "*":
            return x + self.mixer(h, cos, sin, mask)
        return x + self.mixer(h)

    def init_order(self, normal, resid) -> list:
        m = self.mixer
        if self.kind == "M":
            return _norm_order(self.norm) + m.init_order(normal, resid)
        ins = [m.q_proj, m.k_proj, m.v_proj] if self.kind == "*" else [getattr(m, "gate_proj", None), m.up_proj]
        out = m.o_proj if self.kind == "*" else m.down_proj
        linears = [lin for lin in [*ins, out] if lin is not None]
        order = [(lin.weight, normal) for lin in linears if lin is not out] + [(out.weight, resid)]
        return order + [(lin.bias, nn.init.zeros_) for lin in linears if lin.bias is not None] + _norm_order(self.norm)


class Transformer(nn.Module):
    """Decoder-only language model. `forward(tokens)` gives logits; with `targets`, the mean loss."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError("ModelConfig.vocab_size must be set before building the model")
        rng = torch.random.get_rng_state()  # so that eager and meta-then-init_weights agree
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(HybridBlock(cfg, kind) for kind in cfg.layer_pattern) if cfg.layer_pattern \
            else nn.ModuleList(gemma.SandwichBlock(Attention(cfg), make_mlp(cfg, i), lambda: make_norm(cfg))
                               if cfg.sandwich_norm else Block(cfg, i) for i in range(cfg.n_layers))
        for i, block in enumerate(self.layers):  # the rotary tables and mask of each (see _layer_inputs)
            block.attention_kind = int(i in (cfg.full_attention_layers or ()))
        self.norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if cfg.moe is not None:  # the router losses of the training forwards, read by kiln.train.router_aux
            self.router_aux, self.router_z = moe.RouterAux(), moe.RouterAux()
        self.rot_dim = int(cfg.head_dim * cfg.rotary_fraction)  # dims of each head that rotary embeddings turn
        for name, table in self.rope_tables(self._table_len(), self.embed_tokens.weight.device).items():
            self.register_buffer(name, table, persistent=False)  # (max_seq_len, hd)
        if self.embed_tokens.weight.device.type != "meta":
            torch.random.set_rng_state(rng)
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2/Llama practice: N(0, std) everywhere, residual output projections scaled by
        1/sqrt(2 * n_layers); norms at one. Deterministic under torch.manual_seed."""
        self.init_buffers()
        for param, init in self.init_order():
            init(param)

    def init_order(self) -> list[tuple[nn.Parameter, Callable[[torch.Tensor], torch.Tensor]]]:
        """Every parameter (a tied one once) with its initialiser, in the order they draw from the RNG.
        kiln.parallel initialises a sharded model from it one full-size parameter at a time."""
        std, out_std = self.cfg.init_std, self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        normal, resid = functools.partial(nn.init.normal_, std=std), functools.partial(nn.init.normal_, std=out_std)
        order: list = [(self.embed_tokens.weight, normal)]
        for block in self.layers:
            if isinstance(block, HybridBlock):  # one residual branch per layer
                order += block.init_order(normal, functools.partial(nn.init.normal_, std=std / math.sqrt(
                    self.cfg.n_layers)))
                continue
            attn, mlp = block.self_attn, block.mlp
            a = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "qkv_proj")]
            if isinstance(mlp, moe.SparseMoE):  # attention as below, then the router and experts
                order += [(lin.weight, normal) for lin in a if lin is not None]
                order += [(attn.o_proj.weight, resid)]
                order += [(lin.bias, nn.init.zeros_) for lin in (*a, attn.o_proj)
                          if lin is not None and lin.bias is not None]
                order += mlp.init_order(normal, resid)
            else:
                m = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "gate_up_proj")]
                order += [(lin.weight, normal) for lin in a + m if lin is not None]
                order += [(lin.weight, resid) for lin in (attn.o_proj, mlp.down_proj)]
                biased = (*a[:3], attn.o_proj, m[1], mlp.down_proj, m[0], a[3], m[2])
                order += [(lin.bias, nn.init.zeros_) for lin in biased if lin is not None and lin.bias is not None]
            order += _norm_order(attn.q_norm) + _norm_order(attn.k_norm)  # qk_norm's; nn.Identity has none
            order += _norm_order(block.input_layernorm) + _norm_order(block.post_attention_layernorm)
            if isinstance(block, gemma.SandwichBlock):
                order += _norm_order(block.pre_feedforward_layernorm) + _norm_order(block.post_feedforward_layernorm)
        order += _norm_order(self.norm)
        if not self.cfg.tie_embeddings:
            order.append((self.lm_head.weight, normal))
        return order

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Re-tie the embeddings (to_empty() after meta construction unties them) and rebuild the rope
        tables, which are not saved: after to_empty(), before weights are initialised or loaded."""
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        for name, table in self.rope_tables(self._table_len(), self.rope_cos.device).items():
            getattr(self, name).copy_(table)

    def _table_len(self) -> int:
        """Rows of the kept rotary tables: max_seq_len; with longrope at most the short factors' reach (a longer
        sequence takes the long factors, in tables made for it)."""
        s = self.cfg.rope_scaling
        if s is not None and s.type == "longrope":
            return min(self.cfg.max_seq_len, s.original_max_position_embeddings)
        return self.cfg.max_seq_len

    def _rotary(self, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_tables(self.rot_dim, T, self.cfg.rope_theta, device, self.cfg.rope_scaling)

    def rope_tables(self, T: int, device) -> dict[str, torch.Tensor]:
        """The rotary buffers by name for T positions: rope_cos and rope_sin, and with cfg.rope_local_theta the
        windowed layers' own rope_local_cos and rope_local_sin (not scaled)."""
        cos, sin = self._rotary(T, device)
        out = {"rope_cos": cos, "rope_sin": sin}
        if self.cfg.rope_local_theta is not None:
            out["rope_local_cos"], out["rope_local_sin"] = rotary_tables(self.rot_dim, T, self.cfg.rope_local_theta,
                                                                         device)
        return out

    def _rope(self, T: int, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if T > self.rope_cos.shape[0]:  # longer than max_seq_len (generation), or longrope's long tables
            tables = self.rope_tables(T, self.rope_cos.device)
            return (tables["rope_local_cos"], tables["rope_local_sin"]) if local else (tables["rope_cos"],
                                                                                       tables["rope_sin"])
        if local:
            return self.rope_local_cos[:T], self.rope_local_sin[:T]
        return self.rope_cos[:T], self.rope_sin[:T]

    def _layer_inputs(self, doc_ids: torch.Tensor | None, T: int, device) -> list[tuple]:
        """(cos, sin, mask) of each block's attention_kind: 0, the layers with cfg.sliding_window (all of them
        but cfg.full_attention_layers, with cfg.rope_local_theta's tables where set); 1, the full-attention ones."""
        cfg, capped = self.cfg, self.cfg.attn_softcap is not None
        mask = masks.doc_mask(doc_ids, device, cfg.sliding_window, T, capped)  # once, for every layer of its kind
        windowed = (*self._rope(T, local=cfg.rope_local_theta is not None), mask)
        if cfg.full_attention_layers is None:
            return [windowed]
        return [windowed, (*self._rope(T), masks.doc_mask(doc_ids, device, None, T, capped))]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) -> the first block's input (B, T, d)."""
        x = self.embed_tokens(tokens)  # (B, T, d)
        if torch.is_autocast_enabled(x.device.type):
            # carry the residual stream in the autocast dtype (bf16), not fp32: half the memory
            # traffic of every norm, residual add and saved activation; the weights stay fp32
            x = x.to(torch.get_autocast_dtype(x.device.type))
        if self.cfg.embed_scale:
            x = x * gemma.embed_scale(self.cfg.d_model, x.dtype)
        return x

    def block_args(self, doc_ids: torch.Tensor | None, T: int, device) -> list[tuple]:
        """The arguments after x of each block's call, by its attention_kind: (cos, sin, mask), and a hybrid
        model's document ids (its Mamba layers keep documents apart with the ids themselves)."""
        inputs = self._layer_inputs(doc_ids, T, device)  # (cos, sin, mask) of each attention_kind
        if doc_ids is not None and self.cfg.layer_pattern:
            inputs = [(*args, doc_ids.to(device, non_blocking=True)) for args in inputs]
        return inputs

    def hidden(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None,
               stats: list[torch.Tensor] | None = None) -> torch.Tensor:
        """tokens (B, T) -> final normalised hidden states (B, T, d).

        doc_ids (B, T), optional: the document of each position within its row; attention then
        stays inside each document (block-diagonal causal). stats: a list that gets the router
        statistics of each mixture-of-experts layer (kiln.model.moe)."""
        x = self.embed(tokens)  # (B, T, d)
        args = self.block_args(doc_ids, tokens.shape[1], x.device)
        for block in self.layers:
            x = block(x, *args[block.attention_kind])
            if isinstance(x, tuple):  # kiln.model.moe: (x, the layer's router statistics)
                x, layer_stats = x
                if stats is not None:
                    stats.append(layer_stats)
        return self.norm(x)

    def head_loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Final normalised hidden states (B, T, d) -> the mean loss over targets (B, T) that are not -100."""
        # chunked: never holds the whole batch's logits
        return loss.linear_cross_entropy(h, self.lm_head.weight, targets,  # kiln.parallel.compile may wrap it
                                         softcap=self.cfg.logit_softcap)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden states (..., d) -> logits (..., V), soft-capped where the model caps them."""
        if self.cfg.logit_softcap is None:
            return self.lm_head(h)
        return softcap(self.lm_head(h), self.cfg.logit_softcap)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        stats: list[torch.Tensor] = []
        h = self.hidden(tokens, doc_ids, stats)
        if targets is None:
            return self.logits(h)  # (B, T, V)
        out = self.head_loss(h, targets)
        if stats and self.training:  # a mixture of experts trains on its router losses too (kiln.model.moe)
            m = self.cfg.moe
            aux, z = moe.router_losses(stats, m.n_experts, tokens.numel())
            self.router_aux.add(aux)
            out = out + m.aux_loss_coef * aux
            if m.z_loss_coef:
                self.router_z.add(z)
                out = out + m.z_loss_coef * z
        return out
