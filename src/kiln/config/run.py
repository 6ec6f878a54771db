"""The whole run config: one field per section, and the checks that involve several sections."""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import model_validator

from kiln.config.base import Problem, Section
from kiln.config.checkpoint import CheckpointConfig
from kiln.config.data import DataConfig
from kiln.config.eval import EvalConfig
from kiln.config.logging import LoggingConfig
from kiln.config.lora import LoraConfig
from kiln.config.model import ModelConfig
from kiln.config.monitor import MonitorConfig, ProfileConfig
from kiln.config.optim import OptimConfig
from kiln.config.parallel import DistConfig
from kiln.config.recovery import RecoveryConfig
from kiln.config.train import TrainConfig


class RunConfig(Section):
    model: ModelConfig = ModelConfig()
    """The network: size and shape."""
    data: DataConfig = DataConfig()
    """What to train on and how to tokenize it."""
    train: TrainConfig = TrainConfig()
    """Length, batch, schedule, evaluation and device of the run."""
    optim: OptimConfig = OptimConfig()
    """Optimizer hyperparameters."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """What is saved and when."""
    logging: LoggingConfig = LoggingConfig()
    """Where metrics go."""
    recovery: RecoveryConfig = RecoveryConfig()
    """Automatic micro-batch, out-of-memory retries and rollback of bad steps."""
    profile: ProfileConfig = ProfileConfig()
    """A torch.profiler trace of a few training steps (off unless profile.steps > 0)."""
    monitor: MonitorConfig = MonitorConfig()
    """Resource readings, warnings before things go wrong, and hang detection."""
    dist: DistConfig = DistConfig()
    """Several processes and devices (torchrun): DDP or FSDP2, sharding, offload, watchdog."""
    lora: LoraConfig = LoraConfig()
    """Low-rank adapters (off unless lora.rank > 0)."""
    eval: EvalConfig = EvalConfig()
    """Benchmark tasks (lm-evaluation-harness) at the run's evaluations (off unless eval.tasks is set)."""

    @model_validator(mode="before")
    @classmethod
    def _tokenizer_of_init_from(cls, data: Any) -> Any:
        """With model.init_from and no data.tokenizer, the data is tokenized with the model's own tokenizer; with
        no data.bos_token, each document starts as that tokenizer's post-processor starts a text."""
        if isinstance(data, dict):
            model, dcfg = data.get("model"), data.get("data")
            src = model.get("init_from") if isinstance(model, dict) else getattr(model, "init_from", None)
            if src and isinstance(dcfg, dict | None):
                given = dict(dcfg or {})
                if not given.get("tokenizer"):
                    given["tokenizer"] = src
                given.setdefault("bos_token", "tokenizer")
                data = {**data, "data": given}
            elif src and isinstance(dcfg, DataConfig):
                update = {} if dcfg.tokenizer else {"tokenizer": src}
                if "bos_token" not in dcfg.model_fields_set:
                    update["bos_token"] = "tokenizer"
                data = {**data, "data": dcfg.model_copy(update=update)}
        return data

    def problems(self) -> list[Problem]:
        """The checks across sections (each section checks its own fields: see `all_problems`)."""
        out: list[Problem] = []
        t, m = self.train, self.model
        from_model = bool(m.init_from)  # checked once init_from is read: the model's context is its own
        if t.seq_len > m.max_seq_len and not from_model:
            out.append((("train.seq_len", "model.max_seq_len"),
                        f"train.seq_len={t.seq_len} is longer than model.max_seq_len={m.max_seq_len}; raise "
                        "model.max_seq_len or shorten train.seq_len"))
        if t.offload != "none" and self.lora.rank:
            out.append((("train.offload", "lora.rank"), f"train.offload={t.offload} is for full training; a LoRA run's "
                        "adapters and their AdamW state are small and stay on the device: remove train.offload"))
        if t.offload != "none" and t.fp8.enabled:
            out.append((("train.offload", "train.fp8.enabled"), f"train.offload={t.offload} is not supported with "
                        "float8 layers (its layer-by-layer step and host AdamW are untested with them): set "
                        "train.fp8.enabled=false, or train.offload=none with several GPUs"))
        if t.offload != "none" and m.hf_class != "native":
            out.append((("train.offload", "model.hf_class"), f"train.offload={t.offload} trains the native model; "
                        f"model.hf_class={m.hf_class} is not supported with it: set model.hf_class=native"))
        if self.lora.quantize_base != "none" and m.hf_class == "auto":
            out.append((("lora.quantize_base", "model.hf_class"),
                        f"lora.quantize_base={self.lora.quantize_base} quantizes Kiln's native model; with "
                        "model.hf_class=auto it is not supported: use model.hf_class=native (Llama, Mistral, Qwen2 "
                        "and Nemotron shapes), or lora.quantize_base=none"))
        ep = self.dist.expert_parallel
        if ep > 1 and (self.lora.rank or m.hf_class == "auto" or (not from_model and m.moe is None)):
            what = ("lora.rank", "LoRA") if self.lora.rank else ("model.hf_class", "model.hf_class=auto") \
                if m.hf_class == "auto" else ("model.moe", "a model without experts (model.moe)")
            out.append((("dist.expert_parallel", what[0]), f"dist.expert_parallel={ep} spreads a native mixture of "
                        f"experts over the processes; {what[1]} is not supported with it: set dist.expert_parallel=1"))
        elif ep > 1 and m.moe is not None and m.moe.n_experts % ep:
            out.append((("dist.expert_parallel", "model.moe.n_experts"), f"dist.expert_parallel={ep} must divide "
                        f"model.moe.n_experts={m.moe.n_experts} (each process keeps whole experts): choose a divisor"))
        es = t.early_stop
        if es.patience and es.metric not in ("val_loss", "val_ppl", "val_bpb") and \
                es.metric.split("/", 1)[0] not in self.eval.tasks:
            tasks = ", ".join(self.eval.tasks) or "none"
            out.append((("train.early_stop.metric", "eval.tasks"),
                        f"train.early_stop.metric={es.metric} is no metric of the run's evaluations: watch val_loss, "
                        f"val_ppl, val_bpb, or TASK/METRIC of a task in eval.tasks (now {tasks})"))
        if t.fp8.enabled and (self.lora.rank or m.hf_class == "auto"):
            what = "lora.rank > 0" if self.lora.rank else "model.hf_class=auto"
            out.append((("train.fp8.enabled", "lora.rank" if self.lora.rank else "model.hf_class"),
                        f"train.fp8.enabled converts the native model's linear layers, and {what} trains "
                        "another kind of model; train it in bf16 (train.fp8.enabled=false)"))
        return out

    def all_problems(self) -> list[tuple[str, tuple[str, ...], str]]:
        """Every cross-field problem of every section, as (where, full keys involved, message)."""
        found = [(name, tuple(f"{name}.{k}" for k in keys), msg)
                 for name in type(self).model_fields for keys, msg in getattr(self, name).problems()]
        for i, entry in enumerate(self.data.mixture):
            where = f"data.mixture.{i}"
            found += [(where, tuple(f"{where}.{k}" for k in keys), msg) for keys, msg in entry.problems()]
        return found + [("", keys, msg) for keys, msg in self.problems()]

    def to_yaml(self) -> str:
        data = self.model_dump(mode="json")
        if self.data.mixture:  # the unused default sources would make the file name both (refused on load)
            data["data"].pop("sources", None)
        return yaml.safe_dump(data, sort_keys=False)
