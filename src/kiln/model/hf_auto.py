"""Any causal LM of transformers as a Kiln model: `model.hf_class=auto` (the generic path).

    cfg = auto_config(run_cfg.model)                    # vocab and context of model.init_from
    model = build_auto(cfg, lora=run_cfg.lora)          # AutoModelForCausalLM, its weights, PEFT adapters
    loss = model(tokens, targets, doc_ids)              # Kiln's model call: a mean loss, or logits
    model.save_pretrained(out, tokenizer)               # the Hugging Face layout, loaded by from_pretrained

Architectures the native model does not have (Phi, Gemma, GPT-2, Jamba's Mamba hybrid, ...)
train in the same loop, loader, checkpoints and metrics, and as far as each model allows, as the native model
trains: kiln.parallel checkpoints, compiles and shards each decoder block (`layers`), and
- attention is Kiln's (kiln.model.hf_attention): causal SDPA, and flex attention with a block mask per batch
  for packed documents, where the model's attention is plain causal dot-product attention;
- the loss is Kiln's chunked cross-entropy on the decoder's hidden states (kiln.model.hf_head), where the
  logits are the output layer's alone: never the whole batch's logits;
- under bf16 autocast the residual stream is bf16 and rotary tables fp32 (kiln.model.hf_precision).
Each that a model does not allow (soft-capping, sliding windows, ALiBi, a biased head, ...) falls back to the
model's own code, and `describe_fast_path` says which and why (the run's model line).

Documents in a packed row: with `doc_ids` the model gets `position_ids` that restart at every
document, and Kiln's attention a block-diagonal mask; a model on its own attention whose masks come from
transformers' `masking_utils` attends inside each document through the position ids, and one on SDPA whose
masks ignore the positions (transformers 5.17's Falcon) through a (B, 1, T, T) document mask as its
`attention_mask`. A model with recurrent layers (Mamba, ...) or whose forward takes no `position_ids` can run
each document as its own sequence instead (kiln.model.hf_packing), which a run chooses with
data.document_mask=split.

Remote code: a directory whose config.json has `auto_map` ships Python that transformers would import
and run. It is refused unless `model.trust_remote_code` is true.
"""

from __future__ import annotations

import inspect
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln.config import LoraConfig, ModelConfig
from kiln.errors import ConfigError, StateError
from kiln.files import default_mode
from kiln.model import loss
from kiln.model.hf_attention import MASK_KEY, capped, layer_masks, sliding_window
from kiln.model.hf_attention import install as install_attention
from kiln.model.hf_blocks import decoder_layers, transformers_module
from kiln.model.hf_causal import unbuildable
from kiln.model.hf_head import decoder_of, logit_cap, plain_head
from kiln.model.hf_moe import RouterAux, router_aux_coef
from kiln.model.hf_packing import (
    doc_positions,
    document_attention_mask,
    merge_documents,
    recurrent_layers,
    split_documents,
    takes_document_masks,
)
from kiln.model.hf_packing import positions_keep_documents_apart as keeps_documents_apart
from kiln.model.hf_precision import match_native
from kiln.model.loss import IGNORE_INDEX
from kiln.versions import require

_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
_FREE = {"init_from", "allow_pickle", "max_seq_len", "hf_class", "trust_remote_code", "init_std", "size"}


def check_remote_code(path: str | Path, hf: dict[str, Any], trust: bool) -> None:
    """ConfigError if the model in `path` ships its own code (config.json `auto_map`) and `trust` is off."""
    if hf.get("auto_map") and not trust:
        names = ", ".join(sorted(set(map(str, hf["auto_map"].values()))))
        raise ConfigError(f"model.init_from: {path} ships its own model code (config.json auto_map: {names}), which "
                          "transformers would import and run with your permissions. Kiln does not run it unless "
                          "you set model.trust_remote_code=true: do so only for a directory you trust")


