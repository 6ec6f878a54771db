"""An lm-evaluation-harness model that runs Kiln's own model: `KilnLM`, a subclass of lm_eval's LM.

    lm = KilnLM(model, tokenizer, batch_size=32)
    lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"])

Requests are scored in batches, the longest first (right-padded, so padding never reaches a scored
position). Text is encoded as lm-eval's own Hugging Face backend encodes it: a context's trailing
spaces move to the continuation, the pair is encoded whole and split at the context's length, an
empty context is the BOS token (or EOS when there is none), and inputs longer than the model's
context keep their last tokens. So on the same model and tokenizer, loglikelihood tasks score what
lm-eval's `hf` model type scores. On Kiln's native model only the positions a request scores go
through the output layer (a task of four-token answers computes four rows of logits, not a whole
sequence's). Rolling loglikelihood cuts a document into windows of the context length, each
predicting its tokens once. Generation is batched too: prompts are left-padded, and the padding is a
separate document of the row (document masking), so a prompt sees none of it; rotary positions only
ever differ by a constant, which attention does not see.

With `data_parallel` (kiln eval --tasks --nproc N) every process holds the whole model and lm-eval gives
each its share of the requests; the processes gather the results through torch.distributed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from kiln.model.llama import Transformer

Request = tuple[Any, list[int], list[int]]  # (the request's strings, context tokens, continuation tokens)


def _sharded(model: torch.nn.Module) -> bool:
    """Whether `model`'s weights are sharded over processes (DTensors: FSDP2, tensor parallelism)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


