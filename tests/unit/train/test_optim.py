import pytest
import torch

from kiln.config import ModelConfig, OptimConfig, TrainConfig
from kiln.model import Transformer
from kiln.train.optim import build_optimizer, build_scheduler, lr_factor, param_groups


def cfg(**kw) -> TrainConfig:
    base = dict(max_steps=100, warmup_steps=10, min_lr_ratio=0.1)
    return TrainConfig(**{**base, **kw})


def test_warmup_is_linear_from_near_zero():
    c = cfg()
    assert lr_factor(0, c) == pytest.approx(0.1)
    assert lr_factor(4, c) == pytest.approx(0.5)
    assert lr_factor(9, c) == pytest.approx(1.0)


def test_cosine_decays_monotonically_to_min():
    c = cfg(schedule="cosine")
    values = [lr_factor(s, c) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert values[-1] == pytest.approx(0.1)
    assert lr_factor(55, c) == pytest.approx(0.1 + 0.9 * 0.5, abs=0.03)


def test_wsd_is_stable_then_decays_linearly():
    c = cfg(schedule="wsd", decay_fraction=0.2)
    assert all(lr_factor(s, c) == 1.0 for s in range(10, 80))
    assert lr_factor(89, c) == pytest.approx(1 - 0.9 * 0.5)
    assert lr_factor(99, c) == pytest.approx(0.1)


def test_constant_schedule():
    c = cfg(schedule="constant")
    assert lr_factor(50, c) == lr_factor(99, c) == 1.0


def test_scheduler_drives_optimizer_lr():
    m = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(m.parameters(), lr=1.0)
    sched = build_scheduler(opt, cfg())
    seen = []
    for _ in range(12):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[0] == pytest.approx(0.1) and seen[9] == pytest.approx(1.0) and seen[11] < 1.0


def test_no_weight_decay_on_norms_and_embeddings():
    m = Transformer(ModelConfig(size="tiny", vocab_size=50, tie_embeddings=False))
    decay, no_decay = param_groups(m, 0.1)
    names = {id(p): n for n, p in m.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    plain = {names[id(p)] for p in no_decay["params"]}
    assert "embed_tokens.weight" in plain and "norm.weight" in plain
    assert "layers.0.input_layernorm.weight" in plain
    assert "lm_head.weight" in decayed and "layers.1.mlp.down_proj.weight" in decayed
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert len(decayed) + len(plain) == len(list(m.parameters()))


def test_tied_weights_counted_once():
    m = Transformer(ModelConfig(size="tiny", vocab_size=50))
    groups = param_groups(m, 0.1)
    assert sum(len(g["params"]) for g in groups) == len(list(m.parameters()))
    opt = build_optimizer(m, OptimConfig(), 1e-3, torch.device("cpu"))
    assert opt.defaults["fused"] in (False, None)


def test_a_warmup_as_long_as_the_run_is_said():
    """train.warmup_steps >= train.max_steps is valid but cannot be meant: the learning rate never reaches train.lr
    and never decays, and the run said nothing."""
    from kiln.train.optim import schedule_warning

    assert schedule_warning(cfg(max_steps=100, warmup_steps=10)) is None
    assert schedule_warning(cfg(max_steps=6, warmup_steps=50)) == (
        "train.warmup_steps=50 is not shorter than train.max_steps=6: the learning rate only rises, to 12% of "
        "train.lr at the last step, and never decays; lower train.warmup_steps")
    assert "to 100% of train.lr" in schedule_warning(cfg(max_steps=8, warmup_steps=8))


def test_each_logged_step_shows_the_learning_rate_it_trained_at(tmp_path):
    """metrics.jsonl's lr at step N is the rate step N's update used (it showed step N + 1's: the last step logged
    a rate never used)."""
    import json
    import sysconfig
    from pathlib import Path

    from rich.console import Console

    from kiln.config import load_config
    from kiln.train.optim import lr_factor
    from kiln.train.run import run

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text((stdlib / "textwrap.py").read_text() * 3)
    cfg = load_config(None, ["model.size=tiny", "train.seq_len=32", "train.max_steps=4", "train.warmup_steps=2",
                             "train.batch_size=2", "train.eval_every=0", "train.sample_tokens=0", "train.device=cpu",
                             "train.lr=0.01", "checkpoint.every=0", "checkpoint.save_final=false", "logging.every=1",
                             "logging.console=false", "logging.plots=false", f"data.sources=[{tmp_path / 'c'}]",
                             "data.vocab_size=300", f"data.cache_dir={tmp_path / 'cache'}",
                             f"train.run_dir={tmp_path / 'run'}"])
    run(cfg, console=Console(quiet=True))
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["lr"] for r in recs if r["event"] == "train"}
    assert lrs == pytest.approx({s: 0.01 * lr_factor(s - 1, cfg.train) for s in range(1, 5)})
