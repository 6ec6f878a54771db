"""Tokenizer: load a tokenizer.json or a local Hugging Face tokenizer directory, or train a
byte-level BPE on the sources.

    tok = Tokenizer.load("llama3/")                   # or ".../tokenizer.json"
    tok = Tokenizer.load("t.json", bos_token="auto")  # also put a BOS before each document
    tok.encode_batch(texts), tok.eos_id, tok.bos_id, tok.hash

BOS/EOS are explicit: `eos_token` (appended after every document; 'auto' finds the usual
end-of-text token) and `bos_token` (prepended; None: no BOS; 'auto' finds the usual one;
'tokenizer': the one the tokenizer's own post-processor puts before a text, if any). The
content hash is taken over the canonical JSON of the tokenizer, so a changed vocabulary, merge
or normaliser gives a new hash; prepared datasets and checkpoints record it.
"""

from __future__ import annotations

import gc
import hashlib
import json
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path

from kiln.data.prepare import bpe
from kiln.data.prepare.bpe import EOS, check_vocab_size
from kiln.errors import DataError

EOS_NAMES = (EOS, "<|end_of_text|>", "</s>", "<eos>")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")


def _special(tk, name: str | None, candidates: tuple[str, ...], what: str) -> int | None:
    if name is None:
        return None
    if name != "auto":
        i = tk.token_to_id(name)
        if i is None:
            raise DataError(f"data.{what}_token='{name}' is not in the tokenizer's vocabulary; use a token it has "
                            f"or 'auto' (tries {', '.join(candidates)})")
        return i
    for c in candidates:
        i = tk.token_to_id(c)
        if i is not None:
            return i
    return None


def post_processor_bos(tk) -> int | None:
    """The id the tokenizer's post-processor puts before a single text (Llama's <s>, Llama 3's
    <|begin_of_text|>, Gemma's <bos>), or None where it puts none (Qwen2, GPT-2, a BPE trained here)."""
    plain = tk.encode("a", add_special_tokens=False).ids
    full = tk.encode("a", add_special_tokens=True).ids
    if len(full) > len(plain) and full[1:1 + len(plain)] == plain:
        return full[0]
    return None


def describe_specials(tok: Tokenizer, bos_token: str | None) -> str:
    """What a prepare did around each document, for its report: the BOS put first (and why), the EOS put last."""
    name = tok.tk.id_to_token
    eos = f"{name(tok.eos_id)} after" if tok.eos_id is not None else "no EOS after"
    if tok.bos_id is not None:
        why = "as the tokenizer's own post-processor puts it first" if bos_token == "tokenizer" else \
            f"data.bos_token={bos_token}"
        return f"{name(tok.bos_id)} before ({why}), {eos}"
    why = "the tokenizer's own post-processor puts none first" if bos_token == "tokenizer" else "data.bos_token=null"
    return f"no BOS before ({why}), {eos}"