def auto_config(model: ModelConfig) -> ModelConfig:
    """The ModelConfig of an `hf_class=auto` run: model.init_from's vocabulary and context length (where its
    config.json names one), the run's max_seq_len where set. ConfigError for fields only the native model has."""
    from kiln.model.hf_import import read_hf_config

    assert model.init_from is not None
    hf = read_hf_config(model.init_from)
    check_remote_code(model.init_from, hf, model.trust_remote_code)
    why = unbuildable(hf)
    if why is not None:
        raise StateError(f"model.init_from={model.init_from}: {why}")
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
    vocab = text.get("vocab_size") or hf.get("vocab_size")
    # a field set to what auto gives it is no clash: a run's config.yaml records every field (resumes read it)
    unset = ModelConfig().model_copy(update={"vocab_size": vocab})
    context = next((text[k] for k in _CONTEXT_KEYS if isinstance(text.get(k), int) and text[k] > 0), None)
    # a longer context is said first: a model.rope_scaling beside it, meant to extend it, is no mere clash
    if "max_seq_len" in model.model_fields_set and context is not None and model.max_seq_len > context:
        raise ConfigError(f"model.max_seq_len={model.max_seq_len} beside model.init_from={model.init_from} with "
                          f"model.hf_class=auto is longer than the model's {context} positions, which this path keeps. "
                          "Remove model.max_seq_len (train.seq_len sets how long the training rows are); to extend "
                          "the context, edit a copy of the model's config.json (its rope scaling and context length)")
    clash = sorted(k for k in model.model_fields_set - _FREE if getattr(model, k) != getattr(unset, k))
    if clash:
        raise ConfigError(f"model.init_from={model.init_from} with model.hf_class=auto takes the architecture from "
                          f"its config.json, but the config also sets {', '.join('model.' + k for k in clash)}: "
                          "remove those fields")
    update: dict[str, Any] = {"vocab_size": vocab}
    if "max_seq_len" not in model.model_fields_set:
        if context is None:
            raise ConfigError(f"model.init_from: {model.init_from}/config.json names no context length "
                              f"({', '.join(_CONTEXT_KEYS)}); set model.max_seq_len")
        update["max_seq_len"] = context
    return model.model_copy(update=update)


def _peft_config(lora: LoraConfig, hf: nn.Module):
    """PEFT's LoraConfig for `hf`; `lora.targets` found among its layers (kiln.model.hf_lora)."""
    peft = require("peft", "lora.rank > 0 with model.hf_class=auto")
    from kiln.model.hf_lora import block_linears, describe, lora_targets, peft_modules

    if "all" in lora.targets:
        targets: Any = "all-linear"
        where = "all (every linear layer but the output head)"
    else:
        found = lora_targets(hf, lora.targets)
        targets, where = peft_modules(found), describe(found)
    conv1d = any(type(m).__name__ == "Conv1D" for m in block_linears(hf).values())  # GPT-2 stores them transposed
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                             bias="none", task_type="CAUSAL_LM", fan_in_fan_out=conv1d)
    return config, where


def build_auto(cfg: ModelConfig, lora: LoraConfig | None = None, weights: bool = True) -> HFCausalLM:
    """The model of model.init_from through AutoModelForCausalLM, on the CPU, in fp32 (the frozen base in
    lora.base_dtype under LoRA); `weights` False: the architecture only, seeded-initialised (a resume,
    whose weights come from its checkpoint). With lora.rank > 0 the model gets PEFT LoRA adapters and
    only they train."""
    tr = transformers_module()
    from safetensors import SafetensorError

    from kiln.model.hf_import import read_hf_config, weight_files

    check_remote_code(cfg.init_from, read_hf_config(cfg.init_from), cfg.trust_remote_code)
    # safetensors only, unless pickles are allowed (the same refusal as the native import)
    safetensors = not weights or weight_files(cfg.init_from, cfg.allow_pickle)[0].suffix == ".safetensors"
    use_lora = lora is not None and lora.rank > 0
    dtype = torch.bfloat16 if use_lora and lora.base_dtype == "bf16" else torch.float32
    trust = cfg.trust_remote_code
    try:
        if weights:
            hf, info = tr.AutoModelForCausalLM.from_pretrained(cfg.init_from, dtype=dtype, trust_remote_code=trust,
                                                               use_safetensors=safetensors, output_loading_info=True)
            check_loaded(cfg.init_from, info)
        else:
            conf = tr.AutoConfig.from_pretrained(cfg.init_from, trust_remote_code=trust)
            hf = tr.AutoModelForCausalLM.from_config(conf, dtype=dtype, trust_remote_code=trust)
    except (ValueError, OSError, KeyError) as e:  # unknown model_type, a config it cannot read, ...
        raise StateError(f"model.init_from={cfg.init_from}: transformers cannot build a causal LM from it "
                         f"({type(e).__name__}: {e})") from None
    except (RuntimeError, EOFError, pickle.UnpicklingError, SafetensorError) as e:  # a damaged weight file
        raise StateError(f"model.init_from={cfg.init_from}: its weights cannot be read ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else 'damaged'}); copy them again from their "
                         "source") from None
    if use_lora:
        hf, where = _adapted(hf, lora)
        model = HFCausalLM(hf, cfg)
        model.lora_where = where
        return model
    return HFCausalLM(hf, cfg)


