"""Curricula: samples per source in each stage, blends, exact resume across a boundary, ranks, config."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.data.load.loader import PackedLoader
from kiln.data.load.mixture import Mixture
from kiln.data.load.schedule import Schedule, Stage, stages_in_samples
from kiln.errors import ConfigError

from ..conftest import make_stream

T = 8
BASES = (0, 1_000_000, 2_000_000)


@pytest.fixture
def streams(tmp_path):
    """Three datasets; token values tell them apart (base + position + 1)."""
    sizes = ([[60] * 40], [[30] * 10], [[25, 50, 25]])
    return [make_stream(tmp_path, f"ds-{i}", s, base=b)[0] for i, (s, b) in enumerate(zip(sizes, BASES))]


def source_of(tokens: np.ndarray) -> np.ndarray:
    return np.searchsorted(np.array(BASES[1:]), tokens[:, 0], side="right")


# a stage of dataset 0 alone; 3:1 of datasets 1 and 2, held from sample 96 to 224, then blended into 1:1:2 by
# sample 352; dataset 2 alone from 400
STAGES = [Stage(0, (1, 0, 0)), Stage(96, (0, 3, 1)), Stage(224, (0, 3, 1)), Stage(352, (1, 1, 2), blend=True),
          Stage(400, (0, 0, 1))]


def test_samples_per_source_in_each_stage(streams):
    """Read through the loader: each stage's samples come from its datasets in its proportions."""
    loader = PackedLoader(streams, T, 16, schedule=STAGES, seed=4, prefetch=0)
    src = np.concatenate([source_of(next(loader)[0].numpy()) for _ in range(30)])  # 480 samples
    first, second, ramp, third, last = src[:96], src[96:224], src[224:352], src[352:400], src[400:]
    assert np.bincount(first, minlength=3).tolist() == [96, 0, 0]
    counts = np.bincount(second, minlength=3)
    assert counts[0] == 0 and abs(counts[1] - 96) <= 2 and abs(counts[2] - 32) <= 2
    counts = np.bincount(third, minlength=3)
    assert abs(counts[0] - 12) <= 2 and abs(counts[1] - 12) <= 2 and abs(counts[2] - 24) <= 2
    assert np.bincount(last, minlength=3).tolist() == [0, 0, 80]
    # the blend moves from (0, .75, .25) to (.25, .25, .5): dataset 0 grows from nothing, dataset 1 shrinks
    early, late = np.bincount(ramp[:48], minlength=3), np.bincount(ramp[-48:], minlength=3)
    assert early[0] < late[0] and early[1] > late[1]
    expected = sum(Schedule(STAGES, 4).weights_at(g) for g in range(224, 352))
    np.testing.assert_allclose(np.bincount(ramp, minlength=3), expected, atol=3)
    taken = loader.state_dict()["taken"]
    assert [taken[f"ds-{i}"] for i in range(3)] == np.bincount(src, minlength=3).tolist()


def test_a_single_stage_is_the_fixed_mixture():
    np.testing.assert_array_equal(Schedule([Stage(0, (3, 1))], 7).sources(0, 500), Mixture([3, 1], 7).sources(0, 500))


def test_sources_are_a_function_of_the_index():
    s = Schedule(STAGES, 9)
    whole = s.sources(0, 500)
    pieces = np.concatenate([s.sources(a, b - a) for a, b in [(0, 90), (90, 101), (101, 300), (300, 500)]])
    np.testing.assert_array_equal(whole, pieces)
    assert not np.isin(whole[400:], [0, 1]).any()  # zero weights are never drawn, at either end of the list


def test_resume_across_a_stage_boundary(streams):
    """Stopped one batch before a boundary and resumed after it: the same batches as a run straight through."""
    kw = dict(schedule=STAGES, seed=2, prefetch=0)
    straight = [next(ld)[0].numpy() for ld in [PackedLoader(streams, T, 16, **kw)] for _ in range(20)]
    a = PackedLoader(streams, T, 16, **kw)
    got = [next(a)[0].numpy() for _ in range(5)]  # samples 0..79; the next batch crosses sample 96
    b = PackedLoader(streams, T, 16, **kw)
    b.load_state_dict(a.state_dict())
    got += [next(b)[0].numpy() for _ in range(15)]
    np.testing.assert_array_equal(np.concatenate(got), np.concatenate(straight))


def test_one_and_two_ranks_see_the_same_global_stream(streams):
    """A global batch of 16 on one rank, then resumed on two ranks of 8 each, across two boundaries."""
    kw = dict(schedule=STAGES, seed=5, prefetch=0)
    one = [next(ld)[0].numpy() for ld in [PackedLoader(streams, T, 16, **kw)] for _ in range(24)]
    first = PackedLoader(streams, T, 16, **kw)
    got = [next(first)[0].numpy() for _ in range(4)]
    two = [PackedLoader(streams, T, 8, rank=r, world=2, **kw) for r in range(2)]
    for ld in two:
        ld.load_state_dict(first.state_dict())
    got += [np.concatenate([next(ld)[0].numpy() for ld in two]) for _ in range(20)]
    np.testing.assert_array_equal(np.concatenate(got), np.concatenate(one))
    assert two[0].state_dict() == two[1].state_dict()


def test_steps_and_tokens_to_samples():
    from kiln.config.data import ScheduleStage

    stages = [ScheduleStage(at=0, weights=[1, 0]), ScheduleStage(at=10, weights=[0, 1], blend=True)]
    assert [s.start for s in stages_in_samples(stages, "steps", 32, 48)] == [0, 480]
    assert [s.start for s in stages_in_samples(stages, "tokens", 32, 48)] == [0, 1]  # 10 tokens: after row 1
    assert stages_in_samples(stages, "steps", 32, 48)[1] == Stage(480, (0.0, 1.0), True)