class Tokenizer:
    """A Hugging Face `tokenizers.Tokenizer` with a content hash and explicit BOS/EOS ids."""

    def __init__(self, tk, eos_token: str | None = "auto", bos_token: str | None = None):
        self.tk = tk
        self.eos_id = _special(tk, eos_token, EOS_NAMES, "eos")
        self.bos_id = post_processor_bos(tk) if bos_token == "tokenizer" else _special(tk, bos_token, BOS_NAMES, "bos")
        if bos_token == "auto" and self.bos_id is None:
            raise DataError(f"data.bos_token=auto: the tokenizer has none of {', '.join(BOS_NAMES)}; name its "
                            "BOS token or set data.bos_token=null")

    @cached_property
    def hash(self) -> str:
        """sha256 (16 hex digits) of the tokenizer's JSON with sorted keys."""
        collecting = gc.isenabled()
        gc.disable()  # the parsed JSON (~100k objects, no cycles) would set off a full collection of a big process
        try:
            canonical = json.dumps(json.loads(self.tk.to_str()), sort_keys=True, separators=(",", ":"))
        finally:
            if collecting:
                gc.enable()
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    @cached_property
    def unk_id(self) -> int | None:
        """The id of the model's unknown token (WordPiece, Unigram, a BPE without byte-level pre-tokenisation),
        which stands for text the vocabulary has no token for: that text is lost. None where there is none."""
        model = json.loads(self.tk.to_str()).get("model", {})
        if model.get("unk_token") is not None:
            return self.tk.token_to_id(model["unk_token"])
        return int(model["unk_id"]) if model.get("unk_id") is not None else None

    @cached_property
    def vocab_size(self) -> int:
        """Largest token id + 1: the ids a model must embed (a vocabulary may skip ids, so this can exceed
        the number of tokens)."""
        n = self.tk.get_vocab_size(with_added_tokens=True)
        return max(n, max(self.tk.get_vocab(with_added_tokens=True).values(), default=-1) + 1)

    def encode(self, text: str) -> list[int]:
        return self.tk.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without BOS/EOS (no character offsets are computed: faster)."""
        return [e.ids for e in self.tk.encode_batch_fast(texts, add_special_tokens=False)]

    def document_encoder(self, parse_special: bool = False):
        """A separate `tokenizers.Tokenizer` for encoding documents. Unless `parse_special`, a special
        token's text inside a document (say a literal '<|endoftext|>') is encoded as plain text, so no
        document can inject an EOS or BOS and break the document boundaries."""
        from tokenizers import Tokenizer as HFTokenizer

        tk = HFTokenizer.from_str(self.tk.to_str())
        tk.encode_special_tokens = not parse_special
        return tk

    def decode(self, ids: list[int]) -> str:
        return self.tk.decode(ids, skip_special_tokens=False)

    def to_str(self) -> str:
        return self.tk.to_str()

    def save(self, path: str | Path) -> None:
        self.tk.save(str(path))

    @classmethod
    def from_str(cls, text: str, eos_id: int | None, bos_id: int | None) -> Tokenizer:
        """Rebuild a tokenizer with known BOS/EOS ids (as recorded in a manifest)."""
        from tokenizers import Tokenizer as HFTokenizer

        tok = cls(HFTokenizer.from_str(text), eos_token=None)
        tok.eos_id, tok.bos_id = eos_id, bos_id
        return tok

    @classmethod
    def load(cls, path: str | Path, eos_token: str | None = "auto", bos_token: str | None = None,
             named_in: str | Path | None = None) -> Tokenizer:
        """A tokenizer.json file, or a directory holding one (or other Hugging Face tokenizer files). `named_in`: the
        Hugging Face tokenizer directory a file was saved from (a run's data.tokenizer, for its model/tokenizer.json),
        whose tokenizer_config.json names the EOS for 'auto' as a directory `path` names its own (`resolve_eos`)."""
        from tokenizers import Tokenizer as HFTokenizer

        p = Path(path).expanduser()
        file = p / "tokenizer.json" if p.is_dir() else p
        if p.is_dir() and not file.is_file():
            tk = _from_transformers(p)
        elif not file.is_file():
            raise DataError(f"tokenizer {p} does not exist; set data.tokenizer to a tokenizer.json or a directory "
                            "holding one, or to null to train one on the sources")
        else:
            try:
                tk = HFTokenizer.from_file(str(file))
            except Exception as e:  # the Rust side raises plain Exceptions on bad JSON
                raise DataError(f"{file}: not a valid tokenizer.json ({e})") from None
        return cls(tk, resolve_eos(tk, eos_token, p if p.is_dir() else named_in), bos_token)


def resolve_eos(tk, eos_token: str | None, directory: str | Path | None) -> str | None:
    """`eos_token` for the tokenizer `tk`: 'auto', where `tk` has none of EOS_NAMES, becomes the EOS the
    tokenizer_config.json of the Hugging Face directory `directory` names (None, or not a directory: none), the one
    data.eos_token=auto ends documents with (DeepSeek's <｜end▁of▁sentence｜>); else `eos_token` as it is."""
    if eos_token != "auto" or directory is None or _special(tk, "auto", EOS_NAMES, "eos") is not None:
        return eos_token
    folder = Path(directory).expanduser()
    return (_declared_eos(folder, tk) if folder.is_dir() else None) or "auto"


def _declared_eos(directory: Path, tk) -> str | None:
    """The EOS a Hugging Face tokenizer directory's tokenizer_config.json names (a string, or transformers' dict
    with its content), where the tokenizer has it: the one for `data.eos_token: auto` where none of EOS_NAMES is
    in the vocabulary (DeepSeek's <｜end▁of▁sentence｜>). None where it names none."""
    try:
        eos = json.loads((directory / "tokenizer_config.json").read_text()).get("eos_token")
    except (OSError, ValueError, AttributeError):  # no such file, not JSON, not an object
        return None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return eos if isinstance(eos, str) and tk.token_to_id(eos) is not None else None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "spiece.model", "vocab.txt")


def has_tokenizer(directory: str | Path) -> bool:
    """Whether a model directory holds any tokenizer file Kiln reads."""
    return any((Path(directory).expanduser() / name).is_file() for name in TOKENIZER_FILES)


def check_own_tokenizer(model_dir: str | None, tokenizer: str | None) -> None:
    """ConfigError where the data is to be tokenized with the tokenizer of the local model directory `model_dir`
    (model.init_from; data.tokenizer's default with it, which null does not turn off) and that directory holds none."""
    from kiln.errors import ConfigError

    if not model_dir or tokenizer != model_dir or not Path(model_dir).expanduser().is_dir() or has_tokenizer(model_dir):
        return
    raise ConfigError(f"model.init_from={model_dir} holds no tokenizer files ({', '.join(TOKENIZER_FILES)}), and the "
                      "data must be tokenized as the model was trained: set data.tokenizer to the tokenizer the model "
                      "was trained with (a tokenizer.json, or a Hugging Face directory that holds it, such as the "
                      "model's original repository), or copy its tokenizer files into the directory")


def _from_transformers(directory: Path):
    """The fast tokenizer of a local Hugging Face tokenizer directory without tokenizer.json."""
    known = TOKENIZER_FILES[1:]
    if not has_tokenizer(directory):
        raise DataError(f"{directory} holds no tokenizer files (tokenizer.json, {', '.join(known)}); set "
                        "data.tokenizer to a tokenizer.json or a Hugging Face tokenizer directory, or to null to "
                        "train one on the sources")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError(f"{directory} has no tokenizer.json; converting its other tokenizer files needs "
                        "transformers: pip install 'kiln[hf]'") from None
    spm = _unreadable_sentencepiece(directory)
    if spm is not None:
        raise DataError(f"{directory} has no tokenizer.json and its tokenizer is a SentencePiece model ({spm}); "
                        "converting it needs the sentencepiece package: pip install sentencepiece protobuf (or give "
                        "a directory that holds the model's tokenizer.json)")
    try:
        hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True, use_fast=True)
    except Exception as e:
        raise DataError(f"{directory}: not a tokenizer directory ({e}); give a tokenizer.json") from None
    if not getattr(hf, "is_fast", False):
        raise DataError(f"{directory}: no fast tokenizer could be built from it; give a tokenizer.json")
    return hf.backend_tokenizer


