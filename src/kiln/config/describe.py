"""What the schema says of each config key, in the words of its YAML: type, bounds, default, docstring.

`kiln train --help-config` (describe_fields) and the documentation's config reference page (kiln.docs_ref)
are both drawn from here, so a field is documented once: in the docstring under its declaration.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Iterator
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from kiln.config.run import RunConfig

_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))


class Key(NamedTuple):
    """One key of a section: its dotted name (an entry's own name inside a list of entries), its field, and
    the section it holds with how it holds it ('one', 'optional': a section or null, 'list': a list of
    entries), or (None, '') for a value."""

    name: str
    field: FieldInfo
    section: type[BaseModel] | None
    how: str


def section_of(ann: Any) -> tuple[type[BaseModel] | None, str]:
    """The section class a field's annotation holds, and how ('one', 'optional', 'list'); (None, '') for a
    value."""
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


def keys(cls: type[BaseModel], prefix: str = "") -> Iterator[Key]:
    """The keys of one section, in declaration order (those of the sections it holds are not expanded)."""
    for name, field in cls.model_fields.items():
        section, how = section_of(field.annotation)
        yield Key(f"{prefix}{name}", field, section, how)


def type_name(ann: Any, quote: str = "") -> str:
    """A field's type as YAML sees it: `int or null`, its literal choices (each between `quote`s: `cosine`,
    `wsd` or `constant`), `list of str`."""
    alternatives = _alternatives(ann, quote)
    return alternatives[0] if len(alternatives) == 1 else ", ".join(alternatives[:-1]) + " or " + alternatives[-1]


def _alternatives(ann: Any, quote: str) -> list[str]:
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if ann is type(None):
        return ["null"]
    if origin is Annotated:  # a type with limits of its own (list[Annotated[float, Field(ge=0)]])
        limits = ", ".join(_limits(m) for m in args[1:] if _limits(m))
        return [f"{x} {limits}".rstrip() for x in _alternatives(args[0], quote)]
    if origin is Literal:
        return [f"{quote}{a if isinstance(a, str) else json.dumps(a)}{quote}" for a in args]
    if origin in (typing.Union, types.UnionType):  # the choices of every member, null last
        return [x for a in args if a is not type(None) for x in _alternatives(a, quote)] + ["null"] * (
            type(None) in args)
    if origin is list:
        return [f"list of {'entries' if section_of(ann)[0] else type_name(args[0], quote)}" if args else "list"]
    if origin is dict:
        return [f"mapping of {type_name(args[0], quote)} to {type_name(args[1], quote)}" if args else "mapping"]
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ["section"]
    return [getattr(ann, "__name__", str(ann).replace("typing.", ""))]


def bounds(field: FieldInfo) -> str:
    """The limits a field's value must keep, as `>= 1, <= 2147483648` ('' for none)."""
    return ", ".join(filter(None, (_limits(c) for c in field.metadata)))


def _limits(constraint: Any) -> str:
    """`>= 0` of one constraint (annotated_types' Ge(0), or a Field(ge=0) inside an Annotated)."""
    if isinstance(constraint, FieldInfo):
        return ", ".join(filter(None, (_limits(c) for c in constraint.metadata)))
    return ", ".join(f"{op} {getattr(constraint, attr)}" for attr, op in _BOUNDS if hasattr(constraint, attr))


def default_text(field: FieldInfo) -> str:
    """A field's default as YAML writes it (`null`, `true`, `["@stdlib"]`); 'section' for a section."""
    if field.default is PydanticUndefined:
        if field.default_factory is None:
            return "required"
        value = field.default_factory()  # type: ignore[call-arg]
    else:
        value = field.default
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value or '""'
    if isinstance(value, BaseModel):
        return "section"
    if isinstance(value, list | tuple | dict):
        return json.dumps(value)
    return repr(value)


def describe_fields() -> str:
    """Every config key with its type, default and doc, for `kiln train --help-config`."""
    lines = []
    for top in keys(RunConfig):
        lines.append(f"{top.name}: {top.field.description or ''}")
        lines += _describe(top.section, f"{top.name}.", "  ")  # type: ignore[arg-type]
    return "\n".join(lines)


def _describe(cls: type[BaseModel], prefix: str, indent: str) -> list[str]:
    lines = []
    for key in keys(cls, prefix):
        facts = [type_name(key.field.annotation), bounds(key.field)]
        if key.field.is_required():
            facts.append("required")
        elif key.how != "one":  # a section's default is its keys' defaults, listed below it
            facts.append(f"default {default_text(key.field)}")
        doc = " ".join((key.field.description or "").split())
        lines.append(f"{indent}{key.name} ({', '.join(filter(None, facts))}): {doc}")
        if key.section is not None:  # its keys below it; a list's entries by their own names
            lines += _describe(key.section, "" if key.how == "list" else f"{key.name}.", indent + "  ")
    return lines
