"""The training loop. `train()` calls `train_step()` and emits events; everything else is a callback."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch import nn

from kiln.config import RunConfig
from kiln.errors import TrainingError
from kiln.events import Callback, Events
from kiln.model.loss import IGNORE_INDEX
from kiln.monitor.meters import Throughput
from kiln.parallel.mesh import Mesh, current_mesh
from kiln.parallel.parallelize import clip_grad_norm, grad_sync, optimizer_device, reduce_mean
from kiln.parallel.watch import beat
from kiln.train.oom import OomRetry
from kiln.train.optim import build_optimizer, build_scheduler, offload_optimizer
from kiln.train.rollback import SkipList, host_read, set_lr_scale


class Trainer:
    def __init__(self, cfg: RunConfig, model: nn.Module, train_loader, val_loader, device: torch.device,
                 callbacks: list[Callback] = (), flops_per_token: float = 0.0, mesh: Mesh | None = None,
                 micro_batch: int | None = None):
        self.cfg, self.model, self.device = cfg, model, device
        self.mesh = mesh or current_mesh(device)  # kiln.parallel: ranks whose metrics are reduced
        self.train_loader, self.val_loader = train_loader, val_loader
        # train.offload: AdamW on the host over fp32 masters (kiln.parallel.offload), else on the device
        self.offload = offload_optimizer(model, cfg.optim, cfg.train.lr) if cfg.train.offload != "none" else None
        self.optimizer = self.offload.optimizer if self.offload is not None else \
            build_optimizer(model, cfg.optim, cfg.train.lr, optimizer_device(cfg, device, model))
        self.scheduler = build_scheduler(self.optimizer, cfg.train)
        self.events = Events(list(callbacks))
        self.step, self.tokens_seen = 0, 0
        self.consistent = True  # False while a step is half done
        # the global batch: this rank's rows per step x data-parallel ranks (kiln.parallel); a step's rows come in
        # `loads` loader batches and train in micro-batches of `micro` rows (auto, or halved by kiln.train.oom)
        tcfg = cfg.train
        self.rows = tcfg.step_rows(self.mesh.world)
        self.loads = self.rows // tcfg.loader_rows(self.mesh.world)
        self.micro = micro_batch or (self.rows if tcfg.batch_size == "auto" else tcfg.batch_size)
        self.tokens_per_step = self.rows * tcfg.seq_len * self.mesh.world
        self.oom = OomRetry(cfg.recovery.oom_retries)
        self.skips = SkipList()  # samples of bad steps, passed over (kiln.train.rollback)
        # set by kiln.train.rollback.Rollback: check_step notes a step, and at a check point checks the steps noted
        # so far (at a logging step, in its StepRead), undoing a bad one (True if it did); verify_pending checks
        # them now (before a save, at the end)
        self.check_step = None
        self.verify_pending = None
        self.step_start: dict = {}  # the loader's position before this step's rows, and their global samples
        self.step_samples = (0, 0)
        self.batch = None  # this rank's rows of the step just trained: (tokens, targets, doc_ids), on the device
        self.lr_scale, self._base_lrs = 1.0, list(self.scheduler.base_lrs)
        peak = cfg.train.peak_tflops * 1e12 if cfg.train.peak_tflops else None
        self.meter = Throughput(flops_per_token, device, peak)
        self.last_eval: dict[str, Any] | None = None
        # the losses of the steps since the last logging step (their mean is the next one's loss); saved with the
        # state, so the first logging step after a resume logs the mean an uninterrupted run logs
        self.unlogged: list[torch.Tensor] = []
        # values on the device that each logging step reads beside its loss, in the same all-reduce and host read
        # (name -> a function giving a 0-d tensor, or None when it has nothing this time): the router losses of a
        # mixture of experts (kiln.train.router_aux), at no sync or collective of their own
        self.logged: dict[str, Any] = {}
        self.token_bytes: torch.Tensor | None = None  # bytes of text per token id (on the device): val_bpb
        self.stop_reason: str | None = None  # set by a callback (early stopping) to end training after this step
        self.step_lr: float | None = None  # the learning rate of the last step trained
        use_bf16 = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and device.type == "cuda")
        self.autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if use_bf16 \
            else contextlib.nullcontext

    def state_dict(self) -> dict[str, Any]:
        """The trainer's own counters (saved under the key "trainer"; the rest of the state is its parts')."""
        last = dict(self.last_eval) if self.last_eval is not None else None
        out = {"step": self.step, "tokens_seen": self.tokens_seen, "last_eval": last, "stop_reason": self.stop_reason,
               "skipped": self.skips.state_dict(), "lr_scale": self.lr_scale,
               "unlogged": torch.stack(self.unlogged).float().tolist() if self.unlogged else []}  # one read
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
        self.skips.load_state_dict(state.get("skipped", []))
        self.set_lr_scale(float(state.get("lr_scale", 1.0)))
        self.unlogged[:] = [torch.tensor(float(v), device=self.device) for v in state.get("unlogged", [])]  # in place:
        # the training loop holds this list

    def set_lr_scale(self, scale: float) -> None:
        """Train at `scale` times the configured learning rates from now on (lowered by rollbacks)."""
        if scale != 1.0 or self.lr_scale != 1.0:
            set_lr_scale(self.scheduler, self._base_lrs, scale)
        self.lr_scale = scale

    def notice(self, kind: str, **info: Any) -> None:
        """Tell the callbacks of something the run did on its own (sinks log it; metrics.jsonl keeps it)."""
        self.events.emit("on_notice", self, kind, info)

    def _batch(self, loader) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Next (tokens, targets, doc_ids) on the device (doc_ids None without document masking), copied without
        waiting: DDP and FSDP2 copy an input still on the CPU with a blocking copy, which makes the host wait for
        the GPU to finish all its queued work at every forward pass."""
        return tuple(None if t is None else t.to(self.device, non_blocking=True) for t in next(loader))

    def _step_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """This rank's rows of the next step, (N, T) each, from `loads` loader batches; the rows of a step
        that went bad before (`self.skips`) are read and passed over."""
        world_rows = self.rows * self.mesh.world
        while True:
            self.step_start = self.train_loader.state_dict()
            first = int(self.step_start.get("sample", -1))  # global index of the step's first sample
            parts = [self._batch(self.train_loader) for _ in range(self.loads)]
            if not self.skips.covers(first, world_rows):
                break
        self.step_samples = (first, first + world_rows)
        if len(parts) == 1:
            return parts[0]
        docs = None if parts[0][2] is None else torch.cat([p[2] for p in parts])
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), docs

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over this rank's rows of the global batch, in micro-batches of `self.micro`
        rows (halved, and the step run again, on an out-of-memory error: kiln.train.oom).
        Returns (loss, grad norm) on the device."""
        with self.meter.waiting_for_data():
            self.batch = batch = self._step_batch()  # (N, T) each
        total = self.oom.run(self, lambda: self._accumulate(batch))
        clip = self.cfg.train.grad_clip
        # parameters without a gradient are skipped; max_norm=inf still measures the norm for the logs
        max_norm = clip if clip > 0 else float("inf")
        if self.offload is not None:  # kiln.parallel.offload: norm, clipping and AdamW on the host, weights sent back
            gnorm = self.offload.step(max_norm)
        else:
            gnorm = clip_grad_norm(self.model, max_norm)  # kiln.parallel: over every shard
            self.optimizer.step()
        self.step_lr = self.scheduler.get_last_lr()[0]  # the rate this step trained at (logged); the schedule moves on
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total, gnorm

    def _accumulate(self, batch) -> torch.Tensor:
        """Forward and backward of `batch` (N rows) in micro-batches of `self.micro` rows, each loss weighted by
        its share of the rows: the gradients are those of the mean loss over all N, however they are split."""
        x, y, docs = batch
        if self.offload is not None and self.offload.layered:  # every micro-batch through a layer before the next
            return self.offload.accumulate(x, y, docs, self.micro, self.autocast)
        n = x.shape[0]
        total = torch.zeros((), device=self.device)
        for lo in range(0, n, self.micro):
            hi = min(lo + self.micro, n)
            beat()  # kiln.parallel watchdog: this rank is making progress
            # kiln.parallel: under FSDP each micro-batch is reduce-scattered (dist.reduce_every_microbatch), else
            # no collective before the last
            with grad_sync(self.model, sync=hi == n, every_microbatch=self.cfg.dist.reduce_every_microbatch):
                with self.autocast():
                    loss = self.model(x[lo:hi], y[lo:hi], None if docs is None else docs[lo:hi]) / (n / (hi - lo))
                loss.backward()
            total += loss.detach()
        return total

    def train(self) -> dict[str, Any]:
        tcfg, every = self.cfg.train, max(1, self.cfg.logging.every)
        self.model.train()
        self.events.emit("on_train_start", self)
        self.meter.start(self.step)
        losses = self.unlogged
        while self.step < tcfg.max_steps and self.stop_reason is None:
            self.consistent = False  # until the counters match the weights again (emergency checkpoints)
            loss, gnorm = self.train_step()
            losses.append(loss)
            step = self.step + 1
            logs = step % every == 0 or step == tcfg.max_steps
            read = StepRead(self, losses, gnorm, step) if logs else None  # the one host read of a logging step
            if self.check_step is not None and self.check_step(self, loss, gnorm, read):
                losses.clear()  # a bad step, undone (kiln.train.rollback): back at the snapshot's step
                continue
            self.step = step
            self.tokens_seen += self.tokens_per_step
            self.consistent = True
            metrics = None
            if read is not None:
                metrics = self._step_metrics(read)  # read by the rollback's check, or now
                losses.clear()
            self.events.emit("on_step_end", self, metrics)
        if self.verify_pending is not None:  # a stop: its step is checked first (a bad one: stop at the snapshot)
            self.verify_pending(self)
        stopped_here = self.stop_reason is not None and (self.last_eval or {}).get("step") == self.step
        final = self.last_eval if stopped_here else self.evaluate()  # an early stop has just evaluated
        self.events.emit("on_train_end", self, final)
        return final

    def _step_metrics(self, read: StepRead) -> dict[str, Any]:
        if read.metrics is None:  # no check read the step along (rollback off)
            read()
        rates = dict(read.metrics)
        loss, gnorm = rates.pop("loss"), rates.pop("grad_norm")
        if not math.isfinite(loss):
            raise TrainingError(f"loss became {loss} at step {self.step}. Lower train.lr, raise "
                                "train.warmup_steps or check the data.")
        rates["tokens_per_s_per_device"] = rates["tokens_per_s"]
        rates["tokens_per_s"] *= self.mesh.world  # the whole job
        return {"step": self.step, "loss": loss, "lr": self.step_lr,
                "grad_norm": gnorm, "tokens": self.tokens_seen, **rates}

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Mean loss, perplexity and bits per byte (with `token_bytes`) over the same eval_batches validation
        batches every time ({} when the data has no validation split). Under several processes each reads its
        rows of each batch, as in training: the same batches, and the same figures, on any number of them."""
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
                for lo in range(0, len(x), self.micro):  # the micro-batch that trains fits here too
                    hi = min(lo + self.micro, len(x))
                    xs, ys, ds = x[lo:hi], y[lo:hi], None if docs is None else docs[lo:hi]
                    with self.autocast():
                        loss = self.model(xs, ys, ds).float()  # the mean over this part's targets
                    sums[0] += loss if hi - lo == len(x) else loss * ((hi - lo) / len(x))
                    if table is not None:
                        counted = ys != IGNORE_INDEX  # (b, T)
                        sums[1] += loss * counted.sum()
                        sums[2] += (table[ys.clamp_min(0)] * counted).sum()
            self.model.train()
            # kiln.parallel: each rank read its own rows of each batch; the means over ranks give the batches' mean
            # loss, and the ratio of nats to bytes that of their sums
            total, nats, nbytes = reduce_mean(sums, self.mesh).tolist()  # the one host sync
        loss = total / n
        self.last_eval = {"step": self.step, "tokens": self.tokens_seen, "val_loss": loss,
                          "val_ppl": math.exp(min(loss, 50.0))}
        if table is not None and nbytes > 0:
            self.last_eval["val_bpb"] = nats / (math.log(2) * nbytes)
        self.events.emit("on_eval_end", self, self.last_eval)
        return self.last_eval


