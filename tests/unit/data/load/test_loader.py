"""PackedLoader: packed rows, document ids, exact resume, rank sharding, elastic resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.data.format.shards import write_shard
from kiln.data.load.loader import PackedLoader
from kiln.errors import ConfigError, DataError

from ..conftest import make_stream

T, B = 16, 4


def take(loader, n):
    return [next(loader) for _ in range(n)]


def positions(batch):
    """Stream positions (0-based) of the inputs and of the targets of each row."""
    tokens, targets, _ = batch
    return tokens.numpy() - 1, targets.numpy() - 1


def same(a, b):
    return all(torch.equal(x, y) if x is not None else y is None for p, q in zip(a, b) for x, y in zip(p, q)) \
        and len(a) == len(b)


def test_rows_are_windows_with_document_ids(stream):
    ts, ends = stream
    L = len(ts)
    loader = PackedLoader(ts, T, B, seed=3, prefetch=0)
    for batch in take(loader, 10):
        x, y = positions(batch)
        assert batch[0].dtype == torch.int64 and batch[2].dtype == torch.int32 and batch[2].shape == (B, T)
        np.testing.assert_array_equal((x + 1) % L, y)  # targets are the inputs shifted by one
        np.testing.assert_array_equal(np.diff(x, axis=1) % L, 1)  # each row is contiguous (it may wrap)
        # a new document starts exactly where the previous position ended one
        starts = np.isin(x[:, 1:], np.append(ends % L, 0))
        np.testing.assert_array_equal(np.diff(batch[2].numpy(), axis=1), starts)
        assert (batch[2][:, 0] == 0).all()


def test_document_ids_of_a_whole_epoch_in_order(stream):
    """Every row of an epoch in stream order, so the rows that cross a shard boundary (where a document
    starts: its ids used to stay 0) are all checked."""
    ts, ends = stream
    L = len(ts)
    loader = PackedLoader(ts, T, B, shuffle=False, prefetch=0)
    for batch in take(loader, (L - 1) // T // B):
        x, _ = positions(batch)
        starts = np.isin(x[:, 1:], np.append(ends % L, 0))
        np.testing.assert_array_equal(np.diff(batch[2].numpy(), axis=1), starts)
        assert (batch[2][:, 0] == 0).all() and batch[2].dtype == torch.int32


def test_an_epoch_uses_every_token_once(stream):
    ts, _ = stream
    L = len(ts)
    rows = (L - 1) // T
    loader = PackedLoader(ts, T, 1, seed=5, prefetch=0)
    for epoch in range(2):
        targets = np.concatenate([positions(b)[1].ravel() for b in take(loader, rows)])
        assert len(np.unique(targets)) == rows * T  # no target repeats within an epoch
        assert loader.epoch == epoch + 1
        first = targets
    loader.reset()
    again = np.concatenate([positions(b)[1].ravel() for b in take(loader, rows)])
    assert not np.array_equal(np.sort(again), np.sort(first))  # the epochs cut rows at different places


def test_order_is_a_function_of_the_seed(stream):
    ts, _ = stream
    a = take(PackedLoader(ts, T, B, seed=1, prefetch=0), 5)
    b = take(PackedLoader(ts, T, B, seed=1, prefetch=3), 5)
    c = take(PackedLoader(ts, T, B, seed=2, prefetch=0), 5)
    assert same(a, b) and not same(a, c)
    plain = take(PackedLoader(ts, T, B, seed=1, prefetch=0, shuffle=False), 3)
    x, _ = positions(plain[0])
    np.testing.assert_array_equal(x[:, 0], np.arange(B) * T)  # stream order without shuffling


@pytest.mark.parametrize("prefetch", [0, 2])
def test_exact_resume(stream, prefetch):
    ts, _ = stream
    n = 3 * ((len(ts) - 1) // T) // B  # crosses two epoch boundaries
    full = take(PackedLoader(ts, T, B, seed=7, prefetch=prefetch), n)
    first = PackedLoader(ts, T, B, seed=7, prefetch=prefetch)
    head = take(first, n // 3)
    state = first.state_dict()
    take(first, 2)  # the old loader running on does not disturb the saved position
    resumed = PackedLoader(ts, T, B, seed=7, prefetch=prefetch)
    resumed.load_state_dict(state)
    assert same(head + take(resumed, n - n // 3), full)
    first.close(), resumed.close()


def test_ranks_partition_the_global_batch(stream):
    ts, _ = stream
    world = 3
    glob = take(PackedLoader(ts, T, B * world, seed=4, prefetch=0), 6)
    ranks = [take(PackedLoader(ts, T, B, seed=4, rank=r, world=world, prefetch=1), 6) for r in range(world)]
    for step in range(6):
        for i in range(3):
            joined = torch.cat([ranks[r][step][i] for r in range(world)])
            assert torch.equal(joined, glob[step][i])


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2), (2, 4)])
def test_elastic_resume(stream, before, after):
    ts, _ = stream
    G = 8
    reference = [np.concatenate(positions(b)[1].ravel()[None]) for b in take(PackedLoader(ts, T, G, seed=9), 12)]
    seen = []
    loaders = [PackedLoader(ts, T, G // before, seed=9, rank=r, world=before, prefetch=1) for r in range(before)]
    for _ in range(5):
        seen.append(np.concatenate([positions(next(ld))[1].ravel() for ld in loaders]))
    state = loaders[0].state_dict()
    assert all(ld.state_dict() == state for ld in loaders)  # every rank holds the same global position
    loaders = [PackedLoader(ts, T, G // after, seed=9, rank=r, world=after) for r in range(after)]
    for ld in loaders:
        ld.load_state_dict(state)
    for _ in range(7):
        seen.append(np.concatenate([positions(next(ld))[1].ravel() for ld in loaders]))
    np.testing.assert_array_equal(np.concatenate(seen), np.concatenate(reference))


def test_resume_refuses_other_data_or_shape(stream, tmp_path):
    ts, _ = stream
    loader = PackedLoader(ts, T, B, prefetch=0)
    next(loader)
    state = loader.state_dict()
    with pytest.raises(DataError, match="seq_len"):
        PackedLoader(ts, T * 2, B).load_state_dict(state)
    with pytest.raises(DataError, match="train.seed"):
        PackedLoader(ts, T, B, seed=99).load_state_dict(state)
    other, _ = make_stream(tmp_path, "ds-other", [[50, 60]])
    with pytest.raises(DataError, match=r"data changed.* or start a new run from its weights: kiln export RUN_DIR "
                                        r"--to DIR, then train with model.init_from=DIR"):  # said how
        PackedLoader(other, T, B).load_state_dict(state)
    with pytest.raises(DataError, match="malformed"):
        PackedLoader(ts, T, B).load_state_dict({"epoch": 0})


def test_too_little_data_and_damaged_shards(tmp_path):
    small, _ = make_stream(tmp_path, "small", [[5, 6]])
    with pytest.raises(DataError, match="fewer than one row"):
        PackedLoader(small, T, B)
    entry = write_shard(tmp_path / "bad", "train/00000", [np.arange(1, 40)], np.uint16)
    binp = tmp_path / "bad" / "train" / "00000.bin"
    binp.write_bytes(binp.read_bytes()[:-10])  # truncated
    from kiln.data.format.shards import TokenStream

    with pytest.raises(DataError, match="does not match"):
        TokenStream([(binp, binp.with_suffix(".idx"), entry["tokens"])], np.uint16, name="bad")
    entry = write_shard(tmp_path / "bad2", "train/00000", [np.arange(1, n) for n in (9, 5, 12)], np.uint16)
    idx = tmp_path / "bad2" / "train" / "00000.idx"
    ends = np.fromfile(idx, "<u8")
    ends[0] = ends[1] + 1  # one flipped bit in the index: same size, out of order
    ends.tofile(idx)
    with pytest.raises(DataError, match=f"damaged; delete {tmp_path / 'bad2'} and run the same `kiln prepare` again"):
        TokenStream([(idx.with_suffix(".bin"), idx, entry["tokens"])], np.uint16, name="bad2")


def test_a_token_past_the_vocabulary_in_a_shard_is_a_data_error_naming_it(tmp_path):
    """A changed byte of a shard (same size: only --verify looks) gave the model a token id past its embedding:
    an IndexError mid-run on a CPU, a device-side assert that ends the process on a GPU."""
    import json

    from kiln.config import DataConfig
    from kiln.data.prepare.pipeline import prepare

    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": f"document {i} of a few words"}) + "\n"
                                              for i in range(40)))
    ds = prepare(DataConfig(sources=[str(tmp_path / "a.jsonl")], vocab_size=300, val_fraction=0, workers=1,
                            cache_dir=str(tmp_path / "cache")))
    binp = ds.path / "train" / "00000.bin"
    tokens = np.fromfile(binp, np.uint16)
    tokens[len(tokens) // 2:] = 65535  # what a changed high byte does to a uint16 id
    tokens.tofile(binp)
    loader = PackedLoader.from_datasets(ds, "train", 8, 2, prefetch=0)
    with pytest.raises(DataError, match=rf"shard {binp} holds token id 65535 at token \d+, past the tokenizer's "
                                        r"vocabulary of \d+: the dataset is damaged"):
        for _ in range(50):
            next(loader)


def test_no_document_ids_when_masking_is_off(stream):
    ts, _ = stream
    tokens, targets, doc_ids = next(PackedLoader(ts, T, B, document_mask=False, prefetch=0))
    assert doc_ids is None and tokens.shape == targets.shape == (B, T)


def test_errors_in_the_prefetch_thread_reach_the_caller(stream):
    ts, _ = stream
    loader = PackedLoader(ts, T, B, prefetch=2)
    next(loader)
    loader.rows.layouts[0].stream.bins[0] = None  # a reader that fails
    with pytest.raises(TypeError):
        take(loader, 200)


def test_resume_on_other_ranks_with_the_same_per_rank_batch_is_refused(stream):
    """The global batch would change unasked: the error names the batch size that keeps it, or says the
    new number of ranks cannot share it. A batch size changed on purpose continues at the next sample."""
    ts, _ = stream
    loaders = [PackedLoader(ts, T, 4, seed=3, rank=r, world=2, prefetch=0) for r in range(2)]
    for ld in loaders:
        next(ld)
    state = loaders[0].state_dict()
    assert (state["batch_size"], state["world"]) == (4, 2)
    with pytest.raises(ConfigError, match=r"batch is 4 sequences per rank on 2 ranks \(8 in all\); on 1 rank\(s\) "
                                          r"keep it with train.batch_size=8"):
        PackedLoader(ts, T, 4, seed=3).load_state_dict(state)
    with pytest.raises(ConfigError, match="which 3 ranks cannot share evenly: resume on 1, 2, 4, 8 ranks"):
        PackedLoader(ts, T, 4, seed=3, rank=0, world=3).load_state_dict(state)
    reference = PackedLoader(ts, T, 11, seed=3, prefetch=0)
    expected = positions(take(reference, 1)[0])[1][8:]  # samples 8 .. 10 of the run
    changed = PackedLoader(ts, T, 3, seed=3, prefetch=0)  # batch size changed on purpose (--resume force)
    changed.load_state_dict(state)
    np.testing.assert_array_equal(positions(next(changed))[1], expected)
    old = {k: v for k, v in state.items() if k not in ("batch_size", "world")}  # saved before they were recorded
    PackedLoader(ts, T, 4, seed=3).load_state_dict(old)


def test_resume_on_other_ranks_counts_the_batches_a_step_accumulates(stream):
    """train.global_batch_tokens keeps the global batch on other ranks with the same micro-batch and another
    accumulation: 2 ranks x 2 rows x 2 accumulated continue on 1 rank x 2 rows x 4 at the same sample, then
    take the same samples a step. The same rows per rank and step on another number of ranks are refused."""
    ts, _ = stream
    two = [PackedLoader(ts, T, 2, seed=3, rank=r, world=2, prefetch=0, per_step=2) for r in range(2)]
    for ld in two:
        take(ld, 2)  # one optimizer step
    state = two[0].state_dict()
    assert state["per_step"] == 2
    expected = [positions(b)[1][:, 0] for ld in two for b in take(ld, 2)]  # where the second step's rows start
    one = PackedLoader(ts, T, 2, seed=3, prefetch=0, per_step=4)
    one.load_state_dict(state)
    got = [positions(b)[1][:, 0] for b in take(one, 4)]
    np.testing.assert_array_equal(np.sort(np.concatenate(got)), np.sort(np.concatenate(expected)))
    with pytest.raises(ConfigError, match=r"batch is 2 sequences per rank x 2 accumulated on 2 ranks \(8 in all\); "
                                          r"on 1 rank\(s\) keep it with train.batch_size=4"):
        PackedLoader(ts, T, 2, seed=3, per_step=2).load_state_dict(state)
