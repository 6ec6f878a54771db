"""Loading a config: a YAML file or preset plus dotted KEY=VALUE overrides, validated in one pass that
reports every problem with its full key path (and, for typos, the closest valid key); `derive()` makes a
changed copy of a validated config."""

from __future__ import annotations

import copy
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from kiln.config.base import DEFER
from kiln.config.run import RunConfig
from kiln.errors import ConfigError

PRESETS_DIR = Path(__file__).parents[1] / "configs"


def dotted(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train.lr": 0.002, ...}: the values of a nested dict (a config's model_dump) under dotted keys, as
    overrides name them."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(dotted(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Build a RunConfig from a YAML file or preset name (or defaults) plus KEY=VALUE overrides."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        file = resolve_config_path(path)
        source = str(file)
        data = _read_yaml(file)
    problems: list[str] = []
    keys = {item.partition("=")[0].strip() for item in overrides}
    for given, other in (("data.mixture", "data.sources"), ("data.sources", "data.mixture")):
        if given in keys and other not in keys and isinstance(data.get("data"), dict):
            data["data"].pop(other.split(".")[1], None)  # an override of one replaces the file's other
    if "model.size" in keys and isinstance(data.get("model"), dict):  # a size given here: the file's shape gives
        shape = ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden")  # way (overrides of its fields win)
        data["model"] = {k: v for k, v in data["model"].items() if k not in shape}
    if "model.init_from" in keys and isinstance(data.get("model"), dict):  # its config.json is the architecture:
        keep = ("init_from", "max_seq_len", "rope_scaling", "init_std", "allow_pickle", "hf_class",
                "trust_remote_code")
        # the file's other model fields give way to it
        data["model"] = {k: v for k, v in data["model"].items() if k in keep}
    for item in overrides:
        try:
            _apply_override(data, item)
        except ValueError as e:
            problems.append(str(e))
    cfg, found = _validate_all(data)
    problems += found
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"{len(problems)} problem(s) in the config ({source}):\n{lines}")
    assert cfg is not None
    return cfg


def _validate_all(data: dict[str, Any]) -> tuple[RunConfig | None, list[str]]:
    """Validate `data` and describe every problem in it, of all sections, in one list.

    The first pass checks single values (types, bounds, unknown keys) with the cross-field checks
    deferred. The values that failed are set aside (their defaults stand in) and the config is built
    again, then every cross-field check runs whose fields were all valid as given."""
    found: list[tuple[int, str]] = []  # (section order, description)
    order = {name: i for i, name in enumerate(RunConfig.model_fields)}

    def add(key: str, text: str) -> None:
        item = (order.get(key.split(".")[0], -1), text)
        if item not in found:
            found.append(item)

    bad: list[str] = []  # keys of the values set aside
    cfg = None
    for _ in range(4):  # setting values aside cannot fail, but keep a bound on it
        try:
            cfg = RunConfig.model_validate(data, context={DEFER: True})
            break
        except ValidationError as e:
            for err in e.errors():
                loc = _clean_loc(err["loc"])
                add(".".join(map(str, loc)), _describe(err))
                bad.append(".".join(map(str, loc)))
                data = _without(data, loc)
    if cfg is not None:
        for where, keys, msg in cfg.all_problems():
            if not any(k == b or k.startswith(b + ".") or b.startswith(k + ".") for k in keys for b in bad):
                add(where or keys[0], f"{where}: {msg}" if where and not msg.startswith(where + ".") else msg)
    found.sort(key=lambda item: item[0])  # stable: grouped by section, in the order found
    return (cfg if not found else None), [text for _, text in found]


def _clean_loc(loc: tuple) -> tuple:
    """The key path of an error: validator names dropped, a list item's error set on the whole list."""
    loc = tuple(p for p in loc if not str(p).startswith("function-"))
    return loc[:-1] if loc and isinstance(loc[-1], int) else loc


def _without(data: dict[str, Any], loc: tuple) -> dict[str, Any]:
    """A copy of `data` without the value at `loc` (so the field's default stands in)."""
    if not loc:
        return data
    data = copy.deepcopy(data)
    node: Any = data
    for part in loc[:-1]:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return data
    if isinstance(node, dict):
        node.pop(loc[-1], None)
    return data


def derive(cfg: RunConfig, changes: dict[str, Any]) -> RunConfig:
    """A new validated config: `cfg` with the dotted keys of `changes` set (`{"train.run_dir": "runs/a"}`).

    `cfg` itself is frozen and stays as it was. The values `cfg` was given (not its defaults) are
    validated again with the changes, so defaults that depend on them (a size preset, the quickstart's
    data.max_bytes) come out as they would have from a file holding them all."""
    data = cfg.model_dump(mode="json", exclude_unset=True)
    for key, value in changes.items():
        *sections, name = key.split(".")
        node = data
        for part in sections:
            node = node.setdefault(part, {})
        node[name] = value
    cfg, problems = _validate_all(data)
    if cfg is None:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"the config with {', '.join(changes)} changed is not valid:\n{lines}")
    return cfg


