"""model.init_from as a Hugging Face Hub model id, read through huggingface_hub into its local cache.

    path = local_model_dir("meta-llama/Llama-3.1-8B")   # <cache>/models--meta-llama--Llama-3.1-8B/snapshots/<sha>

`init_from` takes a local directory (as before) or a Hub id: `org/name`, `org/name@revision` (a branch, tag or
commit) or `hf://org/name[@revision]`. A Hub id is fetched with `snapshot_download` into huggingface_hub's cache
(HF_HOME, HF_HUB_CACHE), only the files a model needs (config and tokenizer JSON, safetensors weights,
tokenizer models; pickled weights only with model.allow_pickle); a second run reads the cache. With
HF_HUB_OFFLINE=1 nothing is fetched: the cached snapshot is used and the run says so; one not in the cache is a
ConfigError that says where it looked. The run records the snapshot's directory (its commit in the path), so
a resume or an export reads the same files without the network.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from kiln.errors import ConfigError

HUB_ID = re.compile(r"^(?:hf://)?(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?:@(?P<revision>[\w./-]+))?/?$")
FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "spiece.model", "vocab.txt", "merges.txt",
         "*.jinja", "LICENSE*",  # a chat template and the license, which an export carries (kiln.state.hf_source)
         "README.md",  # the card, whose license metadata the export's card keeps (kiln.state.model_card)
         "*.py"]  # *.py: a model's own code, which runs only with model.trust_remote_code
PICKLES = ["*.bin", "*.pt", "*.pth"]


def offline() -> bool:
    """Whether HF_HUB_OFFLINE turns huggingface_hub's network off (read now, as a run's environment sets it)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_cache() -> str:
    """huggingface_hub's cache directory for this environment: HF_HUB_CACHE, else HF_HOME/hub, else its default."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return os.path.join(os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache")), "huggingface", "hub")


def hub_id(spec: str) -> tuple[str, str | None] | None:
    """(repository, revision) of a Hub model id, or None for anything else (a local path)."""
    if Path(spec).expanduser().exists() or spec.startswith((".", "/", "~")):
        return None
    m = HUB_ID.match(spec)
    return (m["repo"], m["revision"]) if m else None


def snapshot_of(path: str | None) -> tuple[str, str] | None:
    """(repository id, revision) of a snapshot directory of huggingface_hub's cache
    (.../models--OWNER--NAME/snapshots/REVISION), as a run records a Hub id; None for another path. What a published
    file names the base by (PEFT's base_model_name_or_path and revision): the cache's path is this machine's alone."""
    if not path:
        return None
    parts = Path(path).expanduser().parts
    for i, part in enumerate(parts[:-2]):
        if part.startswith("models--") and part.count("--") >= 2 and parts[i + 1] == "snapshots":
            return part.removeprefix("models--").replace("--", "/", 1), parts[i + 2]
    return None


def published_base(path: str | None) -> tuple[str | None, str | None]:
    """(name, revision) a published adapter names its base by: a Hub snapshot's id and revision (`snapshot_of`),
    else `path` itself and no revision."""
    hub = snapshot_of(path)
    return hub if hub else (path, None)


def local_model_dir(spec: str, allow_pickle: bool = False, log: Callable[[str], None] = print,
                    files: list[str] | None = None) -> str:
    """`spec` as an absolute path when it is not a Hub id (a run records it, and a resume or an export from another
    working directory finds it); else the local directory of its snapshot (fetched, or from the cache when offline);
    `files`: the patterns to fetch (default: what a model needs; ["config.json"] for its shape alone). ConfigError
    when it cannot be had, saying why and what to do."""
    found = hub_id(spec)
    if found is None:
        if spec.startswith("hf://"):
            raise ConfigError(f"model.init_from={spec}: not a Hub model id; give hf://ORG/NAME[@REVISION], ORG/NAME "
                              "or a local Hugging Face model directory")
        return str(Path(spec).expanduser().absolute())
    repo, revision = found
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        raise ConfigError(f"model.init_from={spec}: a Hugging Face Hub id needs huggingface_hub: pip install "
                          "'kiln[hf]'; or give a local model directory") from None
    where = f"{repo}" + (f"@{revision}" if revision else "")
    local = "" if spec.startswith("hf://") else f" (read as a Hub id: there is no local directory {spec})"
    cache, off = hub_cache(), offline()
    try:
        path = snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=off,
                                 allow_patterns=files or FILES + (PICKLES if allow_pickle else []))
    except LocalEntryNotFoundError:
        if off:
            raise ConfigError(f"model.init_from={spec}: HF_HUB_OFFLINE is set and {where} is not in the local cache "
                              f"({cache}){local}. Unset HF_HUB_OFFLINE to download it, or set HF_HUB_CACHE or "
                              "HF_HOME to the cache that holds it") from None
        raise ConfigError(f"model.init_from={spec}: {where} could not be downloaded and is not in the local cache "
                          f"({cache}){local}; check the network (HF_ENDPOINT), or give a local directory") from None
    except GatedRepoError:
        raise ConfigError(f"model.init_from={spec}: {repo} is gated: accept its license on the Hub and log in "
                          "(`hf auth login`, or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"model.init_from={spec}: no model {repo} on the Hub{local} (or it is private: log in "
                          "with `hf auth login`, or set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ConfigError(f"model.init_from={spec}: {repo} has no revision {revision}") from None
    except Exception as e:  # noqa: BLE001 - huggingface_hub's HTTP errors, httpx's connection errors
        raise ConfigError(f"model.init_from={spec}: {where} cannot be fetched from the Hub ({type(e).__name__}: "
                          f"{e}); check the network, or set HF_HUB_OFFLINE=1 to use the cached copy") from None
    note = "HF_HUB_OFFLINE is set: the cached snapshot" if off else "the Hub's snapshot"
    log(f"model.init_from={spec}: {note} {path}")
    return str(path)