class KilnLM(TemplateLM):
    """lm-eval model over a Kiln `Transformer` (or any module whose forward(tokens) gives logits, such as
    a wrapped one in training) and its `kiln` Tokenizer."""

    def __init__(self, model: torch.nn.Module, tokenizer, *, batch_size: int = 16, max_length: int | None = None,
                 max_gen_toks: int = 256, autocast: Callable[[], Any] | None = None, data_parallel: bool = False,
                 stop_ids: Sequence[int] = (), stop_strings: Sequence[str] = (),
                 before_forward: Callable[[], None] | None = None):
        super().__init__()
        # called before each forward of the model: the processes of a training job check they are all still in
        # the task (kiln.eval.agree), whose forwards are collectives on a sharded model
        self.before_forward = before_forward or (lambda: None)
        if data_parallel:
            import torch.distributed as dist

            self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        self.model, self.tok = model, tokenizer
        if tokenizer.eos_id is None and tokenizer.bos_id is None:
            from kiln.errors import ConfigError

            raise ConfigError("the model's tokenizer has neither an EOS nor a BOS token, which lm-eval conditions "
                              "an empty context on and generation stops at; name one (data.eos_token)")
        self.batch_size = int(batch_size)
        cfg = getattr(model, "cfg", None)
        self._max_length = int(max_length or (cfg.max_seq_len if cfg is not None else 2048))
        self.max_gen_toks = max_gen_toks
        # generation ends at any of the model's stop tokens (kiln.state.stop_tokens), as transformers' does
        self.stop_ids = {i for i in (tokenizer.eos_id, *stop_ids) if i is not None}
        # and at its stop strings (generation_config.json's), which end and cut it as the task's `until` strings do
        self.stop_strings = [s for s in stop_strings if s]
        self.autocast = autocast or contextlib.nullcontext
        self._device = next(model.parameters()).device
        # only a plain native model is asked for its hidden states (a wrapped one runs its own forward, and a sharded
        # one, FSDP's, gathers its weights in its forward's hooks, which `hidden` passes by)
        self._hidden = model.hidden if isinstance(model, Transformer) and not _sharded(model) else None

    # ------------------------------------------------------------------------------------------ processes
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._world_size == 1:
            return tensor
        import torch.distributed as dist

        parts = [torch.zeros_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> list | None:
        if self._world_size == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self._world_size if self._rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self._world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    # ------------------------------------------------------------------------------------------ tokens
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return self.tok.hash

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        ids = self.tok.encode(string)
        if add_special_tokens and self.tok.bos_id is not None:
            ids = [self.tok.bos_id, *ids]
        return ids

    def tok_decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    # ------------------------------------------------------------------------------------------ scoring
    @torch.no_grad()
    def _scored_logits(self, tokens: torch.Tensor, picks: list[tuple[int, int]]) -> list[torch.Tensor]:
        """fp32 log-probabilities (n, V) at positions [lo, hi) of each row of `tokens` (B, T)."""
        self.before_forward()
        with self.autocast():
            if self._hidden is not None:
                h = self._hidden(tokens, None)  # (B, T, C)
                rows = torch.cat([h[i, lo:hi] for i, (lo, hi) in enumerate(picks)])  # (N, C)
                logits = self.model.logits(rows).float()  # (N, V)
            else:
                full = self.model(tokens)  # (B, T, V)
                logits = torch.cat([full[i, lo:hi] for i, (lo, hi) in enumerate(picks)]).float()
        return list(F.log_softmax(logits, dim=-1).split([hi - lo for lo, hi in picks]))

    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """(sum of log-probabilities of the continuation, whether greedy decoding gives it) per request."""
        inputs = []
        for _, ctx, cont in requests:
            if not cont:
                raise ValueError("a loglikelihood request has an empty continuation")
            whole = (ctx + cont)[-(self.max_length + 1):]
            inputs.append((whole[:-1], cont[-len(whole) + 1:] if len(cont) >= len(whole) else cont))
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i][0]))
        unique: dict[tuple, tuple[float, bool]] = {}
        out: list[tuple[float, bool] | None] = [None] * len(inputs)
        todo = [i for i in order if (tuple(inputs[i][0]), tuple(inputs[i][1])) not in unique]
        for lo in range(0, len(todo), self.batch_size):
            chunk = todo[lo:lo + self.batch_size]
            width = len(inputs[chunk[0]][0])
            tokens = torch.zeros((len(chunk), width), dtype=torch.long)  # right-padded: no scored position sees it
            picks = []
            for row, i in enumerate(chunk):
                inp, cont = inputs[i]
                tokens[row, :len(inp)] = torch.tensor(inp)
                picks.append((len(inp) - len(cont), len(inp)))
            logprobs = self._scored_logits(tokens.to(self.device), picks)
            for i, lp in zip(chunk, logprobs):
                cont = torch.tensor(inputs[i][1], device=lp.device)
                score = float(lp.gather(1, cont[:, None]).sum())
                unique[(tuple(inputs[i][0]), tuple(inputs[i][1]))] = (score, bool((lp.argmax(-1) == cont).all()))
        for i, (inp, cont) in enumerate(inputs):
            out[i] = unique[(tuple(inp), tuple(cont))]
            if requests[i][0] is not None and requests[i][0] != (None,):
                self.cache_hook.add_partial("loglikelihood", requests[i][0], out[i])
        return out  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole document, in windows of the model's context, each token predicted once."""
        windows, owner = [], []
        for n, req in enumerate(requests):
            (text,) = req.args
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(n)
        scores = self._loglikelihood_tokens(windows)
        out = [0.0] * len(requests)
        for n, (score, _) in zip(owner, scores):
            out[n] += score
        for req, total in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return out

    # ------------------------------------------------------------------------------------------ generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or, with do_sample, sampled) continuations, cut at the first stop string."""
        out: list[str | None] = [None] * len(requests)
        prompts = [self.tok_encode(req.args[0]) or [self.prefix_token_id] for req in requests]
        order = sorted(range(len(requests)), key=lambda i: -len(prompts[i]))
        for lo in range(0, len(order), self.batch_size):
            chunk = order[lo:lo + self.batch_size]
            kwargs = [dict(requests[i].args[1]) for i in chunk]
            texts = self._generate([prompts[i] for i in chunk], kwargs)
            for i, text in zip(chunk, texts):
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out  # type: ignore[return-value]

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], kwargs: list[dict]) -> list[str]:
        eos = self.tok.decode([self.eot_token_id]) if self.eot_token_id is not None else None
        untils = []
        for kw in kwargs:
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            untils.append(list(dict.fromkeys([*until, *([eos] if eos else []), *self.stop_strings])))
        steps = [int(kw.get("max_gen_toks", self.max_gen_toks)) for kw in kwargs]
        sample = [bool(kw.get("do_sample", False)) and float(kw.get("temperature", 1.0)) > 0 for kw in kwargs]
        room = self.max_length - max(steps)
        if room < 1:
            raise ValueError(f"max_gen_toks={max(steps)} leaves no room for a prompt in {self.max_length} positions")
        prompts = [p[-room:] for p in prompts]
        width = max(len(p) for p in prompts)
        B = len(prompts)
        tokens = torch.zeros((B, width), dtype=torch.long)
        docs = torch.zeros((B, width), dtype=torch.int32)  # padding is document 0, the prompt document 1
        for row, p in enumerate(prompts):
            tokens[row, width - len(p):] = torch.tensor(p)
            docs[row, width - len(p):] = 1
        tokens, docs = tokens.to(self.device), docs.to(self.device)
        new: list[list[int]] = [[] for _ in range(B)]
        done = [False] * B
        vocab = self.tok.vocab_size
        gen = torch.Generator(device=self.device).manual_seed(1234)
        for _ in range(max(steps)):
            self.before_forward()
            with self.autocast():
                logits = self.model(tokens, None, docs)[:, -1, :vocab].float()  # (B, V_tok)
            nxt = logits.argmax(-1)
            for row in range(B):
                if sample[row]:
                    p = torch.softmax(logits[row] / float(kwargs[row].get("temperature", 1.0)), -1)
                    nxt[row] = torch.multinomial(p, 1, generator=gen)[0]
            for row in range(B):
                if done[row]:
                    continue
                if int(nxt[row]) in self.stop_ids:
                    done[row] = True
                    continue
                new[row].append(int(nxt[row]))
                text = self.tok.decode(new[row])
                if len(new[row]) >= steps[row] or any(s and s in text for s in untils[row]):
                    done[row] = True
            if all(done):
                break
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
            docs = torch.cat([docs, torch.ones_like(docs[:, :1])], dim=1)
        texts = []
        for row in range(B):
            text = self.tok.decode(new[row])
            for s in untils[row]:
                if s:
                    text = text.split(s)[0]
            texts.append(text)
        return texts
