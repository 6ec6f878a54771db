"""What kiln's torchrun and its failure handling (kiln.parallel.launch.failures) share: the keys of a worker's
error file, how a worker ended in words, and the wrapping of a torchrun method."""

from __future__ import annotations

import signal

SHOWN = "kiln_shown"  # key of the error file: the rank printed this error itself
HUNG = "kiln_hung"  # key of the error file: the rank the watchdog found hung (kiln.parallel.watch), its report printed


def ended(rank: int, failure) -> str:
    """How rank `rank`'s worker ended (`failure`: torchrun's ProcessFailure), in words."""
    if failure.exitcode < 0:
        name = failure.signal_name()
        why = " (by hand, or by the kernel when memory ran out: see `dmesg`)" if failure.exitcode == -signal.SIGKILL \
            else ""
        return f"rank {rank} (pid {failure.pid}) was killed by {name}{why}"
    return f"rank {rank} (pid {failure.pid}) exited with code {failure.exitcode}"


def wrap_agent(agent_class, name: str, wrap) -> None:
    """Replace the method `name` of a torchrun class (its agent, LocalElasticAgent, unless given) with `wrap(method)`,
    once. These methods are private to torchrun: where one is absent, torchrun goes on as it is."""
    if agent_class is None:
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent as agent_class
    method = getattr(agent_class, name, None)
    if method is None or getattr(method, "kiln", False):  # absent, or wrapped already
        return
    wrapped = wrap(method)
    wrapped.kiln = True
    setattr(agent_class, name, wrapped)