def _adapted(hf: nn.Module, lora: LoraConfig) -> tuple[nn.Module, str]:
    """(`hf` with PEFT's LoRA adapters, the layers each target adapts); ConfigError for a target no layer computes
    (kiln.model.hf_lora) or one PEFT refuses."""
    require("peft", "lora.rank > 0 with model.hf_class=auto")
    config, where = _peft_config(lora, hf)
    try:
        return _peft_model(hf, config), where  # freezes the base; adapters in fp32
    except ValueError as e:  # a layer PEFT does not adapt in this model (a Mamba layer's out_proj)
        raise ConfigError(f"lora.targets=[{', '.join(lora.targets)}]: PEFT cannot adapt them in "
                          f"{type(hf).__name__} ({e}); name the targets without those layers "
                          f"(they name {where})") from None


def _peft_model(hf: nn.Module, config) -> nn.Module:
    """peft.get_peft_model(hf, config), without the FutureWarning transformers gives for the deprecated
    is_gradient_checkpointing that PEFT asks for (a line in an auto LoRA run's output no user can act on)."""
    import peft

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        return peft.get_peft_model(hf, config)


def check_lora(cfg: ModelConfig, lora: LoraConfig) -> None:
    """ConfigError now, before any data is prepared, for lora.targets the model of cfg.init_from has no layer for
    or PEFT cannot adapt, or PEFT missing: the adapters `build_auto` gives, on its architecture built on the meta
    device (no memory, no weights read)."""
    tr = transformers_module()
    require("peft", "lora.rank > 0 with model.hf_class=auto")
    try:
        conf = tr.AutoConfig.from_pretrained(cfg.init_from, trust_remote_code=cfg.trust_remote_code)
        with torch.device("meta"):
            hf = tr.AutoModelForCausalLM.from_config(conf, trust_remote_code=cfg.trust_remote_code)
    except (ValueError, OSError, KeyError):
        return  # build_auto says why transformers cannot build it
    with torch.device("meta"):
        _adapted(hf, lora)


def check_loaded(path: str | Path, info: dict[str, Any]) -> None:
    """StateError if from_pretrained left weights of the model unread (transformers then initialises them at
    random and only logs it): the files in `path` are not this architecture's, or hold only part of it."""
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        unexpected = sorted(info.get("unexpected_keys") or ())
        also = (f"; the files hold {len(unexpected)} tensors the model does not have (e.g. "
                f"{', '.join(unexpected[:3])})") if unexpected else ""
        raise StateError(f"{path}: {len(missing)} weights of the model are not in its files (e.g. "
                         f"{', '.join(missing[:3])}){also}. They would start at random: give the directory whose "
                         "weights match its config.json")


