"""The training loop. `train()` calls `train_step()` and emits events; everything else is a callback."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch import nn

from kiln.config import RunConfig
from kiln.dist.mesh import Mesh, current_mesh
from kiln.dist.parallelize import clip_grad_norm, grad_sync, optimizer_device, reduce_mean
from kiln.dist.watch import beat
from kiln.errors import TrainingError
from kiln.events import Callback, Events
from kiln.model.loss import IGNORE_INDEX
from kiln.monitor.meters import Throughput
from kiln.train.optim import build_optimizer, build_scheduler


class Trainer:
    def __init__(self, cfg: RunConfig, model: nn.Module, train_loader, val_loader, device: torch.device,
                 callbacks: list[Callback] = (), flops_per_token: float = 0.0, mesh: Mesh | None = None):
        self.cfg, self.model, self.device = cfg, model, device
        self.mesh = mesh or current_mesh(device)  # kiln.dist: ranks whose metrics are reduced
        self.train_loader, self.val_loader = train_loader, val_loader
        self.optimizer = build_optimizer(model, cfg.optim, cfg.train.lr, optimizer_device(cfg, device, model))
        self.scheduler = build_scheduler(self.optimizer, cfg.train)
        self.events = Events(list(callbacks))
        self.step, self.tokens_seen = 0, 0
        self.consistent = True  # False while a step is half done
        # the global batch: micro-batch x accumulation x data-parallel ranks (kiln.dist)
        self.tokens_per_step = cfg.train.batch_size * cfg.train.seq_len * cfg.train.grad_accum * self.mesh.world
        peak = cfg.train.peak_tflops * 1e12 if cfg.train.peak_tflops else None
        self.meter = Throughput(flops_per_token, device, peak)
        self.last_eval: dict[str, Any] | None = None
        self.token_bytes: torch.Tensor | None = None  # bytes of text per token id (on the device): val_bpb
        self.stop_reason: str | None = None  # set by a callback (early stopping) to end training after this step
        use_bf16 = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and device.type == "cuda")
        self.autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if use_bf16 \
            else contextlib.nullcontext

    def state_dict(self) -> dict[str, Any]:
        """The trainer's own counters (saved under the key "trainer"; the rest of the state is its parts')."""
        last = dict(self.last_eval) if self.last_eval is not None else None
        out = {"step": self.step, "tokens_seen": self.tokens_seen, "last_eval": last, "stop_reason": self.stop_reason}
        for cb in self.events.callbacks:  # callbacks with a state of their own (early stopping) under their key
            if getattr(cb, "state_key", None):
                out[cb.state_key] = cb.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.last_eval = dict(state["last_eval"]) if state.get("last_eval") is not None else None
        for cb in self.events.callbacks:
            if getattr(cb, "state_key", None) and state.get(cb.state_key) is not None:
                cb.load_state_dict(state[cb.state_key])

    def _batch(self, loader) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Next (tokens, targets, doc_ids): tokens and targets on the device; doc_ids (None without
        document masking) stay where the loader made them: the model builds its mask from them."""
        tokens, targets, doc_ids = next(loader)
        return tokens.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True), doc_ids

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over grad_accum micro-batches. Returns (loss, grad norm) on the device."""
        accum, clip = self.cfg.train.grad_accum, self.cfg.train.grad_clip
        total = torch.zeros((), device=self.device)
        for i in range(accum):
            with self.meter.waiting_for_data():
                x, y, docs = self._batch(self.train_loader)  # (B, T) each
            beat()  # kiln.dist watchdog: this rank is making progress
            with grad_sync(self.model, sync=i == accum - 1):  # kiln.dist: no collective before the last
                with self.autocast():
                    loss = self.model(x, y, docs) / accum
                loss.backward()
            total += loss.detach()
        # parameters without a gradient are skipped; max_norm=inf still measures the norm for the logs
        gnorm = clip_grad_norm(self.model, clip if clip > 0 else float("inf"))  # kiln.dist: over every shard
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total, gnorm

    def train(self) -> dict[str, Any]:
        tcfg, every = self.cfg.train, max(1, self.cfg.logging.every)
        self.model.train()
        self.events.emit("on_train_start", self)
        self.meter.start(self.step)
        losses: list[torch.Tensor] = []
        while self.step < tcfg.max_steps and self.stop_reason is None:
            self.consistent = False  # until the counters match the weights again (emergency checkpoints)
            loss, gnorm = self.train_step()
            self.step += 1
            self.tokens_seen += self.tokens_per_step
            self.consistent = True
            losses.append(loss)
            metrics = None
            if self.step % every == 0 or self.step == tcfg.max_steps:
                metrics = self._step_metrics(torch.stack(losses), gnorm)  # the one host sync
                losses.clear()
            self.events.emit("on_step_end", self, metrics)
        stopped_here = self.stop_reason is not None and (self.last_eval or {}).get("step") == self.step
        final = self.last_eval if stopped_here else self.evaluate()  # an early stop has just evaluated
        self.events.emit("on_train_end", self, final)
        return final

    def _step_metrics(self, losses: torch.Tensor, gnorm: torch.Tensor) -> dict[str, Any]:
        loss = losses.float().mean()
        loss.item()  # the host sync the meter's clock needs
        # kiln.dist: this rank's throughput, then the mean over ranks of it and of the loss (one collective)
        local = self.meter.read(self.step, self.tokens_per_step // self.mesh.world)
        keys = sorted(local)
        values = torch.stack([loss, *(torch.tensor(float(local[k]), device=loss.device) for k in keys)])
        mean = reduce_mean(values, self.mesh).cpu().tolist()
        loss, rates = mean[0], dict(zip(keys, mean[1:]))
        if not math.isfinite(loss):
            raise TrainingError(f"loss became {loss} at step {self.step}. Lower train.lr, raise "
                                "train.warmup_steps or check the data.")
        rates["tokens_per_s_per_device"] = rates["tokens_per_s"]
        rates["tokens_per_s"] *= self.mesh.world  # the whole job
        return {"step": self.step, "loss": loss, "lr": self.scheduler.get_last_lr()[0],
                "grad_norm": float(gnorm), "tokens": self.tokens_seen, **rates}

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Mean loss, perplexity and bits per byte (with `token_bytes`) over the same eval_batches validation
        batches every time ({} when the data has no validation split)."""
        if self.val_loader is None:
            return {}
        with self.meter.paused():  # evaluation time is not counted in training tokens/s
            self.model.eval()
            self.val_loader.reset()
            sums = torch.zeros(3, device=self.device)  # mean losses; summed nats; bytes of the targets
            n, table = self.cfg.train.eval_batches, self.token_bytes
            for _ in range(n):
                x, y, docs = self._batch(self.val_loader)
                beat()
                with self.autocast():
                    loss = self.model(x, y, docs).float()
                sums[0] += loss
                if table is not None:
                    counted = y != IGNORE_INDEX  # (B, T)
                    sums[1] += loss * counted.sum()
                    sums[2] += (table[y.clamp_min(0)] * counted).sum()
            self.model.train()
            total, nats, nbytes = sums.tolist()  # the one host sync
        loss = total / n
        self.last_eval = {"step": self.step, "tokens": self.tokens_seen, "val_loss": loss,
                          "val_ppl": math.exp(min(loss, 50.0))}
        if table is not None and nbytes > 0:
            self.last_eval["val_bpb"] = nats / (math.log(2) * nbytes)
        self.events.emit("on_eval_end", self, self.last_eval)
        return self.last_eval
