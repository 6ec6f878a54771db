"""The config reference page of the documentation, generated from the config schema's own field docstrings.

    python -m kiln.docs_ref             # writes docs/reference/config.md of this source tree
    python -m kiln.docs_ref --check     # exit 1 when that file is not what the schema gives

A field is documented once, in the docstring under its declaration; this page and `kiln train --help-config`
are drawn from it. `tests/unit/test_docs_ref.py` fails while the committed page is stale.
"""

from __future__ import annotations

import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from kiln.config import RunConfig

COMMAND = "python -m kiln.docs_ref"
PAGE = Path("docs") / "reference" / "config.md"

_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))


def _section_of(ann: Any) -> tuple[type[BaseModel] | None, str]:
    """The section class a field holds, and how: 'one' (a section), 'optional' (a section or null), 'list'
    (a list of entries); (None, '') for a value."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann, "one"
    args = typing.get_args(ann)
    if typing.get_origin(ann) is list and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0], "list"
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        found = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if found and all(a is type(None) or a in found for a in args):
            return found[0], "optional"
    return None, ""


def type_name(ann: Any) -> str:
    """A field's type in the words of its YAML: `int or null`, its literal choices, `list of str`."""
    alternatives = _alternatives(ann)
    return alternatives[0] if len(alternatives) == 1 else ", ".join(alternatives[:-1]) + " or " + alternatives[-1]


def _alternatives(ann: Any) -> list[str]:
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if ann is type(None):
        return ["null"]
    if origin is Literal:
        return [f"`{a if isinstance(a, str) else json.dumps(a)}`" for a in args]
    if origin in (typing.Union, types.UnionType):  # the choices of every member, null last
        return [x for a in args if a is not type(None) for x in _alternatives(a)] + ["null"] * (type(None) in args)
    if origin is list:
        return [f"list of {'entries (below)' if _section_of(ann)[0] else type_name(args[0])}" if args else "list"]
    if origin is dict:
        return [f"mapping of {type_name(args[0])} to {type_name(args[1])}" if args else "mapping"]
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ["section (below)"]
    return [getattr(ann, "__name__", str(ann).replace("typing.", ""))]


def bounds(field: FieldInfo) -> str:
    """The numeric limits a field's value must keep, as `>= 1, <= 2147483648`."""
    return ", ".join(f"{op} {getattr(c, attr)}" for c in field.metadata for attr, op in _BOUNDS if hasattr(c, attr))


def default_text(field: FieldInfo) -> str:
    """A field's default as YAML writes it."""
    if field.default is PydanticUndefined:
        if field.default_factory is None:
            return "required"
        value = field.default_factory()  # type: ignore[call-arg]
    else:
        value = field.default
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    if isinstance(value, BaseModel):
        return "(below)"
    if isinstance(value, list | tuple | dict):
        return f"`{json.dumps(value)}`"
    return f"`{value!r}`"


def _cell(text: str) -> str:
    """One line of a table cell: a docstring's line breaks become spaces, its pipes are escaped, and so are
    angle brackets outside code (`<s>` and `<eos>` are tokens, not HTML)."""
    parts = " ".join(text.split()).split("`")
    for i in range(0, len(parts), 2):  # the text between code spans
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts).replace("|", "\\|")


def _table(cls: type[BaseModel], prefix: str) -> list[str]:
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name, f in cls.model_fields.items():
        kind = type_name(f.annotation)
        limits = bounds(f)
        if limits:
            kind = f"{kind}, {limits}"
        rows.append(f"| `{prefix}{name}` | {kind} | {_cell(default_text(f))} | "
                    f"{_cell(f.description or '')} |")
    return rows


def _section(cls: type[BaseModel], key: str, doc: str, depth: int, how: str = "one") -> list[str]:
    lines = [f"{'#' * depth} `{key}`", ""]
    if doc:
        lines += [" ".join(doc.split()), ""]
    if how == "optional":
        lines += ["Null (the default) or a section with these keys:", ""]
    prefix = f"{key}."
    if how == "list":
        lines += ["A list; each entry has these keys:", ""]
        prefix = ""
    lines += _table(cls, prefix) + [""]
    for name, f in cls.model_fields.items():
        sub, sub_how = _section_of(f.annotation)
        if sub is not None:
            lines += _section(sub, f"{key}.{name}", f.description or "", min(depth + 1, 4), sub_how)
    return lines


def config_reference() -> str:
    """The whole page, Markdown."""
    lines = [
        "# Config reference",
        "",
        f"<!-- Generated by `{COMMAND}` from the docstrings of the config schema (src/kiln/config): edit those,",
        "then run it again. tests/unit/test_docs_ref.py fails while this page is stale. -->",
        "",
        "Every key a run's config takes, by section, with its type, default and meaning. Set a key in the YAML",
        "file's section (`train:` then `lr: 3e-4`) or on the command line as a dotted override",
        "(`kiln train my.yaml train.lr=3e-4`); `kiln train --help-config` prints the same list. A preset or a",
        "`model.size` may set other values than these defaults (see [Configs and presets](../configs.md)).",
        "Unknown keys and bad values are reported together, each with its full key path.",
        "",
    ]
    for name, f in RunConfig.model_fields.items():
        cls, how = _section_of(f.annotation)
        assert cls is not None, f"RunConfig.{name} is not a section"
        lines += _section(cls, name, f.description or "", 2, how)
    return "\n".join(lines).rstrip() + "\n"


def source_root() -> Path | None:
    """The repository this package runs from (src/kiln/ inside it), or None for an installed package."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "mkdocs.yml").is_file() else None


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    check = "--check" in args
    args = [a for a in args if a != "--check"]
    if len(args) > 1 or any(a.startswith("-") for a in args):
        print(f"usage: {COMMAND} [--check] [PATH]", file=sys.stderr)
        return 2
    if args:
        path = Path(args[0])
    else:
        root = source_root()
        if root is None:
            print(f"{COMMAND}: no source tree around {Path(__file__).parent} (mkdocs.yml beside src/): "
                  "name the page to write, e.g. docs/reference/config.md", file=sys.stderr)
            return 2
        path = root / PAGE
    text = config_reference()
    if check:
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            return 0
        print(f"{path} is stale: run `{COMMAND}` to write it again", file=sys.stderr)
        return 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