def _takes(fn, name: str, named: bool = False) -> bool:
    """Whether `fn` takes the keyword `name`: as a parameter of that name, or (unless `named`) through **kwargs."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or (not named and any(p.kind is p.VAR_KEYWORD for p in params.values()))


class HFCausalLM(nn.Module):
    """A transformers causal LM (or a PEFT model around one) with Kiln's model call.

    `layers` are its decoder blocks (for activation checkpointing, compile and FSDP in kiln.parallel);
    `cfg` is the run's ModelConfig (its max_seq_len bounds generation)."""

    fullgraph = False  # a model's blocks may break the graph (a Llama block compiles whole: tests/unit/model)

    def __init__(self, hf: nn.Module, cfg: ModelConfig):
        super().__init__()
        self.hf, self.cfg = hf, cfg
        # named: a forward that only passes **kwargs on (BLOOM's) builds its masks without the positions
        self.takes_positions = _takes(self.base.forward, "position_ids", named=True)
        # documents of a packed row each run alone where positions cannot keep them apart (kiln.model.hf_packing)
        self.recurrent = recurrent_layers(self.base)
        self.split_documents = bool(self.recurrent) or not self.takes_positions
        self.lora_where: str | None = None  # under LoRA: the layers each lora.targets entry adapts
        # a mixture of experts whose config asks for its load-balancing loss: added in training (kiln.model.hf_moe)
        self.takes_router_flag = _takes(self.base.forward, "output_router_logits")
        self.router_aux_coef = router_aux_coef(getattr(self.base, "config", None), self.takes_router_flag)
        self.router_aux = RouterAux()
        # the native model's attention, loss and precision where the model allows: each is None, or why not
        self.own_attention = install_attention(self.base, self.split_documents)
        self.document_masks = False  # its own attention keeps documents apart by Kiln's (B, 1, T, T) mask
        if self.own_attention is not None and not self.split_documents:  # its masks must see the documents
            self.split_documents = not keeps_documents_apart(self.base)
            if self.split_documents and sliding_window(self.base) is None and not capped(self.base) \
                    and takes_document_masks(self.base):  # a mask of the documents replaces the model's own
                self.split_documents, self.document_masks = False, True
        self.window = sliding_window(self.base) if self.own_attention is None else None  # its layers' masks
        self.capped = self.own_attention is None and capped(self.base)  # soft-capped scores: a mask on every layer
        self.own_head = plain_head(self.base, None if self.own_attention else self._mask_argument)
        self.logit_cap = logit_cap(self.base)  # Gemma 2 and 3: the chunked loss soft-caps its logits
        self._hooks = match_native(self.decoder) if self.decoder is not None else []

    @property
    def base(self) -> nn.Module:
        """The transformers model (inside PEFT's wrapper under LoRA)."""
        return self.hf.get_base_model() if hasattr(self.hf, "get_base_model") else self.hf

    @property
    def layers(self) -> nn.ModuleList:
        return decoder_layers(self.hf)

    @property
    def is_peft(self) -> bool:
        return hasattr(self.hf, "peft_config")

    def _mask_argument(self, T: int, device: torch.device) -> dict[str, Any]:
        """Kiln's attention's mask keyword for rows of T positions, one document each."""
        return {MASK_KEY: layer_masks(None, device, T, self.window, self.capped)}

    @property
    def decoder(self) -> nn.Module | None:
        """The transformers model's decoder (embeddings, blocks, final norm: kiln.model.hf_head)."""
        return decoder_of(self.base)

    @property
    def norm(self) -> nn.Module | None:
        """The decoder's final norm (compiled beside the blocks, kiln.parallel.compile), where it has one."""
        norm = getattr(self.decoder, "norm", None)
        return norm if isinstance(norm, nn.Module) else None

    def describe_fast_path(self) -> str:
        """Where this model runs as the native one does and where not (the run's model line)."""
        parts = ["attention: " + ("Kiln's (SDPA; flex document masks on CUDA)" if self.own_attention is None
                                  else f"the model's own ({self.own_attention})"),
                 "loss: " + ("chunked on the hidden states" + (", soft-capped" if self.logit_cap else "")
                             if self.own_head is None
                             else f"on the full logits ({self.own_head})")]
        if self.document_masks:
            parts.append("documents: a (B, 1, T, T) mask as its attention_mask (its masks ignore the positions)")
        return "; ".join(parts)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, V), or with targets (B, T) the mean cross-entropy over targets
        other than -100. doc_ids (B, T): each position's document (position ids restart at each)."""
        kwargs: dict[str, Any] = {"use_cache": False}
        aux = self.router_aux_coef is not None and targets is not None and self.training
        if self.takes_router_flag:
            kwargs["output_router_logits"] = aux  # off in evaluation: val_loss is the cross-entropy alone
        split = doc_ids is not None and self.split_documents
        if split:  # each document its own sequence, then packed again
            rows, seg, pos = split_documents(tokens, doc_ids.to(tokens.device))  # (N, L), (B, T), (B, T)
            kwargs["input_ids"], doc_ids = rows, None
        else:
            kwargs["input_ids"] = tokens
            if doc_ids is not None:
                doc_ids = doc_ids.to(tokens.device)
                kwargs["position_ids"] = doc_positions(doc_ids)
                if self.document_masks:
                    kwargs["attention_mask"] = document_attention_mask(doc_ids)
        if self.own_attention is None:  # built once, for every layer (None: plain causal attention)
            kwargs[MASK_KEY] = layer_masks(doc_ids, tokens.device, kwargs["input_ids"].shape[1], self.window,
                                           self.capped)
        if targets is not None and self.own_head is None and not aux:  # never the whole batch's logits
            h = self.decoder(**kwargs).last_hidden_state  # (B, T, d) or (N, L, d)
            if split:
                h = merge_documents(h, seg, pos)
            return loss.linear_cross_entropy(h, self.base.get_output_embeddings().weight, targets,
                                             softcap=self.logit_cap)
        out = self.hf(**kwargs)
        logits = merge_documents(out.logits, seg, pos) if split else out.logits  # (B, T, V)
        if targets is None:
            return logits
        result = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX)
        if aux and getattr(out, "aux_loss", None) is not None:  # as the model adds it given labels
            self.router_aux.add(out.aux_loss)
            result = result + self.router_aux_coef * out.aux_loss.float()
        return result

    def param_count(self) -> int:
        """Parameters of the model, shared ones counted once."""
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, 6*N + 12*L*d*T as for the native model: N the parameters outside the
        input embedding table, L the decoder blocks, d the embedding width (an estimate for models whose
        blocks are not all attention)."""
        emb = self.base.get_input_embeddings()
        n = self.param_count() - (emb.weight.numel() if emb is not None and not self._tied() else 0)
        d = emb.weight.shape[1] if emb is not None else 0
        return 6.0 * n + 12.0 * len(self.layers) * d * seq_len

    def _tied(self) -> bool:
        out, emb = self.base.get_output_embeddings(), self.base.get_input_embeddings()
        return out is not None and emb is not None and out.weight is emb.weight

    def save_pretrained(self, out: str | Path, tokenizer=None, merged: bool = True, dtype: torch.dtype | None = None
                        ) -> Path:
        """The Hugging Face layout in `out` (config.json, safetensors; `tokenizer(out)` writes the tokenizer) that
        AutoModelForCausalLM.from_pretrained loads. Under LoRA: PEFT's adapters in `out/adapters`, and
        with `merged` the base model with the adapters merged in `out` (this model's weights merge too)."""
        out = Path(out).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        hf = self.hf
        if self.is_peft:
            hf.save_pretrained(str(out / "adapters"), safe_serialization=True)
            if not merged:
                return out
            hf = self._merged_on_stored_base()
            self.hf = hf
        if dtype is not None:
            hf = hf.to(dtype)
        hf.save_pretrained(str(out), safe_serialization=True)
        for f in out.rglob("*.safetensors"):  # written 0600 by safetensors: the mode of a new file instead
            default_mode(f)
        if tokenizer is not None:
            tokenizer(out)  # the caller's writer of the tokenizer files (kiln.state.export.write_tokenizer)
        return out


    def _merged_on_stored_base(self) -> nn.Module:
        """The PEFT model's adapters merged onto the base as stored in cfg.init_from (read again in fp32), not onto
        the training copy: in bf16 (lora.base_dtype) that would round every base weight, adapted or not."""
        import copy

        import peft

        if all(p.dtype == torch.float32 for p in self.base.parameters()):  # the training copy is the stored base
            return self.hf.merge_and_unload()
        from kiln.model.hf_import import weight_files

        cfg = self.cfg
        safetensors = weight_files(cfg.init_from, cfg.allow_pickle)[0].suffix == ".safetensors"
        try:
            base = transformers_module().AutoModelForCausalLM.from_pretrained(
                cfg.init_from, dtype=torch.float32, trust_remote_code=cfg.trust_remote_code,
                use_safetensors=safetensors)
        except (ValueError, OSError, KeyError) as e:
            raise StateError(f"model.init_from={cfg.init_from}: the base model cannot be read again to merge the "
                             f"adapters into ({type(e).__name__}: {e}); the adapters alone are in adapters/") from None
        base.config.use_cache = self.base.config.use_cache
        adapted = _peft_model(base, copy.deepcopy(self.hf.peft_config["default"]))
        peft.set_peft_model_state_dict(adapted, peft.get_peft_model_state_dict(self.hf))
        return adapted.merge_and_unload()


def open_directory(path: str | Path) -> HFCausalLM:
    """A Hugging Face model directory of any architecture transformers has, as `kiln train model.init_from=PATH
    model.hf_class=auto` builds it, in fp32 (kiln eval, kiln export)."""
    return build_auto(auto_config(ModelConfig(init_from=str(path), hf_class="auto"))).eval()


def load_auto(path: Path, cfg: ModelConfig) -> HFCausalLM:
    """The saved final model of an auto run (`<run>/model`, written by `HFCausalLM.save_pretrained`)."""
    tr = transformers_module()
    try:
        hf, info = tr.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, use_safetensors=True,
                                                           trust_remote_code=cfg.trust_remote_code,
                                                           output_loading_info=True)
    except (ValueError, OSError, KeyError) as e:
        raise StateError(f"{path}: transformers cannot load the saved model ({type(e).__name__}: {e})") from None
    check_loaded(path, info)
    return HFCausalLM(hf, cfg)

