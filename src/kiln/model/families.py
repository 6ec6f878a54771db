"""The model families Kiln trains, one row each: the source of the model tables of the README and docs/models.md
(written by `python -m kiln.docs_models`).

A row names the family, the Hugging Face model_types it covers, the test that shows each of parity, LoRA, FSDP
and document masks for it (absent: not tested for it), and its measured speed. Whether it is native (Kiln's own
model) or generic (`model.hf_class=auto`, transformers' module under Kiln's loop) is not written here: it is read
from kiln.model.hf.ARCHITECTURES, so a family made native shows as native once the docs are generated again.
tests/unit/test_docs_models.py fails while a model_type that Kiln imports, or one of the parity matrix, has no
row, while a named test does not exist, or while the committed tables are not what these rows give.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ASPECTS = ("parity", "LoRA", "FSDP", "document masks")
NOT_MEASURED = "not measured"

# the tests that show an aspect for many families (a family's model_type in brackets)
# import, packed documents apart (on the imported model, as `kiln train` builds it), train a step, export, generate
MATRIX = "tests/integration/test_hf_parity_matrix.py::test_parity"
PEFT = "tests/unit/model/test_lora.py::test_peft_loads_the_adapters_onto_the_base_with_equal_logits"
FSDP = "tests/unit/parallel/test_parallelize.py::test_two_processes_match_one_with_the_same_global_batch"
PHI3_LORA = ("tests/unit/model/test_lora.py::test_phi3_targets_as_users_write_them_adapt_its_fused_layers_and_load_"
             "in_peft")
AUTO_LORA = "tests/integration/test_hf_auto_train.py::test_peft_lora_trains_adapters_and_exports_them"
AUTO_FSDP = "tests/integration/test_hf_auto_train.py::test_two_processes_train_the_losses_of_one"
# mixtures of experts (kiln.model.moe): per-expert LoRA merged, FSDP over two processes from a Mixtral directory
MOE_LORA = "tests/unit/model/test_lora_experts.py::test_merged_weights_give_the_adapted_models_logits"
MOE_FSDP = "tests/unit/train/test_router_aux.py::test_fsdp_over_two_processes_trains_the_moe_to_the_one_process_losses"
MOE_NOTE = ("experts stacked, grouped GEMMs; load-balancing loss (router_aux_loss_coef) trained and logged as "
            "aux_loss; expert LoRA exports merged (no PEFT form)")
GEMMA_DOCS = "tests/unit/model/test_hf_gemma.py::test_a_packed_document_gets_the_logits_it_has_alone"
AUTO_DOCS = "tests/unit/model/test_hf_auto.py::test_documents_in_a_packed_row_do_not_see_each_other"


@dataclass(frozen=True)
class Family:
    name: str
    """As users call it ('Qwen3', 'Gemma 2')."""
    model_types: tuple[str, ...]
    """The config.json model_type(s) of the family."""
    tests: dict[str, str] = field(default_factory=dict)
    """Aspect (of ASPECTS) -> the test that shows it: 'path::function' or 'path::function[param]'."""
    speed: str = NOT_MEASURED
    """Measured speed, with the machine and the baseline (from benchmarks/results/)."""
    note: str = ""
    """What a user should know: a refused option, a layout kept, ..."""
    featured: bool = False
    """Shown in the README's short table too (the others only in docs/models.md)."""


def _matrix(kind: str, **more: str) -> dict[str, str]:
    return {"parity": f"{MATRIX}[{kind}]", "document masks": f"{MATRIX}[{kind}]", **more}


SPLIT = "each document of a packed row runs as a row of its own (data.document_mask=split)"


