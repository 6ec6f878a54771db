"""`eval:` benchmark tasks (lm-evaluation-harness) run on the model at the run's evaluations."""

from __future__ import annotations

from pydantic import Field

from kiln.config.base import Section


class EvalConfig(Section):
    tasks: list[str] = []
    """lm-evaluation-harness tasks run at the run's evaluations (train.eval_every, and the last), e.g.
    [hellaswag, arc_easy]; their scores (hellaswag/acc, ...) join val_loss in metrics.jsonl and every sink.
    Needs the lm-eval extra (pip install 'kiln[lm-eval]') and a validation split; empty: none. Tasks that fail
    at an evaluation (their data out of reach) are skipped there with a warning; training goes on."""
    include_path: list[str] = []
    """Directories of task YAML files: your own tasks, or a local copy of lm-eval's tasks whose data sets
    are on disk (offline)."""
    limit: int | None = Field(200, ge=1)
    """The budget: at most this many examples of each task at each evaluation (null: every example)."""
    num_fewshot: int | None = Field(None, ge=0)
    """Examples shown before each question (null: each task's own default)."""
    batch_size: int = Field(16, ge=1)
    """Requests scored per forward pass."""
    every: int = Field(1, ge=1)
    """Run the tasks at every N-th evaluation (and the last one), as they cost more than the loss."""
