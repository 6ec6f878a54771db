"""Whether transformers has a causal LM for a Hugging Face config.json: Kiln trains causal (decoder-only) language
models, and a directory of another kind (T5, an encoder, a vision model) is said to be one as soon as its config is
read, not offered the generic path (`model.hf_class=auto`), which would fail on it after the data was prepared.

    why = not_a_causal_lm(read_hf_config(path))   # None: a causal LM, or nothing here can tell
"""

from __future__ import annotations

import importlib.util
from typing import Any


def not_a_causal_lm(hf: dict[str, Any]) -> str | None:
    """Why `hf` (a config.json's dict) is no model Kiln trains: a model_type transformers knows with no class for
    AutoModelForCausalLM. None where it has one, where the directory ships its own code (`auto_map`), where the
    model_type is one transformers does not know (its own error says so) or where transformers is not installed."""
    kind = hf.get("model_type")
    if hf.get("auto_map") or not isinstance(kind, str) or importlib.util.find_spec("transformers") is None:
        return None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if kind not in CONFIG_MAPPING_NAMES or kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None
    return (f"model_type '{kind}' is not a causal language model (transformers has no AutoModelForCausalLM class "
            "for it, native or generic), and Kiln trains causal, decoder-only language models: give the directory "
            "of one (a Llama, Qwen, Mistral, Gemma, ...; every family: docs/models.md)")
