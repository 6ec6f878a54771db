"""train.cross_entropy_kernel: validated with the config; 'triton' where it cannot run is a ConfigError before
training; 'auto' falls back to PyTorch's kernel; the Triton one hands the logits it does not take (CPU) to
PyTorch's, compiled or not, and 'torch' puts PyTorch's back."""

from __future__ import annotations

import sys

import pytest
import torch

from kiln.config import RunConfig, load_config
from kiln.errors import ConfigError
from kiln.model import loss as loss_module
from kiln.model.llama import Transformer
from kiln.model.loss_triton import TritonChunkKernel
from kiln.parallel import loss_kernel
from kiln.parallel.compile import compile_loss_kernel
from kiln.parallel.mesh import Mesh
from kiln.parallel.parallelize import parallelize

CPU = torch.device("cpu")


def test_the_config_takes_three_kernels_and_checks_the_device():
    assert RunConfig().train.cross_entropy_kernel == "torch"
    assert load_config(None, ["train.cross_entropy_kernel=torch"]).train.cross_entropy_kernel == "torch"
    with pytest.raises(ConfigError, match="cross_entropy_kernel"):
        load_config(None, ["train.cross_entropy_kernel=liger"])
    with pytest.raises(ConfigError, match="cross_entropy_kernel=triton runs on CUDA GPUs, and train.device=cpu"):
        load_config(None, ["train.cross_entropy_kernel=triton", "train.device=cpu"])


def test_triton_where_it_cannot_run_is_a_config_error_and_auto_is_torch(monkeypatch):
    with pytest.raises(ConfigError, match="runs on CUDA GPUs, and this run's device is cpu"):
        loss_kernel.choose("triton", CPU)
    assert loss_kernel.choose("auto", CPU) == loss_kernel.choose("torch", CPU) == "torch"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU, and no triton
    monkeypatch.setitem(sys.modules, "triton", None)
    with pytest.raises(ConfigError, match="triton does not import"):
        loss_kernel.choose("triton", torch.device("cuda"))
    logs = []
    assert loss_kernel.install("auto", torch.device("cuda"), logs.append) == "torch"
    assert loss_module.ChunkKernel.fn is loss_module.chunk_loss_and_grad and "triton does not import" in logs[0]


def test_a_run_asking_for_triton_on_the_cpu_stops_before_training():
    cfg = RunConfig.model_validate({"model": {"size": "tiny", "vocab_size": 256},
                                    "train": {"cross_entropy_kernel": "triton"}})  # device auto, on a CPU
    with pytest.raises(ConfigError, match="train.cross_entropy_kernel=triton cannot be used"):
        parallelize(Transformer(cfg.model), cfg, Mesh(), log=lambda s: None)


def test_the_triton_kernel_hands_cpu_logits_to_pytorchs_and_torch_puts_it_back(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kernel = TritonChunkKernel(loss_module.chunk_loss_and_grad)
    monkeypatch.setattr(loss_module.ChunkKernel, "fn", kernel)
    logits, targets = torch.randn(4, 10), torch.tensor([1, -100, 3, 9])
    kept = logits.clone()
    loss, grad = loss_module.ChunkKernel.fn(logits, targets, True)
    want_loss, want_grad = loss_module.chunk_loss_and_grad(kept, targets, True)
    assert torch.equal(loss, want_loss) and torch.equal(grad, want_grad) and torch.equal(logits, kept)
    compile_loss_kernel()  # PyTorch's kernel behind Triton's is compiled, Triton's stays in front
    assert loss_module.ChunkKernel.fn is kernel and kernel.fallback is not loss_module.chunk_loss_and_grad
    assert loss_kernel.install("torch", CPU) == "torch" and loss_module.ChunkKernel.fn is kernel.fallback


def test_a_triton_kernel_that_fails_to_build_says_so_and_pytorchs_serves(monkeypatch):
    """A Triton release the kernel was not written for must slow a run down, not stop it."""
    from kiln.model import loss_triton

    def broken():
        raise RuntimeError("unsupported by this triton")

    monkeypatch.setattr(loss_triton, "runs_on", lambda logits: True)
    monkeypatch.setattr(loss_triton, "_program", lambda: broken())
    kernel = TritonChunkKernel(loss_module.chunk_loss_and_grad)
    logits, targets = torch.randn(4, 10), torch.tensor([1, -100, 3, 9])
    kept = logits.clone()
    with pytest.warns(UserWarning, match="failed to build .*unsupported by this triton.*PyTorch's is used"):
        loss, grad = kernel(logits, targets, True)
    assert torch.equal(logits, kept) and torch.equal(grad, loss_module.chunk_loss_and_grad(kept, targets, True)[1])
    assert kernel(logits, targets, True)[0] == loss  # from then on PyTorch's, without trying again


def test_the_triton_kernel_takes_plain_cuda_tensors_of_its_dtypes_only(monkeypatch):
    from kiln.model.loss_triton import runs_on

    x = torch.randn(2, 8)
    assert not runs_on(x)  # a CPU tensor, without the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert runs_on(x) and runs_on(x.bfloat16()) and not runs_on(x.double()) and not runs_on(x[0])
    assert not runs_on(torch.nn.Parameter(x))  # a subclass (a DTensor, say) stays with PyTorch's kernel
