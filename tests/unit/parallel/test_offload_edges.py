"""kiln.parallel.offload at its edges: what else touches the training state while a step's AdamW still runs in its
thread (a rollback's restore, a signal, a failure in the thread), on the CPU with the tiny model."""

from __future__ import annotations

import pytest
import torch

from kiln.model.llama import Transformer
from kiln.parallel import offload
from kiln.state.snapshot import MemorySnapshots
from kiln.train.rollback import Rollback
from kiln.train.trainer import Trainer

from ..train.healing import Notices, Numerics, Samples, config


def offloaded(tmp_path, name: str, poison=(), skip=None, rollback: bool = True, steps: int = 8):
    """A Trainer of the tiny model with train.offload=optimizer (2 micro-batches of 2 rows a step), fed rows that are
    a function of their sample index; `poison`ed samples make the loss NaN (kiln.train.rollback's tests' faults)."""
    cfg = config(tmp_path / name, steps=steps, recovery={"snapshot_every": 4, "spike_window": 5},
                 offload="optimizer", batch_size=2, grad_accum=2)
    log = Notices()
    torch.manual_seed(0)
    model = offload.place_model(Transformer(cfg.model), torch.device("cpu"), torch.float32)
    callbacks = [Rollback(cfg.recovery, MemorySnapshots(lambda m: None)), log] if rollback else [log]
    t = Trainer(cfg, model, Samples(2, poison), None, torch.device("cpu"), callbacks)
    Numerics(t.model)
    if skip is not None:
        t.skips.add(*skip)
    return t, log


@pytest.mark.parametrize("bad", [6, 1])
def test_a_rollback_restores_the_snapshot_after_the_bad_steps_adamw_not_under_it(tmp_path, bad):
    """A bad step is found and undone while its AdamW still runs in the offload's thread: the snapshot's weights and
    moments were loaded under the thread, which then wrote the bad step's NaN over them, and every step after the
    rollback went bad again. Restored after the thread, the run ends with the weights of a run that never saw the
    bad samples (step `bad`: samples 4 (bad - 1) .. 4 bad - 1)."""
    first = 4 * (bad - 1)
    t, log = offloaded(tmp_path, "healed", poison=[first + 2])
    t.train()
    t.offload.close()
    assert [(i["bad_step"], i["to_step"]) for k, i in log.notices if k == "rollback"] == [(bad, 4 if bad > 4 else 0)]
    clean, _ = offloaded(tmp_path, "clean", skip=(first, first + 4, bad), rollback=False)
    clean.train()
    clean.offload.close()
    assert all(torch.equal(a, b) for a, b in zip(t.offload.masters, clean.offload.masters))
    assert all(torch.equal(a, b) for a, b in zip(t.model.parameters(), clean.model.parameters()))


@pytest.mark.parametrize("error", [torch.OutOfMemoryError, RuntimeError])
def test_adamw_failing_in_its_thread_stops_the_run_with_a_message_not_a_retry_of_the_next_step(tmp_path, monkeypatch,
                                                                                             error):
    """Step 3's AdamW raises in its thread: the error came out of step 4's forward pass as it was, and an
    out-of-memory one was taken for the device's (kiln.train.oom), which ran step 4 again on half-stepped weights and
    trained on without a word. It stops the run, saying what failed and that the state is half updated."""
    from kiln.errors import ResourceError, TrainingError

    calls, step = [], offload.HostAdamW._fused_slices

    def fails_once(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise error("not enough memory (injected)")
        return step(self, *a, **k)

    monkeypatch.setattr(offload.HostAdamW, "_fused_slices", fails_once)
    t, log = offloaded(tmp_path, "fails", rollback=False, steps=6)
    with pytest.raises(ResourceError if error is torch.OutOfMemoryError else TrainingError,
                       match=r"offloaded optimizer step .*(ran out of host memory|failed): .*injected.* part-way"):
        t.train()
    t.offload.close()
    assert t.step == 3 and not t.consistent and not [k for k, _ in log.notices if k == "oom"]


def test_offload_with_float8_layers_is_a_config_error_naming_both_fields():
    from kiln.config import load_config
    from kiln.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config("cpt-8b-24gb", ["model.init_from=null", "model.size=tiny", "train.fp8.enabled=true"])
    assert "train.offload" in str(e.value) and "train.fp8.enabled=false" in str(e.value)


def test_a_checkpoint_read_while_the_steps_adamw_runs_holds_that_step_whole(tmp_path, monkeypatch):
    """A save (a signal's emergency checkpoint, the periodic one) reads the offload's parts at a step's end, while
    that step's AdamW still runs in its thread: the weights and moments it copies are the finished step's, not a
    mix of stepped and unstepped slices."""
    import time

    from kiln.events import Callback

    inner = offload.HostAdamW.step_only

    def slow(self, *a, **k):  # keeps the thread in flight while the save reads
        time.sleep(0.02)
        return inner(self, *a, **k)

    monkeypatch.setattr(offload.HostAdamW, "step_only", slow)
    seen = {}

    class Save(Callback):
        def on_step_end(self, trainer, metrics):
            if trainer.step != 2:
                return
            o = trainer.offload
            seen["in_flight"] = o._thread is not None
            parts = o.parts()
            model = {k: v.clone() for k, v in parts["model"].state_dict().items()}
            moments = {n: {k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
                       for n, s in parts["optim"].state_dict()["state"].items()}
            o.settle()  # the step as it ends
            seen["weights"] = all(torch.equal(model[n], m) for n, m in zip(o.names, o.masters))
            state = o.optimizer.state
            seen["moments"] = all(torch.equal(moments[n][k], state[m][k])
                                  for n, m in zip(o.names, o.masters) for k in ("exp_avg", "exp_avg_sq", "step"))

    t, _ = offloaded(tmp_path, "saved", rollback=False, steps=3)
    t.events.callbacks.append(Save())
    t.train()
    t.offload.close()
    assert seen == {"in_flight": True, "weights": True, "moments": True}