FAMILIES: list[Family] = [
    Family("Llama (1, 2, 3, 3.1)", ("llama",), {
        **_matrix("llama"), "LoRA": f"{PEFT}[llama]", "FSDP": FSDP,
        "document masks": "tests/unit/model/test_doc_mask.py::test_masked_document_equals_document_alone"},
        speed="124m: 512K tokens/s on one H100, 2.51x the HF Trainer (benchmarks/results/throughput.md)",
        featured=True),
    Family("Mistral", ("mistral",), {
        **_matrix("mistral"), "LoRA": f"{PEFT}[mistral]",
        "document masks": "tests/unit/model/test_hf_archs.py::test_sliding_window_with_document_mask"},
        note="sliding window",
        speed="124m on one H100: 495K tokens/s; the generic path 0.81x (benchmarks/results/families.md)",
        featured=True),
    Family("Qwen2", ("qwen2",), {**_matrix("qwen2"), "LoRA": f"{PEFT}[qwen2]"},
           speed="124m on one H100: 429K tokens/s; the generic path 0.98x (benchmarks/results/families.md)",
           featured=True),
    Family("Qwen3", ("qwen3",), {
        **_matrix("qwen3"), "LoRA": f"{PEFT}[qwen3]", "FSDP": FSDP,
        "document masks": "tests/unit/model/test_qwen3_phi3.py::test_a_packed_document_gives_the_logits_it_gives_alone"
                          "[qwen3]"},
        note="q/k norms; a sliding window on some layers only is refused",
        speed="124m on one H100: 377K tokens/s; the generic path 0.99x (benchmarks/results/families.md)",
        featured=True),
    Family("Phi-3, Phi-4", ("phi3",), {
        **_matrix("phi3"),
        "LoRA": PHI3_LORA,
        "FSDP": FSDP,
        "document masks": "tests/unit/model/test_qwen3_phi3.py::test_a_packed_document_gives_the_logits_it_gives_alone"
                          "[phi3]"},
        note="qkv_proj and gate_up_proj kept fused (lora.targets qkv_proj, gate_up_proj); longrope (128K, Phi-3.5, "
             "Phi-4-mini)",
        speed="124m on one H200: 498K tokens/s; the generic path 1.07x (benchmarks/results/families.md)",
        featured=True),
    Family("Nemotron", ("nemotron",), {**_matrix("nemotron"), "LoRA": f"{PEFT}[nemotron]"},
           speed="124m on one H100: 453K tokens/s; the generic path 0.85x (benchmarks/results/families.md)",
           featured=True),
    Family("Mixtral", ("mixtral",), _matrix("mixtral", **{
        "LoRA": f"{MOE_LORA}[mixtral]", "FSDP": MOE_FSDP,
        "document masks": "tests/unit/model/test_moe.py::test_a_packed_document_does_not_see_the_one_before_it"}),
        note=MOE_NOTE, featured=True,
        speed="124m (8 experts, 531M in all) on one H200: 314K tokens/s; the generic path 0.16x "
              "(benchmarks/results/families.md)"),
    Family("Qwen2-MoE", ("qwen2_moe",), _matrix("qwen2_moe", LoRA=f"{MOE_LORA}[qwen2_moe]"),
           note=MOE_NOTE + "; the gated shared expert", featured=True,
           speed="124m (16 experts, 361M in all) on one H200: 268K tokens/s; the generic path 0.18x "
                 "(benchmarks/results/families.md)"),
    Family("Qwen3-MoE", ("qwen3_moe",), _matrix("qwen3_moe", LoRA=f"{MOE_LORA}[qwen3_moe]"), note=MOE_NOTE,
           speed=("124m (32 experts) on one H200: 320K tokens/s, the generic path 0.18x "
                  "(benchmarks/results/families.md); small shape on one H200: 3.01x the HF Trainer; 13B "
                  "(Qwen3-30B-A3B, 20 layers) on 4 H100s: 1.60x "
                  "(benchmarks/results/moe.md)"),
           featured=True),
    Family("Nemotron-H", ("nemotron_h",), _matrix("nemotron_h", **{
        "LoRA": "tests/unit/model/test_nemotron_h.py::test_lora_on_every_projection_trains_the_adapters_and_merges",
        "FSDP": ("tests/unit/parallel/test_hybrid_fsdp.py::test_fsdp_with_checkpointed_hybrid_layers_matches_one_"
                 "process"),
        "document masks": "tests/unit/model/test_nemotron_h.py::test_packed_documents_give_what_they_give_alone"}),
        note="hybrid Mamba-2, attention and MLP layers (model.layer_pattern); Kiln's own chunked SSD scan, compiled "
             "per layer (no mamba-ssm); the scan and convolution restart at each packed document; LoRA on in_proj, "
             "out_proj too; MoE layers (Nemotron 3) are refused: hf_class=auto",
        speed=("8B on 4 H100s at sequence 2048: 3.66x the HF Trainer, 3.85x hf_class=auto; at 8192 (4 H200s) "
               "6,860 tokens/s/GPU, where the HF Trainer runs out of memory (benchmarks/results/nemotron_h.md)"),
        featured=True),
    Family("Gemma", ("gemma",), _matrix("gemma")),
    Family("Gemma 2", ("gemma2",), {
        **_matrix("gemma2"), "LoRA": f"{PEFT}[gemma2]", "FSDP": FSDP,
        "document masks": f"{GEMMA_DOCS}[gemma2]"},
        note="soft-capped attention (flex attention's score modifier on GPUs) and logits; local and global layers",
        speed="124m on one H200: 421K tokens/s; the generic path 0.86x (benchmarks/results/families.md)",
        featured=True),
    Family("Gemma 3", ("gemma3_text",), {
        **_matrix("gemma3_text"), "LoRA": f"{PEFT}[gemma3]", "FSDP": FSDP,
        "document masks": f"{GEMMA_DOCS}[gemma3]"},
        note="text model (Gemma3ForCausalLM); q/k norms, local layers' own rotary base",
        speed="124m on one H100: 389K tokens/s; the generic path 0.83x (benchmarks/results/families.md)",
        featured=True),
    Family("GPT-2", ("gpt2",), _matrix("gpt2", **{"document masks": f"{AUTO_DOCS}[gpt2]"})),
    Family("Phi (1, 1.5, 2)", ("phi",), _matrix("phi")),
    Family("OLMo", ("olmo",), _matrix("olmo")),
    Family("OLMo 2", ("olmo2",), _matrix("olmo2")),
    Family("StableLM", ("stablelm",), _matrix("stablelm")),
    Family("StarCoder2", ("starcoder2",), _matrix("starcoder2")),
    Family("Falcon", ("falcon",), _matrix("falcon"),
           note="its own attention (SDPA's math path in fp32: one key/value head); on transformers 5.17 its masks "
                "ignore position ids, so its packed documents are kept apart by a (B, 1, T, T) mask"),
    Family("GPT-NeoX, Pythia", ("gpt_neox",), _matrix("gpt_neox")),
    Family("Granite", ("granite",), _matrix("granite")),
    Family("Cohere (Command R)", ("cohere",), _matrix("cohere")),
    Family("GLM-4", ("glm4",), _matrix("glm4")),
    Family("SmolLM3", ("smollm3",), _matrix("smollm3")),
    Family("EXAONE 4", ("exaone4",), _matrix("exaone4")),
    Family("GPT-BigCode (StarCoder)", ("gpt_bigcode",), _matrix("gpt_bigcode")),
    Family("GPT-J", ("gptj",), _matrix("gptj")),
    Family("BLOOM", ("bloom",), _matrix("bloom", **{"document masks": f"{AUTO_DOCS}[bloom]"}),
           note=f"ALiBi, on its own attention; {SPLIT}: its masks ignore position ids, and a packed row split into "
                "its documents is padded to the longest (4-6x the tokens at 124m x 1024, with eager fp32 attention "
                "scores: 0.02x-0.03x)"),
    Family("OPT", ("opt",), _matrix("opt")),
    Family("CodeGen", ("codegen",), _matrix("codegen")),
    Family("OLMoE", ("olmoe",), _matrix("olmoe")),
    Family("PhiMoE", ("phimoe",), _matrix("phimoe")),
    Family("DeepSeek-V3", ("deepseek_v3",), _matrix("deepseek_v3")),
    Family("GPT-OSS", ("gpt_oss",), _matrix("gpt_oss"),
           note=f"attention sinks, on its own attention; {SPLIT}: its masks ignore position ids"),
    Family("Mamba 2", ("mamba2",), _matrix("mamba2"), note=f"recurrent layers: {SPLIT}"),
    Family("Jamba", ("jamba",), _matrix("jamba"), note=f"recurrent layers: {SPLIT}"),
    Family("Falcon-H1", ("falcon_h1",), _matrix("falcon_h1"), note=f"recurrent layers: {SPLIT}"),
]


def is_native(family: Family) -> bool:
    """Kiln's own model holds every model_type of `family` (kiln.model.hf.ARCHITECTURES)."""
    from kiln.model.hf import ARCHITECTURES

    return all(kind in ARCHITECTURES for kind in family.model_types)