def _unreadable_sentencepiece(directory: Path) -> str | None:
    """The name of `directory`'s SentencePiece model (tokenizer.model, spiece.model) where the sentencepiece package
    that converts it is missing (transformers would then try it as tiktoken's and advise installing that); else None.
    A tokenizer.model of tiktoken's (text lines of base64 and a rank, as Llama 3 ships) is not one."""
    import re

    for name in ("tokenizer.model", "spiece.model"):
        try:
            with open(directory / name, "rb") as f:
                head = f.read(256)
        except OSError:  # not there
            continue
        if re.match(rb"[A-Za-z0-9+/=]+ \d+\r?\n", head):
            continue
        try:
            import sentencepiece  # noqa: F401
        except ImportError:
            return name
    return None


def train_bpe(texts: Iterable[str], vocab_size: int, specials: list[str] | None = None) -> Tokenizer:
    """Train a byte-level BPE in this process (`kiln.data.prepare.bpe.train_in_child` trains in another)."""
    return Tokenizer(bpe.train_bpe(texts, vocab_size, specials))


def load_or_train(cfg, texts: Iterable[str], sources: str | list, cache_dir: Path, console=None) -> Tokenizer:
    """The tokenizer of a DataConfig: `cfg.tokenizer` loaded, or a BPE trained on `texts` (in a child
    process, with progress on `console`) and cached under `keys.tokenizer_key(cfg, sources)`, where
    `sources` names the content the texts come from."""
    from kiln.data.prepare.keys import special_tokens, tokenizer_key, train_chars

    if cfg.tokenizer:
        return Tokenizer.load(cfg.tokenizer, cfg.eos_token, cfg.bos_token)
    eos, bos, specials = special_tokens(cfg)
    check_vocab_size(cfg.vocab_size, specials)
    path = cache_dir / "tokenizers" / f"bpe-{cfg.vocab_size}-{tokenizer_key(cfg, sources)}" / "tokenizer.json"
    tok = _cached(path, eos, bos)
    if tok is None:
        from kiln.files import file_lock

        with file_lock(path.parent.with_suffix(".lock"), f"waiting for another process training the same "
                       f"tokenizer ({path.parent})", console):  # one process trains, the others wait for it
            tok = _cached(path, eos, bos)
            if tok is None:
                try:
                    bpe.train_in_child(texts, cfg.vocab_size, specials, path, console, train_chars(cfg))
                except KeyboardInterrupt as e:
                    if console is not None:
                        console.print(f"tokenizer training stopped ({bpe.signal_name(e)}); nothing was kept: run the "
                                      "same command again to train it", highlight=False)
                    raise
                tok = Tokenizer.load(path, eos, bos)
                if tok.vocab_size < cfg.vocab_size and console is not None:
                    console.print(f"the tokenizer learned {tok.vocab_size:,} tokens, fewer than data.vocab_size="
                                  f"{cfg.vocab_size:,}: its text holds no more pairs to merge (more, or more varied, "
                                  "text gives more); the model's vocabulary follows the tokenizer's", highlight=False)
    return tok


def _cached(path: Path, eos: str, bos: str | None) -> Tokenizer | None:
    """The trained tokenizer cached at `path`, or None if there is none or it is damaged (a truncated
    file: trained again)."""
    from tokenizers import Tokenizer as HFTokenizer

    if not path.is_file():
        return None
    try:
        tk = HFTokenizer.from_file(str(path))
    except Exception:  # the Rust side raises plain Exceptions on bad JSON
        return None
    return Tokenizer(tk, eos, bos)
