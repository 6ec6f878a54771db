"""TensorBoard sink: what it writes, read back with TensorBoard's own event reader."""

from __future__ import annotations

import pytest

from kiln.monitor.sinks.tensorboard import TensorBoardSink

pytest.importorskip("tensorboard")


def read(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    acc.Reload()
    return acc


def scalars(acc, tag):
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def text(acc, tag):
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(f"{tag}/text_summary")]


def test_scalars_of_every_metric_the_config_and_the_sample(tmp_path, drive, config):
    cfg = config("logging.tensorboard=true", "train.lr=0.004")
    drive(TensorBoardSink(cfg, tmp_path), cfg, range(1, 5), sample="def hello():")
    acc = read(tmp_path)
    assert scalars(acc, "train/loss") == [(s, pytest.approx(10.0 / s)) for s in range(1, 5)]
    assert [s for s, _ in scalars(acc, "train/gpu0.util%")] == [1, 2, 3, 4]  # any metric that arrives
    assert scalars(acc, "eval/val_loss") == [(0, 5.0), (4, 4.0)]
    [(step, config_text)] = text(acc, "config")
    assert step == 0 and "lr: 0.004" in config_text and "tensorboard: true" in config_text
    assert text(acc, "sample") == [(4, "    def hello():")]


def test_a_resume_replaces_the_steps_it_replays(tmp_path, drive, config):
    cfg = config("logging.tensorboard=true")
    drive(TensorBoardSink(cfg, tmp_path), cfg, range(1, 7), status="stopped")  # stopped at 6, checkpoint at 4
    drive(TensorBoardSink(cfg, tmp_path), cfg, range(5, 9), start=4)
    steps = [s for s, _ in scalars(read(tmp_path), "train/loss")]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8]  # steps 5 and 6 once, as the resumed run logged them


def rollback_and_events(sink, cfg, drive):
    """Steps 1-6 logged with a warning at 3; step 6 goes bad and rolls back to 4; steps 5-8 trained (again);
    an early stop at 8."""
    trainer = drive(sink, cfg, range(1, 7), status=None)
    emit = trainer.events.emit
    emit("on_notice", trainer, "warning", {"step": 3, "condition": "data_wait", "message": "data waits 40%"})
    trainer.step = 4
    emit("on_notice", trainer, "rollback", {"bad_step": 6, "to_step": 4, "reason": "loss spike",
                                             "message": "step 6 went bad (loss spike): rolled back to step 4"})
    for s in range(5, 9):
        trainer.step = s
        emit("on_step_end", trainer, {"step": s, "loss": 1.0 / s})
    emit("on_notice", trainer, "early_stop", {"step": 8, "reason": "no improvement", "best_step": 4})
    emit("on_run_end", trainer, "finished")


def test_events_are_text_and_a_rollback_shows_the_steps_trained_again_once(tmp_path, drive, config):
    cfg = config("logging.tensorboard=true")
    rollback_and_events(TensorBoardSink(cfg, tmp_path), cfg, drive)
    acc = read(tmp_path)
    losses = scalars(acc, "train/loss")
    assert [s for s, _ in losses] == [1, 2, 3, 4, 5, 6, 7, 8]  # 5 and 6 once: the second tries
    assert losses[4:6] == [(5, pytest.approx(1 / 5)), (6, pytest.approx(1 / 6))]
    assert text(acc, "events/warning") == [(3, "data waits 40%")]
    assert text(acc, "events/rollback") == [(4, "step 6 went bad (loss spike): rolled back to step 4")]
    assert text(acc, "events/early_stop") == [(8, "early stop: reason=no improvement, best_step=4")]


def test_the_hparams_dashboard_gets_the_config_and_the_final_metrics(tmp_path, drive, config):
    from tensorboard.plugins.hparams import plugin_data_pb2

    cfg = config("logging.tensorboard=true", "train.lr=0.004", "model.size=tiny")
    drive(TensorBoardSink(cfg, tmp_path), cfg, range(1, 5))
    content = read(tmp_path).PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hp = start.session_start_info.hparams
    assert hp["train.lr"].number_value == 0.004 and hp["model.size"].string_value == "tiny"
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert {m.name.tag for m in experiment.metric_infos} == {"train/loss", "eval/val_loss", "eval/val_ppl"}
    assert scalars(read(tmp_path), "eval/val_loss")[-1] == (4, 4.0)  # the value the dashboard shows beside them


def test_weight_and_gradient_norm_histograms_every_n_steps_of_a_real_trainer(tmp_path):
    """Opt-in (logging.histograms_every): the gradients are freed after each step, so their norms are read by
    an optimizer hook before the update; the weights after it."""
    import torch

    from kiln.config import RunConfig
    from kiln.model.llama import Transformer
    from kiln.train.trainer import Trainer

    class Batches:  # resumable like the real loader: batches a pure function of the position
        i = 0

        def __iter__(self):
            return self

        def __next__(self):
            x = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(self.i))
            self.i += 1
            return x[:, :-1], x[:, 1:], None

        def state_dict(self):
            return {"sample": self.i * 2}

        def load_state_dict(self, state):
            self.i = state["sample"] // 2

    cfg = RunConfig.model_validate({
        "model": {"size": "tiny", "vocab_size": 64}, "logging": {"tensorboard": True, "histograms_every": 2,
                                                                  "every": 1},
        "train": {"seq_len": 8, "batch_size": 2, "max_steps": 5, "warmup_steps": 1, "device": "cpu",
                  "eval_every": 0, "run_dir": str(tmp_path)}})
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    sink = TensorBoardSink(cfg, tmp_path)
    trainer = Trainer(cfg, model, Batches(), None, torch.device("cpu"), [sink])
    trainer.train()
    trainer.events.emit("on_run_end", trainer, "finished")
    acc = read(tmp_path)
    tags = acc.Tags()["histograms"]
    name, weight = next(iter(model.named_parameters()))
    assert f"weights/{name}" in tags and "grad_norms" in tags
    assert [e.step for e in acc.Histograms("grad_norms")] == [2, 4]
    drawn = acc.Histograms(f"weights/{name}")
    assert [e.step for e in drawn] == [2, 4] and all(e.histogram_value.num == weight.numel() for e in drawn)
    assert drawn[0].histogram_value.sum != drawn[1].histogram_value.sum  # the weights of each step, as trained
    norms = acc.Histograms("grad_norms")[0].histogram_value
    assert norms.num == len(list(model.parameters())) and norms.max > 0
