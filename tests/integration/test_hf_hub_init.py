"""model.init_from as a Hub model id, read through huggingface_hub's local cache (a cache directory laid out as
huggingface_hub lays it out, with a tiny model's snapshot; never the network): ORG/NAME, a revision, hf://, and
HF_HUB_OFFLINE, which uses the cache and says so."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kiln.config import load_config
from kiln.errors import ConfigError
from kiln.model.hub import local_model_dir
from kiln.train.run import run, with_init_from

from .conftest import losses
from .hf_dirs import write_corpus, write_hf_dir

pytest.importorskip("huggingface_hub")
pytest.importorskip("transformers")
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """HF_HOME with the snapshot of kiln-org/tiny-llama (main -> COMMIT), offline."""
    repo = tmp_path / "hf-home" / "hub" / "models--kiln-org--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    write_hf_dir(repo / "snapshots" / COMMIT, "llama")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return repo / "snapshots" / COMMIT


@pytest.mark.parametrize("spec", ["kiln-org/tiny-llama", f"kiln-org/tiny-llama@{COMMIT}", "hf://kiln-org/tiny-llama",
                                  "hf://kiln-org/tiny-llama@main"])
def test_a_hub_id_is_its_cached_snapshot_offline(cache, spec):
    said = []
    assert Path(local_model_dir(spec, log=said.append)) == cache
    assert said == [f"model.init_from={spec}: HF_HUB_OFFLINE is set: the cached snapshot {cache}"]


def test_a_local_directory_stays_one(cache, tmp_path):
    assert local_model_dir(str(cache), log=pytest.fail) == str(cache)


def test_a_relative_directory_is_recorded_whole(cache, monkeypatch):
    """model.init_from=NAME relative to the working directory is recorded as its absolute path, for the model and its
    tokenizer: an export from another directory found no source (its chat template and stop tokens were lost), a
    LoRA checkpoint's export no base."""
    monkeypatch.chdir(cache.parent)
    cfg = with_init_from(load_config(None, [f"model.init_from={cache.name}", "train.seq_len=32"]), log=pytest.fail)
    assert cfg.model.init_from == cfg.data.tokenizer == str(cache)


def test_a_hub_id_fetches_what_an_export_carries(cache, monkeypatch):
    """The files fetched for a Hub id are those an export of a model trained from it keeps: its chat template
    (chat_template.jinja), its LICENSE and its card (README.md, whose license the export's card names), not
    pickled weights."""
    from fnmatch import fnmatch

    asked = {}
    monkeypatch.setattr("huggingface_hub.snapshot_download", lambda repo, **kw: asked.update(kw) or str(cache))
    local_model_dir("kiln-org/tiny-llama", log=lambda m: None)
    fetched = [f for f in ("README.md", "LICENSE", "chat_template.jinja", "tokenizer_config.json", "model.safetensors",
                           "pytorch_model.bin") if any(fnmatch(f, p) for p in asked["allow_patterns"])]
    assert fetched == ["README.md", "LICENSE", "chat_template.jinja", "tokenizer_config.json", "model.safetensors"]


def test_a_model_not_in_the_cache_is_refused_offline(cache, tmp_path):
    with pytest.raises(ConfigError, match=r"HF_HUB_OFFLINE is set and kiln-org/other@v2 is not in the local cache "
                                          rf"\({tmp_path / 'hf-home' / 'hub'}\) \(read as a Hub id"):
        local_model_dir("kiln-org/other@v2")
    with pytest.raises(ConfigError, match="not a Hub model id"):
        local_model_dir("hf://just-a-name")


def test_a_run_trains_from_a_hub_id_and_records_the_snapshot(cache, tmp_path):
    args = [f"data.sources=[{write_corpus(tmp_path / 'corpus', 2)}]", f"data.cache_dir={tmp_path / 'kc'}",
            "train.seq_len=32", "train.batch_size=2", "train.max_steps=2", "train.eval_every=0", "train.device=cpu",
            "train.sample_tokens=0", f"train.run_dir={tmp_path / 'run'}", "logging.every=1", "logging.console=false",
            "logging.plots=false"]
    cfg = with_init_from(load_config(None, ["model.init_from=kiln-org/tiny-llama", *args]), log=lambda m: None)
    assert cfg.model.init_from == cfg.data.tokenizer == str(cache)  # the model and its own tokenizer
    run_dir = run(load_config(None, ["model.init_from=kiln-org/tiny-llama", *args]))
    assert sorted(losses(run_dir)) == [1, 2]
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["model"]["init_from"] == str(cache)  # a resume or an export reads the same files


def test_kiln_plan_reads_a_hub_ids_config(cache):
    from kiln.plan.estimate import resolve_model

    notes: list[str] = []
    model = resolve_model(load_config(None, ["model.init_from=kiln-org/tiny-llama"]), notes)
    assert (model.d_model, model.n_layers, model.vocab_size) == (32, 2, 320)
    assert notes[0].startswith("model.init_from=kiln-org/tiny-llama: HF_HUB_OFFLINE is set")


def test_peft_adapters_name_a_hub_base_by_its_id_and_revision(cache, tmp_path, monkeypatch):
    """Adapters on a Hub id's base (recorded as its snapshot in this machine's cache) name it as PEFT's own do, by
    its Hub id and revision, which AutoPeftModel loads on any machine; they named the cache's path."""
    import json

    import torch

    from kiln.config import LoraConfig
    from kiln.model.hf_import import import_hf
    from kiln.model.llama import Transformer
    from kiln.model.lora import adapter_state_dict, apply_lora
    from kiln.model.lora_peft import write_peft_adapters

    peft = pytest.importorskip("peft")
    cfg, state = import_hf(cache)
    model = Transformer(cfg)
    model.load_state_dict(state)
    lcfg = LoraConfig(rank=4, targets=["q", "v"], base_dtype="fp32")
    apply_lora(model, lcfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    out = write_peft_adapters(adapter_state_dict(model), cfg, lcfg, str(cache), tmp_path / "adapters")
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["base_model_name_or_path"], config["revision"]) == ("kiln-org/tiny-llama", COMMIT)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # read at import, before the fixture's
    loaded = peft.AutoPeftModelForCausalLM.from_pretrained(out, cache_dir=cache.parents[2]).eval()  # from the cache
    x = torch.randint(0, 320, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, model.eval()(x), rtol=0, atol=1e-5)