class StepRead:
    """The host read of logging step `step`: after the sync the throughput clock needs (this rank's gradient norm),
    one read of the mean over ranks (one all-reduce) of the loss since the last log (`losses`), of this rank's
    throughput and of the trainer's `logged` values. A check of the step (kiln.train.rollback) reads its values
    along: `read(values)` returns their means over ranks, from the same all-reduce, and leaves the step's metrics in
    `metrics`."""

    def __init__(self, trainer: Trainer, losses: list[torch.Tensor], gnorm: torch.Tensor, step: int):
        self.trainer, self.losses, self.gnorm, self.step = trainer, losses, gnorm, step
        self.metrics: dict[str, float] | None = None  # loss, grad_norm and the meter's rates, once read

    def __call__(self, values: torch.Tensor | None = None) -> list[float]:
        t = self.trainer
        loss = torch.stack(self.losses).float().mean()
        values = loss.new_zeros(0) if values is None else values  # (n,) float32, on the device
        gnorm = self.gnorm.detach().float().to(loss.device).item()  # the host sync the meter's clock needs
        local = t.meter.read(self.step, t.tokens_per_step // t.mesh.world)
        keys = sorted(local)
        rates = torch.tensor([float(local[k]) for k in keys], device=loss.device)
        extra = {name: v for name, take in t.logged.items() if (v := take()) is not None}  # every rank alike
        along = [v.detach().float().reshape(1).to(loss.device) for v in extra.values()]
        mean = host_read(torch.cat([values, loss[None], rates, *along]), t.mesh)  # kiln.parallel: the one all-reduce
        n, r = len(values), len(values) + 1 + len(keys)
        self.metrics = {"loss": mean[n], "grad_norm": gnorm, **dict(zip(keys, mean[n + 1:r])),
                        **dict(zip(extra, mean[r:]))}
        return mean[:n]
