"""lora.targets on a transformers model (model.hf_class=auto): Kiln's names found among the model's own layers.

    found = lora_targets(hf_model, ["q", "k", "v", "o"])    # {"q": ["self_attn.qkv_proj"], ..., "o": [...]}
    peft.LoraConfig(target_modules=peft_modules(found), ...)

Models name their projections differently (Llama's q_proj, Phi's dense, GPT-2's c_attn and c_proj), and
some fuse them: Phi-3's `qkv_proj` holds q, k and v, its `gate_up_proj` gate and up. A target maps onto
every linear layer of the decoder blocks that computes it, fused or not; a fused layer is adapted whole
(an adapter on Phi-3's qkv_proj adapts k too when only q and v are asked: the summary says so). A target
that matches no layer is a ConfigError that lists the layers the model has: PEFT would adapt the others
and train silently without it.
"""

from __future__ import annotations

from torch import nn

from kiln.errors import ConfigError
from kiln.model.hf_blocks import decoder_layers

SEPARATE = {"q": {"q_proj", "query", "wq"}, "k": {"k_proj", "key", "wk"}, "v": {"v_proj", "value", "wv"},
            "gate": {"gate_proj", "w1"}, "up": {"up_proj", "fc1", "c_fc", "w3", "dense_h_to_4h", "fc_in"},
            "down": {"down_proj", "fc2", "w2", "dense_4h_to_h", "fc_out"}}
FUSED = {"qkv_proj": {"q", "k", "v"}, "query_key_value": {"q", "k", "v"}, "c_attn": {"q", "k", "v"},
         "Wqkv": {"q", "k", "v"}, "W_pack": {"q", "k", "v"}, "gate_up_proj": {"gate", "up"}}
ATTENTION_OUT = {"o_proj", "out_proj", "dense", "c_proj", "wo"}  # "o" where its module also computes q, k or v
ORDER = ("q", "k", "v", "o", "gate", "up", "down")


def _linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"  # GPT-2's transposed linear


def block_linears(model: nn.Module) -> dict[str, nn.Module]:
    """Every linear layer of the model's decoder blocks by its path inside a block (self_attn.q_proj, ...)."""

    out: dict[str, nn.Module] = {}
    for block in decoder_layers(model):
        for name, module in block.named_modules():
            if name and _linear(module):
                out.setdefault(name, module)
    return out


def _computes(path: str, attention_parents: set[str]) -> set[str]:
    """The targets the layer at `path` (inside a block) computes."""
    parent, _, leaf = path.rpartition(".")
    if leaf in FUSED:
        return set(FUSED[leaf])
    found = {t for t, names in SEPARATE.items() if leaf in names}
    if leaf in ATTENTION_OUT and parent in attention_parents:
        return {"o"}
    if leaf == "c_proj":  # GPT-2's MLP output (its attention's c_proj is "o", above)
        return {"down"}
    return found


def lora_targets(model: nn.Module, targets: list[str]) -> dict[str, list[str]]:
    """{target: the paths inside a block of the layers that compute it} for each of `targets` (Kiln's names);
    ConfigError for a target no layer computes."""
    linears = block_linears(model)
    qkv = SEPARATE["q"] | SEPARATE["k"] | SEPARATE["v"] | {n for n, ts in FUSED.items() if "q" in ts}
    attention_parents = {p.rpartition(".")[0] for p in linears if p.rpartition(".")[2] in qkv}
    computes = {path: _computes(path, attention_parents) for path in linears}
    wanted = list(dict.fromkeys(targets))
    found = {t: sorted(p for p, ts in computes.items() if t in ts) for t in wanted}
    missing = [t for t in wanted if not found[t]]
    if missing:
        name = type(getattr(model, "get_base_model", lambda: model)()).__name__
        have = ", ".join(sorted(linears)) or "none"
        served = ", ".join(sorted({t for ts in computes.values() for t in ts}, key=ORDER.index)) or "none of them"
        verb = "matches" if len(missing) == 1 else "match"
        raise ConfigError(f"lora.targets: {', '.join(missing)} {verb} no layer of {name} (the linear layers of its "
                          f"blocks: {have}). Of q, k, v, o, gate, up and down its layers compute {served}: choose "
                          "among those, or lora.targets=[all] for every linear layer")
    return found


def peft_modules(found: dict[str, list[str]]) -> list[str]:
    """PEFT's target_modules for `found`: the paths inside a block (PEFT matches a module whose name ends with one)."""
    return sorted({p for paths in found.values() for p in paths})


def describe(found: dict[str, list[str]]) -> str:
    """'q, v on self_attn.qkv_proj (fused: k is adapted too); o on self_attn.o_proj': the layers of each target."""
    by_path: dict[tuple[str, ...], list[str]] = {}
    for t, paths in found.items():
        by_path.setdefault(tuple(paths), []).append(t)
    out = []
    for paths, ts in by_path.items():
        extra = sorted({x for p in paths for x in FUSED.get(p.rpartition(".")[2], ())} - set(found), key=ORDER.index)
        note = f" (fused: {', '.join(extra)} {'is' if len(extra) == 1 else 'are'} adapted too)" if extra else ""
        out.append(f"{', '.join(ts)} on {', '.join(paths)}{note}")
    return "; ".join(out)

