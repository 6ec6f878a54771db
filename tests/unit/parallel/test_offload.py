"""kiln.parallel.offload: the optimizer in host memory gives the plain path's training, resumes exactly, and says
what it needs before it starts. On the CPU the "device" weights are a second copy in host memory; the hooks, the
host thread that sums the gradients, the chunked step and the copies back are the code a GPU run takes."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch
from rich.console import Console

from kiln.config import load_config
from kiln.errors import ConfigError, ResourceError
from kiln.events import Callback
from kiln.parallel import offload
from kiln.train.run import run


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("offload")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join(p.read_text(errors="replace") for p in sorted(stdlib.glob("*.py"))[:20])
    (root / "corpus").mkdir()
    for i in range(30):
        (root / "corpus" / f"{i:03d}.txt").write_text(text[i * 2000:(i + 1) * 2000])
    return root


def args(root: Path, name: str, *extra: str) -> list[str]:
    """A tiny CPU run of 20 steps: 2 micro-batches of 2 rows a step, clipping at 1.2 (some steps clip, some not);
    the embedding and output layer apart (a tied one sums its two gradients in another order: see below)."""
    return ["model.size=tiny", "model.tie_embeddings=false",
            "train.seq_len=32", "train.max_steps=20", "train.warmup_steps=2", "train.batch_size=2",
            "train.grad_accum=2", "train.grad_clip=1.2", "optim.fused=true", "train.eval_every=0",
            "train.eval_batches=1", "train.sample_tokens=0", "train.device=cpu", "train.precision=fp32",
            "checkpoint.every=10", "checkpoint.save_final=false", "logging.every=1", "logging.console=false",
            "logging.plots=false", f"data.sources=[{root / 'corpus'}]", "data.val_fraction=0.1",
            "data.vocab_size=512", f"data.cache_dir={root / 'cache'}", f"train.run_dir={root / name}", *extra]


def train_records(run_dir: Path) -> dict[int, dict]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in recs if r["event"] == "train"}


class CrashAt(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, metrics):
        if trainer.step == self.step:
            raise RuntimeError("injected failure")


def quiet() -> Console:
    return Console(quiet=True)


@pytest.fixture(scope="module")
def plain(corpus) -> dict[int, dict]:
    run(load_config(None, args(corpus, "plain")), console=quiet())
    return train_records(corpus / "plain")


def test_offloaded_optimizer_trains_as_the_plain_path_with_accumulation_and_clipping(corpus, plain):
    seen = {}

    class Look(Callback):
        def on_train_start(self, trainer):
            o = trainer.offload
            # a hook on every parameter, and one before the model's forward (it waits for a step in flight)
            seen["hooks"] = len(o._hooks) - 1 == len(o.params) == len(list(trainer.model.parameters())) > 0
            seen["apart"] = all(p.data_ptr() != m.data_ptr() for p, m in zip(o.params, o.masters))
            seen["offload"] = o

        def on_step_end(self, trainer, metrics):  # the step's AdamW runs on beside the next forward pass
            seen.setdefault("in flight", trainer.offload._thread is not None)

    run(load_config(None, args(corpus, "off", "train.offload=optimizer")), console=quiet(), callbacks=[Look()])
    off = train_records(corpus / "off")
    o = seen.pop("offload")
    assert seen == {"hooks": True, "apart": True, "in flight": True}  # masters apart from the model's
    assert not o._hooks and not any(p._post_accumulate_grad_hooks for p in o.params)  # closed at the end
    norms = [r["grad_norm"] for r in plain.values()]  # before clipping
    assert len(plain) == 20 and min(norms) < 1.2 < max(norms)  # steps with and without clipping
    assert [r["loss"] for r in off.values()] == [r["loss"] for r in plain.values()]  # exact, all 20 steps
    assert [r["grad_norm"] for r in off.values()] == [r["grad_norm"] for r in plain.values()]


@pytest.mark.parametrize("first,then", [("optimizer", "optimizer"), ("none", "optimizer"), ("optimizer", "none")])
def test_a_crashed_run_resumes_exactly_with_or_without_offload(corpus, plain, first, then):
    """A crash at step 12 resumes from the step-10 checkpoint; the steps after it log the plain run's losses
    (the offloaded checkpoint is the usual format: a plain run reads it and the reverse)."""
    name = f"resume-{first}-{then}"
    with pytest.raises(RuntimeError, match="injected failure"):
        run(load_config(None, args(corpus, name, f"train.offload={first}")), console=quiet(), callbacks=[CrashAt(12)])
    run(load_config(None, args(corpus, name, f"train.offload={then}")), console=quiet(), resume="force")
    resumed = train_records(corpus / name)
    assert [resumed[s]["loss"] for s in range(11, 21)] == [plain[s]["loss"] for s in range(11, 21)]


def test_the_host_memory_it_needs_is_checked_before_the_run_starts(corpus, monkeypatch):
    monkeypatch.setattr(offload, "host_available", lambda: 1_000_000)
    with pytest.raises(ResourceError, match=r"train.offload=optimizer keeps .* in host memory: .* GB .* this machine "
                                            r"has 0.0 GB available"):
        run(load_config(None, args(corpus, "small", "train.offload=optimizer")), console=quiet())
    assert not (corpus / "small" / "checkpoints").exists()
    need = offload.check_host_memory(8_000_000_000, 2, available=200 * 10**9)
    assert need == 128 * 10**9  # 16 bytes a parameter
    with pytest.raises(ResourceError, match="128.0 GB .* 100.0 GB available"):
        offload.check_host_memory(8_000_000_000, 2, available=100 * 10**9)
    with pytest.raises(ResourceError, match=r"224.0 GB .*checkpoint.async_save: 96.0 GB; false .* 200.0 GB available"):
        offload.check_host_memory(8_000_000_000, 2, async_save=True, available=200 * 10**9)
    # on the CPU the compute copy is host memory too: the total used to be said without it among the parts
    with pytest.raises(ResourceError, match=r"144.0 GB .*weights the CPU trains on 2 .*train.offload=none"):
        offload.check_host_memory(8_000_000_000, 2, on_cpu=True, available=130 * 10**9)
    # a CPU run that has the room is told it gains nothing (it ran silently with twice the weights)
    assert "train.offload=none" in offload.describe_need(144 * 10**9, on_cpu=True)
    assert "144.0 GB" in offload.describe_need(144 * 10**9, on_cpu=False)
    assert "train.offload=none" not in offload.describe_need(144 * 10**9, on_cpu=False)
    # a rollback's snapshot of the fp32 state (96 GB), with the offload's moments and sums still to come (96 GB),
    # out of 3/4 of what is available
    assert offload.rollback_room(8_000_000_000, 1, 280 * 10**9) == (True, 96 * 10**9)
    assert offload.rollback_room(8_000_000_000, 1, 250 * 10**9) == (False, 96 * 10**9)


def test_combinations_it_does_not_take_are_config_errors(corpus):
    with pytest.raises(ConfigError, match="train.offload=optimizer is for full training"):
        load_config(None, args(corpus, "x", "train.offload=optimizer", "lora.rank=4", "model.init_from=somewhere"))
    with pytest.raises(ConfigError, match="model.hf_class=auto is not supported with it"):
        load_config(None, args(corpus, "x", "train.offload=optimizer", "model.hf_class=auto", "model.init_from=there"))
    from types import SimpleNamespace

    from kiln.model.llama import Transformer
    from kiln.parallel.parallelize import parallelize

    cfg = load_config(None, args(corpus, "x", "train.offload=optimizer"))
    two = SimpleNamespace(world=2, distributed=True, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="runs in one process on one GPU; this run has 2 processes"):
        parallelize(Transformer(cfg.model.model_copy(update={"vocab_size": 512})), cfg, two, strategy="ddp")
    with pytest.raises(ConfigError, match="needs a fixed train.batch_size"):
        load_config(None, [*args(corpus, "x", "train.offload=optimizer", "train.batch_size=auto",
                                 "train.global_batch_tokens=128"), "train.grad_accum=1"])


def test_a_step_run_again_after_an_out_of_memory_error_forgets_the_sums_of_the_failed_attempt():
    """zero_grad (what kiln.train.oom calls before it runs the step again) drops the gradients summed so far: the
    step's update is that of the second attempt's gradients alone."""
    torch.manual_seed(0)

    def placed():
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        return offload.place_model(model, torch.device("cpu"), torch.float32)

    x = torch.randn(5, 4)
    models = [placed(), placed()]
    models[1].load_state_dict(models[0].state_dict())
    for m, src in zip(getattr(models[1], offload.MASTERS).values(), getattr(models[0], offload.MASTERS).values()):
        m.copy_(src)
    offs = [offload.OptimizerOffload(m, [{"params": list(m.parameters()), "weight_decay": 0.0}], 0.1, (0.9, 0.95),
                                     1e-8) for m in models]
    models[0](x).sum().backward()  # the failed attempt
    offs[0].optimizer.zero_grad(set_to_none=True)
    for m in models:
        m(x).pow(2).sum().backward()
    for o in offs:
        o.step(float("inf"))
        o.close()
    for a, b in zip(offs[0].masters, offs[1].masters):
        assert torch.equal(a, b)
    assert all(torch.equal(p, m) for p, m in zip(offs[0].params, offs[0].masters))  # the device copy was sent back


def test_bf16_gradients_are_summed_in_fp32_exactly():
    """With bf16 device weights each micro-batch's gradient is added to its parameter's fp32 sum: the sum is that of
    the gradients in fp32, and the masters are views of one fp32 buffer (locked once on a GPU)."""
    torch.manual_seed(0)
    model = offload.place_model(torch.nn.Linear(6, 5), torch.device("cpu"), torch.bfloat16)
    o = offload.OptimizerOffload(model, [{"params": list(model.parameters()), "weight_decay": 0.0}], 0.1,
                                 (0.9, 0.95), 1e-8)
    grads = []
    for _ in range(3):
        x = torch.randn(4, 6, dtype=torch.bfloat16)
        w, b = (p.detach().clone().requires_grad_(True) for p in model.parameters())
        torch.nn.functional.linear(x, w, b).float().pow(2).sum().backward()
        grads.append([w.grad.float(), b.grad.float()])
        model(x).float().pow(2).sum().backward()
    o.wait()
    for i in range(2):
        assert o.sums[i].dtype == torch.float32
        assert torch.equal(o.sums[i], grads[0][i] + grads[1][i] + grads[2][i])
    assert all(p.grad is None for p in model.parameters())  # each gradient left the device as it was made
    assert o.masters[0].untyped_storage().data_ptr() == o.masters[1].untyped_storage().data_ptr()
    o.close()


def test_bf16_device_weights_train_as_the_plain_paths_autocast(corpus):
    """precision bf16: the device holds bf16 weights and the masters stay fp32 on the host; the plain path keeps fp32
    weights that autocast casts to bf16 for its products. The products see the same bf16 values, so the losses
    agree closely (not bit for bit: the norms' weights are bf16 on one path, fp32 on the other)."""
    out = {}
    for mode in ("none", "optimizer"):
        run(load_config(None, args(corpus, f"bf16-{mode}", "train.precision=bf16", f"train.offload={mode}",
                                   "train.max_steps=8")), console=quiet())
        out[mode] = [r["loss"] for r in train_records(corpus / f"bf16-{mode}").values()]
    assert len(out["none"]) == 8 and out["optimizer"] != out["none"]
    assert out["optimizer"] == pytest.approx(out["none"], rel=1e-3)


def test_model_dir_holds_the_fp32_masters_not_the_devices_bf16_copies(corpus):
    """model/ is written from the fp32 master weights, as a plain run writes its fp32 weights: under bf16 the
    device's copies would have lost 16 bits of every weight."""
    from safetensors.torch import load_file

    run(load_config(None, args(corpus, "saved", "train.precision=bf16", "train.offload=optimizer", "train.max_steps=3",
                               "checkpoint.save_final=true")), console=quiet())
    weights = load_file(str(corpus / "saved" / "model" / "model.safetensors"))
    assert weights and all(t.dtype == torch.float32 for t in weights.values())
    big = max(weights.values(), key=torch.Tensor.numel)
    assert not torch.equal(big, big.bfloat16().float())  # not bf16 values


def test_an_early_stop_restores_the_best_masters_into_model_dir_as_the_plain_path_does(corpus):
    """train.early_stop.restore_best keeps the best evaluation's weights in host memory and writes them to model/:
    with offload those are the fp32 masters (its copy on the device would be bf16 under bf16, and the masters would
    stay those of the last step). The same model/ as the plain path, bit for bit."""
    from safetensors.torch import load_file

    out = {}
    for mode in ("none", "optimizer"):
        name = f"early-{mode}"
        run(load_config(None, args(corpus, name, f"train.offload={mode}", "train.eval_every=2",
                                   "train.early_stop.patience=1", "train.early_stop.min_delta=10",
                                   "checkpoint.save_final=true")), console=quiet())
        out[mode] = load_file(str(corpus / name / "model" / "model.safetensors"))
        assert max(train_records(corpus / name)) == 2  # stopped at step 2: the evaluation before step 1 is the best
    assert out["none"].keys() == out["optimizer"].keys()
    assert all(torch.equal(out["none"][k], out["optimizer"][k]) for k in out["none"])


def hybrid_or_tied(kind: str):
    from kiln.config import ModelConfig

    if kind in ("hybrid", "waves"):  # Mamba, attention and MLP layers, the documents kept apart by their ids
        return ModelConfig(vocab_size=96, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=96,
                           mlp="relu2", layer_pattern="M-*M", tie_embeddings=False, max_seq_len=64,
                           mamba=dict(heads=8, head_dim=16, state=8, groups=2, chunk=4))
    return ModelConfig(vocab_size=96, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=96,
                       tie_embeddings=True, max_seq_len=64)


@pytest.mark.parametrize("here", [None, True])
@pytest.mark.parametrize("kind", ["hybrid", "tied", "waves"])
def test_the_layer_by_layer_step_sums_the_plain_paths_gradients(kind, here, monkeypatch):
    """The offloaded step runs every micro-batch through a layer before the next (kiln.parallel.offload_layers): the
    same gradients, summed in the same order (a hybrid model's, with packed documents: exactly), as micro-batches run
    one after the other; a tied embedding gets the output layer's gradients of every micro-batch before its own. In
    waves (the step's micro-batches in groups, here of 2 and 1), a later wave's sums are added to the host's. The
    vocabulary matrices' sums are made as they come on the host (`here` None: the CPU's choice) or, untied, on the
    device beside the layers' (True)."""
    from kiln.parallel import offload_layers

    if kind == "waves":
        monkeypatch.setattr(offload_layers, "WAVE_TOKENS", 2 * 2 * 24)
    import contextlib
    import copy

    from kiln.model.llama import Transformer
    from kiln.train.optim import param_groups

    torch.manual_seed(0)
    plain = Transformer(hybrid_or_tied(kind))
    model = offload.place_model(copy.deepcopy(plain), torch.device("cpu"), torch.float32)
    x = torch.randint(0, 96, (6, 24))
    y = torch.cat([x[:, 1:], torch.full((6, 1), -100)], dim=1)
    docs = (torch.arange(24) >= 9).long().expand(6, 24).contiguous()  # two documents a row
    for lo in range(0, 6, 2):
        (plain(x[lo:lo + 2], y[lo:lo + 2], docs[lo:lo + 2]) / 3).backward()
    o = offload.OptimizerOffload(model, param_groups(model, 0.1), 1e-3, (0.9, 0.95), 1e-8)
    assert o.layered and len(o.streamed) == (1 if kind == "tied" else 2)  # the vocabulary-sized matrices
    o.vocab_here = here
    kept = []
    monkeypatch.setattr(o.kept, "put", lambda layer, rows, h, put=o.kept.put: (kept.append(rows.stop), put(layer,
                                                                                                     rows, h)))
    loss = o.accumulate(x, y, docs, 2, contextlib.nullcontext)
    with torch.no_grad():
        whole = sum(plain(x[lo:lo + 2], y[lo:lo + 2], docs[lo:lo + 2]) / 3 for lo in range(0, 6, 2))
    assert loss.item() == pytest.approx(whole.item(), rel=1e-6)
    named = dict(plain.named_parameters())
    for name, i in zip(o.names, range(len(o.params))):
        want = named[name].grad
        if kind == "hybrid":
            assert torch.equal(o.sums[i], want), name
        else:
            torch.testing.assert_close(o.sums[i], want, rtol=1e-5, atol=1e-7)
    # the norms of the sums made here (of a step in one wave); the rows of a wave the host keeps inputs of
    on_host = set() if here and kind != "tied" else o.streamed
    assert set(o.norms) == (set() if kind == "waves" else set(range(len(o.params))) - on_host)
    assert max(kept) == (4 if kind == "waves" else 6)
    o.close()


def test_a_layered_step_cut_short_by_an_out_of_memory_error_runs_again_as_if_it_had_not_run():
    """An out-of-memory error in the layer-by-layer step's backward pass (kiln.train.oom then calls zero_grad and runs
    the step again): the sums of the failed attempt, made on the device or already on the host, and its kept inputs
    are forgotten; the update is that of the second attempt alone."""
    import contextlib
    import copy

    from kiln.model.llama import Transformer
    from kiln.train.optim import param_groups

    torch.manual_seed(0)
    base = Transformer(hybrid_or_tied("tied"))
    x = torch.randint(0, 96, (4, 24))
    y = torch.cat([x[:, 1:], torch.full((4, 1), -100)], dim=1)
    offs = []
    for _ in range(2):
        model = offload.place_model(copy.deepcopy(base), torch.device("cpu"), torch.float32)
        offs.append(offload.OptimizerOffload(model, param_groups(model, 0.1), 1e-3, (0.9, 0.95), 1e-8))
    block = offs[0].model.layers[0]
    calls = {"n": 0}

    def fails_in_the_backward(*a, forward=block.forward, **k):
        calls["n"] += 1
        if calls["n"] == 3:  # two micro-batches forward, then the backward's first
            raise torch.OutOfMemoryError("injected")
        return forward(*a, **k)

    block.forward = fails_in_the_backward
    with pytest.raises(torch.OutOfMemoryError):
        offs[0].accumulate(x, y, None, 2, contextlib.nullcontext)
    assert any(offs[0].summed) or offs[0].device_sums  # the failed attempt summed something
    offs[0].optimizer.zero_grad(set_to_none=True)
    for o in offs:
        o.accumulate(x, y, None, 2, contextlib.nullcontext)
        o.step(1.0)
        o.close()
    for a, b in zip(offs[0].masters, offs[1].masters):
        assert torch.equal(a, b)


def test_vocabulary_sums_on_the_device_move_to_the_host_after_an_out_of_memory_error(monkeypatch):
    """Where the device has room (here: as if it had), the untied vocabulary matrices' sums are made there; a step
    that runs out of memory while one is there sums it on the host from then on (`relieved` for the retry), and the
    step run again gives the plain path's gradients."""
    import contextlib
    import copy

    from kiln.model.llama import Transformer
    from kiln.train.optim import param_groups

    monkeypatch.setattr(offload, "_room", lambda device: 1 << 40)
    torch.manual_seed(0)
    plain = Transformer(hybrid_or_tied("hybrid"))
    model = offload.place_model(copy.deepcopy(plain), torch.device("cpu"), torch.float32)
    x = torch.randint(0, 96, (4, 24))
    y = torch.cat([x[:, 1:], torch.full((4, 1), -100)], dim=1)
    for lo in (0, 2):
        (plain(x[lo:lo + 2], y[lo:lo + 2]) / 2).backward()
    o = offload.OptimizerOffload(model, param_groups(model, 0.1), 1e-3, (0.9, 0.95), 1e-8)
    head = o.index[id(model.lm_head.weight)]
    calls = []

    def head_loss(h, y, real=model.head_loss):
        calls.append(1)
        if len(calls) == 2:  # the second micro-batch's loss, the output layer's sum on the device
            assert head in o.device_sums
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(h, y)

    monkeypatch.setattr(model, "head_loss", head_loss)
    with pytest.raises(torch.OutOfMemoryError):
        o.accumulate(x, y, None, 2, contextlib.nullcontext)
    o.optimizer.zero_grad(set_to_none=True)  # what the retry does (kiln.train.oom.free_step_memory)
    assert o.relieved and o.vocab_host == {head} and not o.device_sums
    o.relieved = False
    o.accumulate(x, y, None, 2, contextlib.nullcontext)
    embed = o.index[id(model.embed_tokens.weight)]
    assert embed in o.norms and head not in o.norms  # the embedding's sum still made on the device
    named = dict(plain.named_parameters())
    for name, i in zip(o.names, range(len(o.params))):
        assert torch.equal(o.sums[i], named[name].grad), name
    assert not o.relieved
    o.close()
