"""Out-of-memory recovery on the CPU: an injected torch.OutOfMemoryError halves the micro-batch, the step runs
again on the same rows, and the run goes on as if nothing happened; too many stop it with a checkpoint."""

from __future__ import annotations

import pytest
import torch

from kiln.errors import ResourceError
from kiln.state.checkpointer import Checkpointer
from kiln.state.preempt import SignalGuard, train_guarded
from kiln.state.verify import read_meta

from .healing import Notices, Samples, config, trainer, weights


class MemoryPressure:
    """A forward pre-hook on the model: records the rows each forward pass trains on, and from step `from_step`
    on (another process took most of the memory) raises the allocator's error for more than `cap` rows."""

    def __init__(self, t, cap: int | None = None, from_step: int = 0):
        self.t, self.cap, self.from_step, self.rows, self.failures = t, cap, from_step, [], 0
        t.model.register_forward_pre_hook(self)

    def __call__(self, module, args):
        tokens = args[0]
        if self.cap is not None and self.t.step + 1 >= self.from_step and tokens.shape[0] > self.cap:
            self.failures += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total)")
        self.rows.append(tokens.clone())


def test_oom_halves_the_micro_batch_and_keeps_samples_order_and_loss_curve(tmp_path):
    cfg = config(tmp_path / "a", grad_accum=2)  # 8 rows a step, micro-batches of 4
    calm, calm_log = trainer(cfg, Samples(4)), Notices()
    calm.events.callbacks.append(calm_log)
    seen = MemoryPressure(calm)
    calm.train()

    squeezed, log = trainer(config(tmp_path / "b", grad_accum=2), Samples(4)), Notices()
    squeezed.events.callbacks.append(log)
    pressure = MemoryPressure(squeezed, cap=1, from_step=5)  # from step 5 on only one row fits
    squeezed.train()

    assert squeezed.step == calm.step == 12
    assert pressure.failures == 2  # 4 rows failed, then 2 rows; 1 row fits
    assert squeezed.micro == 1 and squeezed.rows == 8 and squeezed.tokens_seen == calm.tokens_seen
    ooms = [info for kind, info in log.notices if kind == "oom"]
    assert [(o["step"], o["from_micro_batch"], o["micro_batch"], o["accumulation"], o["global_batch"])
            for o in ooms] == [(5, 4, 2, 4, 8), (5, 2, 1, 8, 8)]
    # the same samples in the same order: none lost, none repeated
    assert torch.equal(torch.cat(pressure.rows), torch.cat(seen.rows))
    assert len(torch.cat(pressure.rows)) == 12 * 8
    # the loss curve goes on: equal up to the order of floating-point sums
    assert list(log.losses) == list(calm_log.losses) == list(range(1, 13))
    assert log.losses[4] == calm_log.losses[4]  # before the pressure, bit for bit
    for step in range(5, 13):
        assert log.losses[step] == pytest.approx(calm_log.losses[step], rel=1e-4)
    a, b = weights(calm), weights(squeezed)
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)


def test_uneven_micro_batches_give_the_gradient_of_the_whole_step(tmp_path):
    cfg = config(tmp_path, steps=1, batch_size=6)
    grads, losses = [], []
    for micro in (6, 4, 1):  # one pass; 4 + 2 rows; six single rows, each weighted by its share
        t = trainer(cfg, Samples(6), micro=micro)
        losses.append(t._accumulate(t._step_batch()).item())
        grads.append([p.grad.clone() for p in t.model.parameters()])
    assert losses[1] == pytest.approx(losses[0], rel=1e-6) and losses[2] == pytest.approx(losses[0], rel=1e-6)
    for other in grads[1:]:
        assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(grads[0], other))


@pytest.mark.parametrize("retries", [0, 2])
def test_too_many_ooms_stop_with_resource_error_and_emergency_checkpoint(tmp_path, retries):
    cfg = config(tmp_path / "run", recovery={"oom_retries": retries, "rollback": False})
    t = trainer(cfg, Samples(4))
    pressure = MemoryPressure(t, cap=0, from_step=4)  # nothing fits from step 4 on
    ck = Checkpointer(tmp_path / "run", cfg, {}, lambda m: None)
    logged: list[str] = []
    with pytest.raises(ResourceError) as err:
        train_guarded(t, ck, SignalGuard(logged.append), tmp_path / "run", logged.append)
    msg = str(err.value)
    sizes = [4, 2, 1][:retries + 1]
    assert pressure.failures == len(sizes)
    assert "out of device memory in step 4 on cpu" in msg and f"{len(sizes)} time(s)" in msg
    assert f"micro-batches of {', '.join(map(str, sizes))} sequences of 16 tokens" in msg
    assert "global batch is 4 sequences" in msg and "train.batch_size" in msg
    # the emergency checkpoint holds step 3 with the loader at the start of step 4: nothing is lost on resume
    assert any("emergency checkpoint of step 3" in line for line in logged), logged
    meta = read_meta(tmp_path / "run" / "checkpoints" / "step_00000003")
    assert meta["reason"] == "emergency" and meta["step"] == 3
    resumed = trainer(cfg, Samples(4))
    Checkpointer(tmp_path / "run", cfg, {}, lambda m: None).load(resumed, tmp_path / "run" / "checkpoints" /
                                                                  "step_00000003")
    assert resumed.train_loader.sample == 3 * 4 and resumed.step == 3


def test_an_offload_that_moved_its_sums_to_the_host_runs_the_step_again_at_the_same_micro_batch():
    """An offloaded run at a micro-batch of one row cannot halve it; when the offload has moved the gradient sums it
    had on the device to the host (`relieved`), the step runs again as it was, once, with a notice."""
    from types import SimpleNamespace

    from kiln.train.oom import OomRetry

    notices = []

    class Offload:
        relieved = False

    class Optimizer:
        def zero_grad(self, set_to_none=True):
            t.offload.relieved = not attempts[1:]  # the first failure moved the sums; a later one has none to move

    attempts = []

    def work():
        attempts.append(t.micro)
        if len(attempts) < 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return "done"

    t = SimpleNamespace(micro=1, rows=8, step=4, offload=Offload(), optimizer=Optimizer(), model=torch.nn.Linear(2, 2),
                        device=torch.device("cpu"), mesh=SimpleNamespace(distributed=False, world=1),
                        notice=lambda kind, **info: notices.append((kind, info)))
    assert OomRetry(0).run(t, work) == "done"  # no retries left to halve with, and none needed
    assert attempts == [1, 1] and t.micro == 1 and not t.offload.relieved
    assert [(k, i["step"], i["micro_batch"]) for k, i in notices] == [("oom", 5, 1)]
    assert "summed in host memory" in notices[0][1]["message"]
