"""DDP and FSDP2 (full, grad_op, hybrid), with and without gradient accumulation, train the tiny model (and
FSDP2 one with Qwen3's and Phi-3's attention layouts) to the same losses as one process with the same global
batch; `auto` picks by memory and says why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.config import RunConfig
from kiln.parallel.mesh import Mesh
from kiln.parallel.parallelize import choose_strategy, grad_sync, parallelize, strategy_of

from .experts_worker import MOE, SAVE_AT
from .experts_worker import STEPS as EP_STEPS
from .workers import STEPS, config, train_losses

HERE = Path(__file__).parent


def torchrun(args: list[str], timeout: int = 300, **kw) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, **kw)


CASES = {  # global batch 4 sequences everywhere: batch_size x grad_accum x 2 ranks
    "ddp": {"batch_size": 2, "grad_accum": 1, "dist": {"strategy": "ddp"}},
    "ddp_accum": {"batch_size": 1, "grad_accum": 2, "dist": {"strategy": "ddp"}},
    "fsdp_full": {"batch_size": 2, "grad_accum": 1, "dist": {"strategy": "fsdp", "sharding": "full"}},
    "fsdp_full_accum": {"batch_size": 1, "grad_accum": 2, "dist": {"strategy": "fsdp", "sharding": "full"}},
    "fsdp_grad_op": {"batch_size": 2, "grad_accum": 1, "dist": {"strategy": "fsdp", "sharding": "grad_op"}},
    "fsdp_hybrid_2x1": {"batch_size": 2, "grad_accum": 1,
                        "dist": {"strategy": "fsdp", "sharding": "hybrid", "replicas": 2}},
    "fsdp_hybrid_1x2": {"batch_size": 1, "grad_accum": 2,
                        "dist": {"strategy": "fsdp", "sharding": "hybrid", "replicas": 1}},
    # Qwen3's q/k norms (a head width of its own) and Phi-3's fused projections and sliding window in one model
    "fsdp_qwen3_phi3_layouts": {"batch_size": 2, "grad_accum": 1, "dist": {"strategy": "fsdp", "sharding": "full"},
                                "model": {"qk_norm": True, "head_size": 32, "fused_projections": True,
                                          "sliding_window": 8}},
    # Gemma 2 and 3's: capped attention, local and global layers with their own rotary tables, four norms a block
    "fsdp_gemma_layout": {"batch_size": 2, "grad_accum": 1, "dist": {"strategy": "fsdp", "sharding": "full"},
                          "model": {"norm": "rmsnorm1p", "mlp": "geglu", "sandwich_norm": True, "embed_scale": True,
                                    "qk_norm": True, "attn_scale_dim": 8, "attn_softcap": 2.0, "logit_softcap": 3.0,
                                    "sliding_window": 8, "full_attention_layers": [1], "rope_local_theta": 100.0}},
}
WRAPPER = {"ddp": "DistributedDataParallel", "fsdp": "FSDPTransformer"}


WIDE = {"d_model": 256, "n_heads": 4, "n_kv_heads": 4}  # 0.9M parameters: 3.5 MB of gradients in buckets of 1 MB
COMPILED_STEPS = 4
REDUCE_CASES = {f"{sharding}_{every}": {"batch_size": 1, "grad_accum": 2, "dist": {
    "strategy": "fsdp", "sharding": sharding, "replicas": replicas, "reduce_every_microbatch": every}}
    for sharding, replicas in (("full", None), ("hybrid", 2)) for every in (True, False)}


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> tuple[dict, Path]:
    """One torchrun of 2 processes for every case of this module's slow tests (its start-up, two interpreters and
    a process group, paid once): {case: (losses, last metrics, wrapper)} and the folder of the saved weights. The
    compiled case runs last: its compiled loss kernel stays for the rest of the process."""
    tmp = tmp_path_factory.mktemp("two_processes")
    reduce = {name: {**case, "save": str(tmp / f"{name}.pt")} for name, case in REDUCE_CASES.items()}
    # two micro-batches a step: the first under no_sync (no all-reduce), the second reducing both
    compiled = {"ddp_model": {"batch_size": 1, "grad_accum": 2, "model": WIDE,
                              "dist": {"strategy": "ddp", "bucket_mb": 1},
                              "train": {"compile": True, "compile_scope": "model", "max_steps": COMPILED_STEPS}}}
    # a mixture of experts under FSDP, and with expert parallelism (each rank 2 of the 4 experts) resumed mid-run;
    # 2 micro-batches a step: the experts' gradients accumulate as the others do
    experts = {f"moe_ep{ep}": {"worker": "experts", "expert_parallel": ep, "dir": str(tmp / f"moe_ep{ep}"),
                               "resume": ep > 1, "grad_accum": 2} for ep in (1, 2)}
    out = tmp / "out.json"
    done = torchrun([str(HERE / "workers.py"), str(out), json.dumps({**CASES, **reduce, **experts, **compiled})])
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), tmp


@pytest.mark.slow
def test_two_processes_match_one_with_the_same_global_batch(two_processes):
    refs = {}  # one process, 4 sequences per step, of each model shape the cases train
    for case in CASES.values():
        key = json.dumps(case.get("model"))
        if key not in refs:
            refs[key] = train_losses(config(4, 1, model=case.get("model")), Mesh())[:2]
            assert len(refs[key][0]) == STEPS and refs[key][0][0] != refs[key][0][-1]
    results = two_processes[0]
    for name, case in CASES.items():
        ref_losses, ref_metrics = refs[json.dumps(case.get("model"))]
        losses, metrics, wrapper = results[name]
        assert wrapper == WRAPPER[case["dist"]["strategy"]], name
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-5), name
        assert metrics["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-4), name
        assert metrics["tokens"] == ref_metrics["tokens"] == STEPS * 4 * 16, name  # global tokens
        assert metrics["tokens_per_s"] == pytest.approx(2 * metrics["tokens_per_s_per_device"]), name


@pytest.mark.slow
def test_ddp_keeps_a_whole_model_graph_split_at_its_gradient_buckets(two_processes):
    """train.compile_scope=model under DDP: torch's compiler splits the one graph where DDP's buckets end, so each
    bucket is reduced while the backward pass goes on, and the run trains like one process."""
    ref_losses, _, _ = train_losses(config(4, 1, {"max_steps": COMPILED_STEPS}, WIDE), Mesh())  # one process, eager
    losses, metrics, wrapper = two_processes[0]["ddp_model"]
    assert wrapper == "DistributedDataParallel"
    # unsplit: the model is one graph and the loss kernel another; per block: the block, the norm and the loss
    assert metrics["compiled_graphs"] >= 5, metrics["compiled_graphs"]
    assert len(losses) == COMPILED_STEPS and losses[0] != losses[-1]
    assert losses == pytest.approx(ref_losses, rel=1e-4, abs=1e-5)


def _mesh(world: int = 2, device: str = "cpu") -> Mesh:
    return Mesh(rank=0, world=world, local_world=world, device=torch.device(device))


def test_auto_is_the_one_process_path_in_one_process():
    logs: list[str] = []
    assert choose_strategy(RunConfig(), Mesh(), 10**6, logs.append) == "single" and not logs


def test_auto_picks_ddp_when_the_model_fits_and_fsdp_when_not(monkeypatch):
    import kiln.parallel.parallelize as par

    monkeypatch.setattr(par, "device_memory", lambda device, local_world: 80 << 30)
    logs: list[str] = []
    assert choose_strategy(RunConfig(), _mesh(), 1_000_000_000, logs.append) == "ddp"  # 16 GB of 80
    assert choose_strategy(RunConfig(), _mesh(), 8_000_000_000, logs.append) == "fsdp"  # 128 GB
    assert "auto: ddp" in logs[0] and "auto: fsdp" in logs[1] and "GiB" in logs[1]
    cfg = RunConfig.model_validate({"dist": {"cpu_offload": True}})
    assert choose_strategy(cfg, _mesh(), 1000, logs.append) == "fsdp" and "cpu_offload" in logs[-1]
    cfg = RunConfig.model_validate({"dist": {"strategy": "ddp"}})
    assert choose_strategy(cfg, _mesh(), 8_000_000_000, logs.append) == "ddp"  # an explicit choice stands


def test_single_process_keeps_the_plain_model_and_gradient_sync_is_a_no_op():
    cfg = config(2, 1)
    model = parallelize(__import__("kiln.model.llama", fromlist=["Transformer"]).Transformer(cfg.model), cfg, Mesh())
    assert strategy_of(model) == "single"
    with grad_sync(model, sync=False):
        pass


def test_whole_model_compile_is_kept_under_ddp_and_made_per_block_where_it_cannot_be(monkeypatch):
    import kiln.parallel.parallelize as par
    from kiln.model.llama import Transformer

    scopes: list[str] = []
    monkeypatch.setattr(par, "apply_compile", lambda model, scope: scopes.append(scope))
    monkeypatch.setattr(par, "DDP", lambda model, **kw: model)  # no process group here: the wrap itself is not tested
    monkeypatch.setattr(par, "_shard", lambda model, cfg, m: model)
    for strategy, bucket_mb, want in (("ddp", 25, "model"), ("ddp", 0.5, "blocks"), ("fsdp", 25, "blocks")):
        cfg = config(2, 1, {"compile": True, "compile_scope": "model"}, strategy=strategy, bucket_mb=bucket_mb)
        logs: list[str] = []
        parallelize(Transformer(cfg.model), cfg, _mesh(), log=logs.append, strategy=strategy)
        assert scopes[-1] == want, (strategy, bucket_mb)
        assert bool(logs) == (want == "blocks") and all("compiled per block" in line for line in logs)


def test_dist_config_checks():
    from kiln.config import load_config
    from kiln.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(None, ["dist.strategy=zero3", "dist.stratgy=ddp"])
    msg = str(e.value)
    assert "dist.strategy: Input should be 'auto', 'ddp' or 'fsdp'" in msg and "did you mean 'dist.strategy'" in msg
    with pytest.raises(ConfigError, match="dist.replicas must be at least 1"):
        load_config(None, ["dist.replicas=0"])
    with pytest.raises(ConfigError, match="cpu_offload needs dist.strategy=fsdp"):
        load_config(None, ["dist.strategy=ddp", "dist.cpu_offload=true"])


@pytest.mark.parametrize("sharding,every,kept_differs", [("full", False, True), ("full", True, False),
                                                          ("hybrid", True, True)])
def test_dropped_unreduced_gradients_do_not_reach_the_next_step(sharding, every, kept_differs):
    """A micro-batch never followed by a step's last (an out-of-memory error cut the step short; an auto-batch
    trial). With the sync off (dist.reduce_every_microbatch=false) it leaves FSDP2 holding each parameter's
    unsharded gradient; reducing every micro-batch under hybrid sharding, the reduce-scattered shard waiting for the
    step's all-reduce between replicas: the next backward pass adds either to its own. `drop_unreduced_grads` drops
    them: the next step's gradients are those of its own rows alone. Reducing every micro-batch under full sharding
    leaves only the parameters' sharded gradients, which zero_grad drops. (FSDP2 over one gloo process, bf16
    compute with fp32 reduction.)"""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from kiln.model.llama import Transformer
    from kiln.model.registry import param_count
    from kiln.parallel.materialize import materialize
    from kiln.parallel.parallelize import drop_unreduced_grads

    rc = RunConfig.model_validate({
        "model": {"size": "tiny", "vocab_size": 512, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                  "ffn_hidden": 192, "max_seq_len": 32},
        "train": {"device": "cpu", "precision": "bf16", "seq_len": 16},
        "dist": {"strategy": "fsdp", "sharding": sharding, "reduce_every_microbatch": every}})
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        grid = init_device_mesh("cpu", (1,), mesh_dim_names=(f"unreduced_{sharding}_{every}",))
        mesh = Mesh(0, 0, 1, 1, torch.device("cpu"), "gloo", grid)
        with torch.device("meta"):
            model = Transformer(rc.model)
        model = parallelize(model, rc, mesh, param_count(rc.model), lambda s: None, strategy="fsdp")
        materialize(model, mesh)
        torch.manual_seed(0)
        for p in model.parameters():
            torch.nn.init.normal_(p.to_local(), std=0.02)
        cut, rows = torch.randint(0, 512, (2, 16)), torch.randint(0, 512, (2, 16))

        def micro_batch(tokens: torch.Tensor, sync: bool) -> None:
            with grad_sync(model, sync=sync, every_microbatch=every):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(tokens, tokens)
                loss.backward()

        def step_grads(drop: bool | None) -> list[torch.Tensor]:
            if drop is not None:  # a step cut short after one micro-batch with the sync off
                micro_batch(cut, sync=False)
                if drop:
                    drop_unreduced_grads(model)
                model.zero_grad(set_to_none=True)
            micro_batch(rows, sync=True)
            out = [p.grad.to_local().clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            return out

        alone, kept, dropped = step_grads(None), step_grads(False), step_grads(True)
    finally:
        dist.destroy_process_group()
    same = [all(torch.allclose(a, b) for a, b in zip(alone, other, strict=True)) for other in (kept, dropped)]
    assert same == [not kept_differs, True]


@pytest.mark.slow
def test_reducing_every_micro_batch_trains_as_reducing_once_a_step(two_processes):
    """dist.reduce_every_microbatch under FSDP2 over 2 gloo processes, 2 micro-batches a step: reduce-scattering
    each micro-batch into the fp32 shards (hybrid: holding the shards for one all-reduce between the replicas at the
    step's last) gives the losses and final weights of one reduction a step, to fp32 rounding: the same sums in
    another order (seen: losses 1.7e-7 apart relatively, weights 6.3e-7 after 10 AdamW steps of about 3e-3)."""
    results, tmp = two_processes
    for sharding in ("full", "hybrid"):
        (every, _, _), (once, _, _) = results[f"{sharding}_True"], results[f"{sharding}_False"]
        assert len(every) == STEPS and every[0] != every[-1]
        assert every == pytest.approx(once, rel=1e-6), sharding
        a, b = (torch.load(tmp / f"{sharding}_{e}.pt") for e in (True, False))
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=2e-6, msg=f"{sharding} {k}")


@pytest.mark.slow
def test_expert_parallelism_trains_as_fsdp_resumes_exactly_and_exports_the_whole_experts(two_processes):
    """dist.expert_parallel=2 over 2 gloo processes, the tiny mixture of experts, 2 micro-batches a step: each rank
    holds 2 of the 4 experts and the tokens travel to them, with the losses and gradient norms (clipped: the
    experts counted once) of FSDP gathering every expert, to fp32 rounding; a checkpoint saved mid-run resumes to
    the very losses of the run that went on; the export gathers every expert of every layer, equal to FSDP's."""
    results, tmp = two_processes
    fsdp, ep = results["moe_ep1"], results["moe_ep2"]
    assert (fsdp["experts"], ep["experts"]) == ("GroupedExperts", "ExpertParallelExperts")
    assert ep["local_experts"] == MOE["moe"]["n_experts"] // 2
    assert len(ep["losses"]) == EP_STEPS and max(ep["norms"]) > 1  # the clipping acted
    assert ep["losses"] == pytest.approx(fsdp["losses"], rel=1e-5)
    assert ep["norms"] == pytest.approx(fsdp["norms"], rel=1e-5)
    assert ep["resumed"] == ep["losses"][SAVE_AT:]  # exact: the same sums in the same order
    a, b = (torch.load(Path(tmp) / f"moe_ep{n}" / "export.pt") for n in (1, 2))
    assert a.keys() == b.keys() and b["layers.1.mlp.experts.gate_up_proj"].shape[0] == MOE["moe"]["n_experts"]
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=2e-6, msg=k)
