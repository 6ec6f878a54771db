"""`checkpoint:` what is saved, when, and how long it is kept."""

from __future__ import annotations

from pydantic import Field

from kiln.config.base import Problem, Section


class CheckpointConfig(Section):
    save_final: bool = True
    """Save the trained model (safetensors + config) in the run directory at the end."""
    every: int = Field(100, ge=0)
    """Write a resumable checkpoint to <run_dir>/checkpoints/ every N steps (0: only at the end and on signals)."""
    keep_last: int = Field(3, ge=1)
    """Keep the newest N checkpoints in the run directory; older ones are deleted once a newer one is complete."""
    async_save: bool = True
    """Write checkpoints in the background: the loop only waits while the state is copied to CPU memory
    (a pinned CPU copy of this process's share of the state is kept for the whole run)."""
    snapshot_every: int = Field(0, ge=0)
    """Keep an in-memory copy of the whole state every N steps, for fast rollback (0: off; costs one state in RAM)."""
    archive_url: str | None = None
    """Archive location (a directory or any fsspec URL, e.g. s3://bucket/runs); null: no archive."""
    archive_every: int = Field(0, ge=0)
    """Copy every M-th checkpoint to archive_url, verified after the copy (0: none but the best)."""
    archive_best: bool = True
    """Also keep the checkpoint with the lowest validation loss in archive_url."""
    fsync: bool = True
    """Flush checkpoint files to disk before a checkpoint is marked complete (survives power loss)."""
    write_threads: int = Field(4, ge=1, le=256)
    """Threads (and files per process) that write a checkpoint; more threads, faster saves on fast disks."""
    on_signal: bool = True
    """On SIGTERM/SIGINT finish the step, write a checkpoint and exit 0; on a crash write an emergency one."""
    keep_best: bool = True
    """Keep the local checkpoint with the lowest validation loss even when keep_last would delete it (a
    checkpoint records the loss when an evaluation falls on its step: align train.eval_every with every)."""
    at_end: bool = True
    """Write a checkpoint when training ends; false: the newest periodic checkpoint stays the last, and running the
    command again repeats the steps after it (for a disk that holds one checkpoint of a large model only)."""

    def problems(self) -> list[Problem]:
        if not self.at_end and self.save_final:
            return [(("at_end", "save_final"), "checkpoint.at_end=false leaves no checkpoint to finish an interrupted "
                     "final model save from: set checkpoint.save_final=false too, or keep checkpoint.at_end")]
        return []
