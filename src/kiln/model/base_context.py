"""Whether a run changed the context of the Hugging Face model it started from (model.init_from).

A run may extend its model's context on purpose (model.max_seq_len over the directory's max_position_embeddings,
with the model.rope_scaling that makes it: kiln.model.hf_import.resolve_init_from). The merged export writes the
new context and rotary scaling into config.json, but PEFT adapters load onto the base as it is stored, with its
own context and rotary scaling: they would not give the model that was trained, so none are written for it.

    why = extended_context(cfg)   # None: the run keeps its base's context (or has no base to compare with)
"""

from __future__ import annotations

from pathlib import Path

from kiln.config import ModelConfig


def extended_context(cfg: ModelConfig) -> str | None:
    """What `cfg` changed of the context of its model.init_from (its max_position_embeddings and rotary scaling),
    said for a user; None where it changed nothing, or where cfg.init_from is no local directory to compare with."""
    from kiln.errors import KilnError
    from kiln.model.hf import from_hf_config_dict
    from kiln.model.hf_import import read_hf_config

    if not cfg.init_from or cfg.hf_class == "auto" or not (Path(cfg.init_from).expanduser() / "config.json").is_file():
        return None  # the auto path keeps its model's context (a longer one is refused)
    try:
        base = from_hf_config_dict(read_hf_config(cfg.init_from))
    except KilnError:
        return None
    if cfg.max_seq_len <= base.max_seq_len and cfg.rope_scaling == base.rope_scaling:
        return None
    scaling = "none" if cfg.rope_scaling is None else cfg.rope_scaling.type
    return (f"the run extended the context of model.init_from={cfg.init_from} from its {base.max_seq_len} positions "
            f"to model.max_seq_len={cfg.max_seq_len} (model.rope_scaling {scaling})")