def resolve_config_path(path: str | Path) -> Path:
    """A path to a YAML file, or the name of a preset in kiln/configs/."""
    p = Path(path).expanduser()
    if p.is_file():
        return p
    if p.is_dir():
        raise ConfigError(f"config file '{path}' is a directory, not a YAML file; give a YAML file or a preset")
    preset = PRESETS_DIR / f"{path}.yaml"
    if preset.is_file():
        return preset
    names = sorted(f.stem for f in PRESETS_DIR.glob("*.yaml"))
    close = difflib.get_close_matches(str(path).removesuffix(".yaml"), names, n=1, cutoff=0.75)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise ConfigError(f"config file '{path}' does not exist and is not a preset.{hint} Presets: {', '.join(names)}.")


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader that refuses a key given twice in one mapping (plain YAML keeps the last silently:
    `seq_len: 32` then `seq_len: 64` would train at 64 whatever the reader of the file believes)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: keys given beside it override its own
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' given twice (first at line {seen[key].line + 1}); keep one",
                    key_node.start_mark)
            if isinstance(key, typing.Hashable):
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def _read_yaml(file: Path) -> dict[str, Any]:
    try:
        data = yaml.load(file.read_text(encoding="utf-8"), Loader=_StrictLoader)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{file}: not a text file in UTF-8 (byte {e.start}: {e.reason}); give a YAML "
                          "config file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark else str(file)
        raise ConfigError(f"{where}: not valid YAML ({getattr(e, 'problem', e)}). Fix the syntax there.") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {file}: {e.strerror}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: expected a mapping of sections (model:, train:, ...), got {type(data).__name__}")
    return data


def _apply_override(data: dict[str, Any], item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"override '{item}' is not KEY=VALUE (for example train.lr=3e-4)")
    parts = key.strip().split(".")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    text = _text_field(tuple(parts))
    if text is not None and not raw.lstrip().startswith(("'", '"')) and not (text == "nullable" and value is None):
        value = raw  # a text field takes the text as typed: YAML would strip 'The ' and read 'Q: a' as a mapping
    node = data
    for i, part in enumerate(parts[:-1]):
        path = tuple(parts[: i + 1])
        parent = _section_at(path[:-1])
        if parent is not None and part in parent.model_fields and _section_at(path) is None:
            raise ValueError(f"override '{item}': '{'.'.join(path)}' is a value, not a section")
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"override '{item}': '{'.'.join(path)}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def _text_field(key: tuple[str, ...]) -> str | None:
    """'text' for a str field at `key`, 'nullable' for a `str | None` one, None for any other key."""
    section = _section_at(key[:-1])
    field = section.model_fields.get(key[-1]) if section is not None else None
    if field is None:
        return None
    if field.annotation is str:
        return "text"
    if typing.get_origin(field.annotation) in (typing.Union, types.UnionType) and \
            set(typing.get_args(field.annotation)) == {str, type(None)}:
        return "nullable"
    return None


def _section_at(loc: tuple) -> type[BaseModel] | None:
    cls: type[BaseModel] = RunConfig
    for part in loc:
        if isinstance(part, int):  # an item of a list field (data.mixture.0): its section was taken below
            continue
        field = cls.model_fields.get(str(part))
        ann = field.annotation if field else None
        if typing.get_origin(ann) is list:  # list[Section]
            ann = typing.get_args(ann)[0]
        elif typing.get_origin(ann) in (typing.Union, types.UnionType):  # Section | None (model.rope_scaling)
            ann = next((a for a in typing.get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        cls = ann
    return cls


def _describe(err: dict[str, Any]) -> str:
    loc = tuple(p for p in err["loc"] if not str(p).startswith("function-"))
    key = ".".join(str(p) for p in loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        parent = _section_at(loc[:-1])
        name = str(loc[-1])
        hint = ""
        field, colon, value = name.partition(":")
        if colon and parent is not None and field.strip() in parent.model_fields:
            hint = f"; YAML needs a space after the colon: '{field.strip()}: {value.strip()}'"
        elif parent is not None:
            close = difflib.get_close_matches(name, list(parent.model_fields), n=1, cutoff=0.6)
            if close:
                suggestion = ".".join(map(str, loc[:-1] + (close[0],)))
                hint = f"; did you mean '{suggestion}'?"
            else:
                others = [f"{s}.{name}" for s, f in RunConfig.model_fields.items()
                          if isinstance(f.annotation, type) and name in f.annotation.model_fields]
                if others:
                    hint = f"; did you mean '{others[0]}'?"
                else:
                    hint = f"; valid keys here: {', '.join(parent.model_fields)}"
        return f"{key}: unknown key{hint}"
    msg = err["msg"].removeprefix("Value error, ")
    if "input" in err and err["type"] not in ("missing",) and not isinstance(err["input"], dict):
        return f"{key}: {msg} (got {err['input']!r})"
    return f"{key}: {msg}"
