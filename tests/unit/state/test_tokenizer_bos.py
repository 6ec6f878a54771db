"""kiln.state.tokenizer_bos: the BOS taken out of exported tokenizer files, whatever post-processor puts it first."""

from __future__ import annotations

import json

from tokenizers import Tokenizer, models, pre_tokenizers, processors

from kiln.state.tokenizer_bos import drop_bos

VOCAB = {"<|begin_of_text|>": 0, "[CLS]": 1, "[SEP]": 2, **{c: 3 + i for i, c in enumerate("abcdefgh")}}


def tokenizer_dir(tmp_path, post_processor, config: dict):
    tk = Tokenizer(models.WordLevel(VOCAB, unk_token="a"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tk.add_special_tokens(["<|begin_of_text|>", "[CLS]", "[SEP]"])
    tk.post_processor = post_processor
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_bos_inside_a_sequence_of_post_processors_is_taken_out(tmp_path):
    """Llama 3's post-processor: ByteLevel's offsets, then a template putting <|begin_of_text|> first."""
    template = processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B:1",
                                             special_tokens=[("<|begin_of_text|>", 0)])
    out = tokenizer_dir(tmp_path, processors.Sequence([processors.ByteLevel(trim_offsets=False), template]),
                        {"bos_token": "<|begin_of_text|>", "add_bos_token": True})
    assert drop_bos(out) == ("<|begin_of_text|>", True)
    tk = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tk.encode("abc").ids == tk.encode("abc", add_special_tokens=False).ids == [3, 4, 5]
    assert tk.encode("ab", "c").ids == [3, 4, 5]
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is False
    assert drop_bos(out) == (None, True)  # nothing left to take out


def test_a_post_processor_of_another_kind_is_left_as_it_was_and_said(tmp_path):
    out = tokenizer_dir(tmp_path, processors.BertProcessing(("[SEP]", 2), ("[CLS]", 1)), {})
    before = (out / "tokenizer.json").read_text()
    assert drop_bos(out) == ("[CLS]", False)
    assert (out / "tokenizer.json").read_text() == before
