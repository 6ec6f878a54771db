"""Publish an export on the Hugging Face Hub: `kiln export SOURCE --to OUT --push-to-hub OWNER/NAME`.

    url = push_to_hub(out, "me/my-model", private=True)

Through huggingface_hub (the `hf` extra): the repository is created if it is not there, and the export
directory (weights, config, tokenizer, model card) is uploaded in one commit. The endpoint and the token are
huggingface_hub's own settings (HF_ENDPOINT; HF_TOKEN or `hf auth login`).
"""

from __future__ import annotations

import os
from pathlib import Path

from kiln.errors import StateError


def check_repo(repo: str) -> None:
    """A StateError unless huggingface_hub is installed and `repo` is a Hub repository id OWNER/NAME: said before an
    export's work, not after it."""
    try:
        from huggingface_hub.utils import HFValidationError, validate_repo_id
    except ImportError:
        raise StateError("--push-to-hub needs huggingface_hub: pip install 'kiln[hf]'") from None
    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise StateError(f"--push-to-hub {repo}: not a Hub repository id ({e}); give OWNER/NAME") from None
    if "/" not in repo:
        raise StateError(f"--push-to-hub {repo}: give the repository as OWNER/NAME (your user or organization name)")


def push_to_hub(folder: str | Path, repo: str, private: bool = False, message: str | None = None) -> str:
    """Upload `folder` to the Hub model repository `repo` (created if missing); the URL of its commit."""
    check_repo(repo)
    from huggingface_hub import HfApi

    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)  # read now: huggingface_hub reads it at its import
    try:
        api.create_repo(repo, private=private, exist_ok=True, repo_type="model")
        info = api.upload_folder(repo_id=repo, folder_path=str(folder), repo_type="model",
                                 commit_message=message or "Upload a model exported by Kiln")
    except Exception as e:  # huggingface_hub raises its own HTTP and offline errors, httpx its connection ones
        status = getattr(getattr(e, "response", None), "status_code", None)
        advice = ("log in with a token that may write there (HF_TOKEN, or `hf auth login`)" if status in (401, 403)
                  else "check the network and HF_ENDPOINT, or HF_HUB_OFFLINE (set: nothing is sent)")
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StateError(f"pushing {folder} to the Hub repository {repo} failed ({first}): {advice}. The export "
                         f"itself is complete in {folder}; push it again with the same command") from None
    return str(getattr(info, "commit_url", info))
