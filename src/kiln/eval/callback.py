"""`eval.tasks`: lm-evaluation-harness tasks at a training run's evaluations, a callback of the loop.

At every `eval.every`-th evaluation, and at the last, each task runs on the model being trained (at
most `eval.limit` examples each) and its scores (hellaswag/acc, ...) join the evaluation's metrics,
before the sinks see them: metrics.jsonl, the console, TensorBoard, W&B, MLflow. Every process runs
the same requests, so a model sharded over them (FSDP) takes part whole; rank 0's sinks write.

A run never dies for an evaluation: tasks that fail (the Hub out of reach, a task's data file gone or
damaged) are skipped at that evaluation, with a warning the first time (what failed, what to do) and a
"warning" notice in metrics.jsonl each time, and training goes on. Each task runs on its own, so one that
fails costs the others nothing. Under several processes they agree on it (kiln.eval.agree): a task that
fails on some processes only is left by all of them together and skipped on all, the rank that failed named,
so none waits in a forward the others left (a hang); every process gets rank 0's scores (lm-eval returns
them on the process of LOCAL_RANK 0 alone), so an early stop on one (train.early_stop.metric) stops them all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kiln.config import EvalConfig
from kiln.errors import ConfigError, KilnError
from kiln.events import Callback


def require_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ConfigError("eval.tasks needs lm-evaluation-harness: pip install 'kiln[lm-eval]' (or lm-eval)") from None


class TasksAtEval(Callback):
    """Runs `cfg.tasks` on the trainer's model at its evaluations and adds the scores to their metrics."""

    def __init__(self, cfg: EvalConfig, tokenizer, log: Callable[[str], None] | None = None):
        require_lm_eval()
        from kiln.eval.tasks import check_tasks, manager_for

        self.cfg, self.tokenizer, self.log = cfg, tokenizer, log
        self.manager = manager_for(cfg.tasks, cfg.include_path)
        check_tasks(self.manager, cfg.tasks)  # before training starts: a typo costs nothing
        self.evals, self.failures = 0, 0

    def on_train_start(self, trainer) -> None:
        if trainer.val_loader is None and self.log is not None:
            self.log(f"eval.tasks ({', '.join(self.cfg.tasks)}) run at evaluations, and this run has no validation "
                     "split to evaluate: raise data.val_fraction to run them")

    def on_eval_end(self, trainer, metrics: dict[str, Any]) -> None:
        self.evals += 1
        last = trainer.step >= trainer.cfg.train.max_steps or trainer.stop_reason is not None
        if self.evals % self.cfg.every and not last:
            return
        from kiln.eval.agree import Agreement
        from kiln.eval.harness import KilnLM
        from kiln.state.stop_tokens import run_stops

        agreement = Agreement(trainer.device)
        lm = KilnLM(trainer.model, self.tokenizer, batch_size=self.cfg.batch_size,
                    max_length=trainer.cfg.train.seq_len, autocast=trainer.autocast,
                    stop_ids=(stops := run_stops(trainer.cfg, self.tokenizer)).ids, stop_strings=stops.strings,
                    before_forward=agreement.check)
        was_training = trainer.model.training
        trainer.model.eval()
        scores: dict[str, float] = {}
        failed: dict[str, str] = {}
        try:
            with trainer.meter.paused():  # not counted in training tokens/s
                for task in self.cfg.tasks:  # one at a time: a task that fails costs the others nothing
                    scores.update(self._task(lm, task, agreement, failed))
        finally:
            trainer.model.train(was_training)
        if failed:
            self._skipped(trainer, failed)
        metrics.update(scores)
        if self.log is not None and scores:
            self.log(f"tasks step {metrics.get('step', trainer.step)}: "
                     + "  ".join(f"{k} {v:.4f}" for k, v in scores.items()))

    def _task(self, lm, task: str, agreement, failed: dict[str, str]) -> dict[str, float]:
        """The scores of `task`, or none with what went wrong in `failed`, on every process alike: one that fails
        (the data of a task, network or files, lm-eval's own) tells the others at their next forward or at the end,
        so all leave it together (kiln.eval.agree) and the run goes on without it."""
        from kiln.eval.agree import FailedElsewhere
        from kiln.eval.tasks import run_tasks

        error = None
        try:
            scores = run_tasks(lm, [task], limit=self.cfg.limit, num_fewshot=self.cfg.num_fewshot,
                               manager=self.manager)["scores"]
            ok = agreement.all_ok(True)
        except FailedElsewhere:
            ok = False  # agreed at that forward
        except Exception as e:
            error = str(e) if isinstance(e, KilnError) else f"{type(e).__name__}: {e}"
            ok = agreement.all_ok(False)
        if ok:
            return agreement.from_rank0(scores)
        said = agreement.errors(error)
        ranks = [r for r, e in enumerate(said) if e is not None]
        where = f" (on rank {', '.join(map(str, ranks))} of {len(said)})" if len(ranks) < len(said) else ""
        failed[task] = f"{task}: {said[ranks[0]] if ranks else 'failed'}{where}"
        return {}

    def _skipped(self, trainer, failed: dict[str, str]) -> None:
        """Say (the first time) and record (each time) that this evaluation's tasks `failed` (task: what went
        wrong)."""
        self.failures += 1
        what = "; ".join(failed.values())
        message = (f"eval.tasks {', '.join(failed)} failed at step {trainer.step} and were skipped; "
                   f"training goes on. {what}. Check that their data can be read (the Hugging Face Hub reachable, "
                   "or the files of eval.include_path's tasks there), or score a checkpoint after the run with "
                   f"kiln eval RUN_DIR --tasks {','.join(failed)}")
        if self.failures == 1 and self.log is not None:
            self.log(f"warning: {message} (a later failure is recorded in metrics.jsonl, not said again)")
        trainer.events.emit("on_notice", trainer, "warning", {"step": trainer.step, "condition": "eval_tasks",
                                                              "message": message, "failures": self.failures,
                                                              "tasks": list(failed)})