def test_bad_stages_are_config_errors():
    with pytest.raises(ConfigError, match="begin at 0"):
        Schedule([Stage(5, (1, 1))], 0)
    with pytest.raises(ConfigError, match="increasing"):
        Schedule([Stage(0, (1, 1)), Stage(0, (1, 2))], 0)
    with pytest.raises(ConfigError, match="positive"):
        Schedule([Stage(0, (0, 0))], 0)


MIX = "data.mixture=[{dataset: a}, {dataset: b}]"


@pytest.mark.parametrize("schedule, message", [
    ("{stages: [{at: 3, weights: [1, 1]}]}", "first stage must have at: 0"),
    ("{stages: [{at: 0, weights: [1, 1]}, {at: 0, weights: [1, 2]}]}", "increasing steps"),
    ("{stages: [{at: 0, weights: [1, 1], blend: true}]}", "cannot blend"),
    ("{stages: [{at: 0, weights: [0, 0]}]}", "all zero"),
    ("{stages: [{at: 0, weights: [1, 1, 1]}]}", "3 weights for the 2 entries"),
    ("{stages: [{at: 0, weights: [1, -1]}]}", "greater than or equal to 0"),
    ("{unit: epochs, stages: [{at: 0, weights: [1, 1]}]}", "steps"),
    ("{stages: []}", "at least 1"),
])
def test_config_errors(schedule, message):
    from kiln.config import load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, [MIX, f"data.schedule={schedule}"])


def test_config_needs_a_mixture_and_no_entry_weights():
    from kiln.config import load_config

    with pytest.raises(ConfigError, match="list at least two datasets"):
        load_config(None, ["data.schedule={stages: [{at: 0, weights: [1]}]}"])
    with pytest.raises(ConfigError, match="'weight' is unused"):
        load_config(None, ["data.mixture=[{dataset: a, weight: 2}, {dataset: b}]",
                           "data.schedule={stages: [{at: 0, weights: [1, 1]}]}"])
    ok = load_config(None, [MIX, "data.schedule={unit: tokens, stages: [{at: 0, weights: [1, 0]}, "
                                 "{at: 4096, weights: [1, 1], blend: true}]}"])
    assert ok.data.schedule.stages[1].blend and ok.data.schedule.unit == "tokens"


def test_schedule_from_the_run_config(tmp_path):
    """data.schedule through build_data: real prepared datasets, a stage at step 2, validation on the last mix."""
    import collections
    import pathlib

    import torch

    from kiln.config import load_config
    from kiln.data.build import build_data

    dirs = []
    for name, module in (("alpha", collections), ("beta", pathlib)):
        d = tmp_path / name
        d.mkdir()
        source = pathlib.Path(module.__file__).read_text().splitlines()[:400]
        lines = [ln.strip() for ln in source if len(ln.strip()) > 10]
        (d / "docs.txt").write_text("\n".join(f"{name} {i}: {ln}" for i, ln in enumerate(lines)))
        dirs.append(d)
    cfg = load_config(None, [f"data.mixture=[{{sources: [{dirs[0]}]}}, {{sources: [{dirs[1]}]}}]",
                             "data.schedule={stages: [{at: 0, weights: [1, 0]}, {at: 2, weights: [0, 1]}]}",
                             "data.text_unit=line", "data.vocab_size=300", f"data.cache_dir={tmp_path / 'cache'}",
                             "data.workers=1", "data.val_fraction=0.2", "train.seq_len=16", "train.batch_size=8"])
    data = build_data(cfg, torch.device("cpu"), rank=0, world=1)
    a, b = (f"{ds.id}/train" for ds in data.datasets)
    for _ in range(2):
        next(data.train)
    assert data.train.state_dict()["taken"] == {a: 16, b: 0}
    for _ in range(3):
        next(data.train)
    assert data.train.state_dict()["taken"] == {a: 16, b: 24}
    assert data.val.rows.names == [f"{data.datasets[1].id}/val"]  # the last stage weighs the first entry 0
    assert "schedule: from step 0: [1.0, 0.0]; from step 2: [0.0, 1.0]" in data.summary
    data.train.close()


def test_the_weights_in_force_join_the_logged_metrics(streams):
    from kiln.data.load.schedule import ScheduleLog

    loader = PackedLoader(streams, T, 16, schedule=STAGES, seed=0, prefetch=0)
    log = ScheduleLog(loader)
    seen = []
    for _ in range(30):
        next(loader)
        metrics = {"loss": 1.0}
        log.on_step_end(None, metrics)
        seen.append((metrics["mix/0"], metrics["mix/1"], metrics["mix/2"]))
    assert seen[0] == (1.0, 0.0, 0.0) and seen[10] == (0.0, 0.75, 0.25) and seen[-1] == (0.0, 0.0, 1.0)
    ramp = [s[0] for s in seen[14:22]]  # samples 224..351: dataset 0 rises from 0 to 0.25
    assert ramp == sorted(ramp) and 0 < ramp[1] < ramp[-1] < 0.25
    log.on_step_end(None, None)  # a step that logs nothing
    plain = {"loss": 1.0}
    ScheduleLog(PackedLoader(streams, T, 16, weights=(1, 1, 1), prefetch=0)).on_step_end(None, plain)
    assert plain == {"loss": 1.0}  # a fixed mixture adds nothing
