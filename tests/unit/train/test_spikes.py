"""A change of data is not a divergence: a loss that rises and stays up while the model still fits what it learnt
is trained through; broken weights, a loss above the bound and a one-batch spike are rolled back."""

from __future__ import annotations

import torch

from kiln.config import RecoveryConfig
from kiln.events import Callback
from kiln.state.snapshot import MemorySnapshots
from kiln.train.rollback import Rollback
from kiln.train.spikes import SpikeDetector, loss_bound

from .healing import BAD_TOKEN, Notices, Samples, T, config, trainer


class Shifting(Samples):
    """Rows of a repeated pattern (easy: the loss falls fast) up to sample `at`, then random rows (hard)."""

    def __init__(self, rows: int, at: int):
        super().__init__(rows)
        self.at = at

    def __next__(self):
        lo = self.sample
        rows = [torch.arange(T + 1) % 7 if k < self.at else
                torch.randint(0, BAD_TOKEN, (T + 1,), generator=torch.Generator().manual_seed(k))
                for k in range(lo, lo + self.B)]
        self.sample += self.B
        x = torch.stack(rows)
        return x[:, :-1], x[:, 1:], None


class Breaks(Callback):
    """After step `at` (once), the weights break as a runaway update breaks them: the embeddings x30."""

    def __init__(self, at: int):
        self.at, self.done = at, False

    def on_step_end(self, trainer, metrics):
        if trainer.step == self.at and not self.done:
            self.done = True
            with torch.no_grad():
                trainer.model.embed_tokens.weight.mul_(30)


def run(tmp_path, loader, steps=16, extra=(), bound=None, log_every=1):
    cfg = config(tmp_path, steps=steps, recovery={"snapshot_every": 4, "spike_window": 5}, log_every=log_every)
    log = Notices()
    t = trainer(cfg, loader, [Rollback(cfg.recovery, MemorySnapshots(lambda m: None), bound=bound), log, *extra])
    return t, log


def test_a_change_to_harder_data_is_trained_through(tmp_path):
    t, log = run(tmp_path, Shifting(4, at=40))  # step 11 is the first of the hard rows
    t.train()
    assert t.step == 16 and not [n for n in log.notices if n[0] == "rollback"]
    [(_, info)] = [n for n in log.notices if n[0] == "data_shift"]
    assert info["step"] == 11 and info["loss"] > info["previous_mean"] + 1.5
    assert "still fits the batch of step 10" in info["message"]
    assert min(log.losses[s] for s in range(11, 17)) > max(log.losses[s] for s in range(6, 11))  # it did rise


def test_a_change_found_at_a_logging_step_waits_for_the_steps_after_it(tmp_path):
    t, log = run(tmp_path, Shifting(4, at=40), log_every=5, steps=20)  # the spike at 11, checked at 15
    t.train()
    assert [n[0] for n in log.notices] == ["data_shift"] and log.notices[0][1]["step"] == 11


def test_broken_weights_are_rolled_back_though_the_rise_persists(tmp_path):
    t, log = run(tmp_path, Samples(4), extra=[Breaks(10)])
    t.train()
    [(_, info)] = [n for n in log.notices if n[0] == "rollback"]
    assert info["bad_step"] == 11 and info["to_step"] == 8 and "divergence" in info["reason"]
    assert "the weights broke" in info["reason"] and t.step == 16
    assert max(log.losses[s] for s in range(9, 17)) < 6.0  # trained on from the good state


def test_a_loss_above_the_bound_is_bad_before_the_window_has_filled(tmp_path):
    # the weights break after step 1: step 2's loss is about 40, against a bound of 2 ln 256
    t, log = run(tmp_path, Samples(4), steps=4, bound=loss_bound(RecoveryConfig(), 256), extra=[Breaks(1)])
    t.train()
    [(_, info)] = [n for n in log.notices if n[0] == "rollback"]
    assert info["bad_step"] == 2 and info["to_step"] == 0 and "above recovery.max_loss=11.09" in info["reason"]


def test_the_bound_is_twice_a_uniform_guess_unless_set():
    assert abs(loss_bound(RecoveryConfig(), 4096) - 16.64) < 0.01
    assert loss_bound(RecoveryConfig(max_loss=30.0), 4096) == 30.0
    assert loss_bound(RecoveryConfig(), None) is None


def test_the_detector_state_round_trips_without_its_reference_batch():
    d = SpikeDetector(RecoveryConfig(spike_window=3))
    for step, loss in enumerate([3.0, 3.1, 2.9, 3.0]):
        d.add(step, loss)
    d.refer(3, 3.0, (torch.zeros(1, 2), torch.zeros(1, 2), None))
    again = SpikeDetector(RecoveryConfig(spike_window=3))
    again.load_state_dict(d.state_dict())
    assert list(again.window) == [(1, 3.1), (2, 2.9), (3, 3.0)] and again.reference is None
    assert again.spike(4.0) is not None and again.persists([3.9, 4.1]) and not again.persists([3.0, 3.05])


def test_a_rise_under_the_least_rise_is_no_spike_however_flat_the_window():
    """A model that knows its data by heart: losses of hundredths of a nat, a window flat to a thousandth."""
    flat = [0.010, 0.011, 0.009, 0.010]
    d, strict = SpikeDetector(RecoveryConfig(spike_window=4)), SpikeDetector(RecoveryConfig(spike_window=4,
                                                                                            spike_min_rise=0.0))
    for step, loss in enumerate(flat):
        d.add(step, loss)
        strict.add(step, loss)
    assert strict.spike(0.05) is not None  # 57 standard deviations
    assert d.spike(0.05) is None and not d.persists([0.05, 0.06])
    assert d.spike(0.5) is not None  # a rise of half a nat is still one
