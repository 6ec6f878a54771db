"""`recovery:` what a run does on its own when a step runs out of memory or goes bad."""

from __future__ import annotations

from pydantic import Field

from kiln.config.base import Section


class RecoveryConfig(Section):
    """What a run does on its own when a step runs out of memory or goes bad (kiln.train.oom, rollback)."""

    auto_batch_margin: float = Field(0.1, ge=0, lt=1)
    """With train.batch_size auto: the fraction of device memory left free (on the CPU: of available memory
    left unplanned) by the micro-batch chosen."""
    auto_batch_cache: bool = True
    """With train.batch_size auto: remember the micro-batch found (auto_batch.json in data.cache_dir, keyed by
    model, sequence length, precision, compile and checkpointing, device and world size) so a restart does not
    search again."""
    oom_retries: int = Field(3, ge=0)
    """Times one step may run out of device memory: each time the step's gradients are dropped, the micro-batch
    is halved (more accumulation, same samples in the same order) and the step runs again; one more stops the
    run with a ResourceError and an emergency checkpoint (0: the first one stops it). One process only."""
    rollback: bool = True
    """Roll back a bad step (non-finite loss or gradient norm, a loss above max_loss, a loss spike of one batch, a
    divergence): restore the newest good state (the in-memory snapshot, or a newer complete checkpoint), pass
    over the step's samples (recorded, so a resume passes over them too) and go on. Costs one copy of the state
    in host memory and a host read of the loss every step."""
    snapshot_every: int = Field(50, ge=1)
    """Steps between the in-memory snapshots a rollback restores, when checkpoint.snapshot_every is 0
    (that cadence wins when set); the first is taken at the start."""
    spike_zscore: float = Field(6.0, ge=0)
    """A step whose loss is this many standard deviations above the mean of the last spike_window good steps
    is a spike (0: spikes are not checked, only non-finite values)."""
    spike_min_rise: float = Field(0.1, ge=0)
    """The least rise of a loss above the window's mean (in nats) that is a spike, however many standard deviations
    it is: a model that has learnt its data by heart has a window so flat that a rise of hundredths of a nat, at
    the start of another pass over the data, scores far above spike_zscore."""
    spike_window: int = Field(50, ge=2)
    """Good steps the spike check compares against; no step is called a spike before there are this many. A spike
    whose rise persists over the next steps while the model still fits a batch it learnt before is a change of
    data, not a divergence: training goes on, and the window starts again (kiln.train.spikes)."""
    max_loss: float | None = Field(None, gt=0)
    """A step whose loss is above this is bad from the first step on (the spike check needs a full window first);
    null: twice the loss of a uniform guess over the vocabulary, 2 ln(vocab size)."""
    max_rollbacks: int = Field(3, ge=0)
    """Rollbacks allowed within rollback_window steps; one more bad step stops the run with a TrainingError
    (the last good state saved as an emergency checkpoint, the offending samples named)."""
    rollback_window: int = Field(1000, ge=1)
    """Steps over which max_rollbacks counts."""
    lr_factor: float = Field(1.0, gt=0, le=1)
    """Multiply the learning rate by this after each rollback (1: unchanged); kept across resumes."""
