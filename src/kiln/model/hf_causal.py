"""Whether transformers can build a causal LM of a Hugging Face config.json: Kiln trains causal (decoder-only) language
models, and a directory of another kind (T5, an encoder, a vision model), or of a model_type transformers does not
know, is said to be one as soon as its config is read, not offered the generic path (`model.hf_class=auto`), which
would fail on it after the data was prepared.

    why = unbuildable(read_hf_config(path))   # None: a causal LM, or nothing here can tell
"""

from __future__ import annotations

import importlib.util
from typing import Any


def unbuildable(hf: dict[str, Any]) -> str | None:
    """Why transformers builds no causal LM of `hf` (a config.json's dict): a model_type it knows with no class for
    AutoModelForCausalLM, or one it does not know. None where it has one, where the directory ships its own code
    (`auto_map`), where there is no model_type or where transformers is not installed."""
    kind = hf.get("model_type")
    if hf.get("auto_map") or not isinstance(kind, str) or importlib.util.find_spec("transformers") is None:
        return None
    from transformers import __version__
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if kind not in CONFIG_MAPPING_NAMES:
        return (f"'{kind}' is a model_type transformers {__version__} does not know either, so neither Kiln's model "
                "nor model.hf_class=auto can build it: a newer transformers may (pip install -U transformers), or "
                "the model's own code (a directory whose config.json has an auto_map, with "
                "model.trust_remote_code=true)")
    if kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None
    return (f"model_type '{kind}' is not a causal language model (transformers has no AutoModelForCausalLM class "
            "for it, native or generic), and Kiln trains causal, decoder-only language models: give the directory "
            "of one (a Llama, Qwen, Mistral, Gemma, ...; every family: docs/models.md)")
