"""Early stopping on validation loss, a callback of the training loop (train.early_stop).

An evaluation improves when its val_loss is below the last improvement's by more than `min_delta`. After
`patience` evaluations in a row without improvement the callback sets `trainer.stop_reason`; the best it names
is the lowest validation loss of the run (one that improved by less than min_delta included), as `kiln runs`
shows it: the loop
ends after that step, the final checkpoint and model are saved as at the end of any run, and the
reason is printed and written to metrics.jsonl as an `early_stop` event. Its state (best loss, its
step, evaluations since) is saved in checkpoints under the trainer's key "early_stop", so a resumed
run counts on; resuming a run that stopped early stops it again at once, unless the config now allows
more patience (or turns early stopping off with patience 0).

`metric` (train.early_stop.metric) watches another number of the evaluations instead of val_loss: val_bpb, or
a benchmark score of eval.tasks (hellaswag/acc, with mode max); evaluations without it are not counted.

With `restore_best` (train.early_stop.restore_best, on by default) the weights of each new best evaluation are
copied to host memory (one copy, its buffers reused; under FSDP each process its shard), and after a stop
`restore` loads them back into the model: model/ and the sample are those of the best step, while the final
checkpoint keeps the last step's whole state (a resume goes on from there). A resumed run that stops again at
once has no copy in memory: the checkpoint of the best step is read instead, when one is kept
(checkpoint.keep_best holds it); without one, model/ keeps the last weights, and the run says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kiln.events import Callback
from kiln.state.rundir import checkpoints, step_of


class EarlyStop(Callback):
    state_key = "early_stop"

    def __init__(self, patience: int, min_delta: float = 0.0, log: Callable[[str], None] | None = print,
                 restore_best: bool = False, metric: str = "val_loss", mode: str = "min"):
        self.patience, self.min_delta, self.log = patience, min_delta, log
        self.metric, self.sign = metric, 1.0 if mode == "min" else -1.0  # sign * value: lower is better
        self.restore_best = restore_best
        self.kept: int | None = None  # the step whose weights `_stager` holds
        self._stager = None
        self.best: float | None = None  # the lowest validation loss so far, and its step
        self.best_step: int | None = None
        self.mark: float | None = None  # the loss of the last improvement by more than min_delta
        self.since = 0  # evaluations since that improvement
        self.last_step = -1  # the step of the last evaluation counted (a resume may evaluate a step again)

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "mark": self.mark, "since": self.since,
                "last_step": self.last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_step = state.get("best"), state.get("best_step")
        self.mark = state.get("mark", self.best)
        self.since, self.last_step = int(state.get("since", 0)), int(state.get("last_step", -1))

    def reason(self) -> str:
        what = "validation loss" if self.metric == "val_loss" else self.metric
        return (f"{what} has not improved by more than {self.min_delta:g} for {self.since} evaluations "
                f"(train.early_stop.patience={self.patience}); best {self.best:.4f} at step {self.best_step}")

    def on_train_start(self, trainer) -> None:
        if self.since >= self.patience and trainer.step < trainer.cfg.train.max_steps:  # resumed after a stop
            self._stop(trainer, again=True)

    def on_eval_end(self, trainer, metrics: dict[str, Any]) -> None:
        step, loss = metrics.get("step", trainer.step), metrics.get(self.metric)
        if loss is None or step <= self.last_step:
            return
        self.last_step = step
        s = self.sign
        if self.mark is None or s * loss < s * self.mark - self.min_delta:
            self.mark, self.since = loss, 0
        else:
            self.since += 1
        if self.best is None or s * loss < s * self.best:
            self.best, self.best_step = loss, step
            if self.restore_best:
                self._keep(trainer, step)
        if self.since >= self.patience and step < trainer.cfg.train.max_steps and trainer.stop_reason is None:
            self._stop(trainer)

    def _stop(self, trainer, again: bool = False) -> None:
        trainer.stop_reason = "early stop: " + self.reason()
        if self.log is not None:
            self.log(f"stopping early at step {trainer.step}{' (again, as before the resume)' if again else ''}: "
                     f"{self.reason()}")
        if not again:  # every sink records it (metrics.jsonl, TensorBoard, W&B, MLflow, Prometheus); the console
            best = {"best_val_loss": self.best} if self.metric == "val_loss" else {"metric": self.metric,
                                                                                   "best_value": self.best}
            trainer.notice("early_stop", step=trainer.step, reason=self.reason(),  # has the line above
                           best_step=self.best_step, **best)

    def _keep(self, trainer, step: int) -> None:
        from kiln.state import staging
        from kiln.state.parts import model_part

        self._stager = self._stager or staging.CpuStaging()
        self._stager, _ = staging.stage(self._stager, model_part(trainer).state_dict(),
                                        self.log or (lambda m: None))
        self.kept = step

    def restore(self, trainer, checkpointer) -> int | None:
        """After an early stop with restore_best: load the best evaluation's weights into the model (from host
        memory, else from the checkpoint of its step through `checkpointer`). Returns that step; None when the
        run did not stop early, the model has them already, or they are not kept anywhere."""
        if not (self.restore_best and (trainer.stop_reason or "").startswith("early stop")) \
                or self.best_step is None or self.best_step == trainer.step:
            return None
        from kiln.state.parts import model_part
        from kiln.state.staging import clone_tree

        if self.kept == self.best_step and self._stager is not None:
            model_part(trainer).load_state_dict(clone_tree(self._stager.buffers))
            return self.best_step
        saved = [p for p in checkpoints(checkpointer.run_dir) if step_of(p) == self.best_step]
        if not saved:
            return None
        checkpointer.load(trainer, saved[0], keys=("model",))
        return self.best_step

    def choose_weights(self, trainer, checkpointer) -> None:
        """After training, before model/ is written: after an early stop with restore_best, load the best
        evaluation's weights, and say (console and every sink: an `on_notice` "model_step") which step model/
        takes its weights from."""
        if not (self.restore_best and (trainer.stop_reason or "").startswith("early stop")):
            return
        best = self.restore(trainer, checkpointer)  # the final checkpoint keeps the last step's state
        if best is not None:
            what = "validation loss" if self.metric == "val_loss" else self.metric
            kept = f"the weights of step {best}, the best {what} ({self.best:.4f})"
        else:
            kept = f"the weights of the last step, {trainer.step}" + (
                f": those of the best, step {self.best_step}, were not kept (no checkpoint of it)"
                if self.best_step not in (None, trainer.step) else ", the best")
        trainer.notice("model_step", step=best if best is not None else trainer.step, best_step=self.best_step,
                       message=f"model/ takes {kept}; the final checkpoint keeps step {trainer.step} "
                               "(train.early_stop.restore_best)")
