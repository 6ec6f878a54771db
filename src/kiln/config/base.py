"""What every config section shares: unknown keys are errors, fields carry their docs, a validated section
is frozen, and the checks across a section's fields (`problems()`) can be deferred so that `load_config`
reports every problem of a config at once."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationInfo, model_validator

# a problem found by a cross-field check: (the fields it involves, relative to the section; the message)
Problem = tuple[tuple[str, ...], str]
DEFER = "kiln_defer_checks"  # validation context key: skip the cross-field checks (load_config runs them)


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, docstrings are the docs. Frozen: a
    validated config is never changed in place; `derive()` makes a new one."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    def problems(self) -> list[Problem]:
        """Every inconsistency between this section's fields (their single values are already valid)."""
        return []

    @model_validator(mode="after")
    def _check_problems(self, info: ValidationInfo) -> Section:
        if not (info.context or {}).get(DEFER):
            found = self.problems()
            if found:
                raise ValueError("; ".join(msg for _, msg in found))
        return self


def not_blank(cls: type[Section], value: Any, info: ValidationInfo) -> Any:
    """A text field that names something (a field, a directory, a token) given as '' or spaces (an unset shell
    variable, `data.cache_dir=$CACHE`) is refused: read as it is, it would silently mean the current directory, or
    a token made of nothing. Use as `field_validator(...)(not_blank)`."""
    if isinstance(value, str) and not value.strip():
        default = cls.model_fields[info.field_name].default
        default = "null" if default is None else repr(default)
        raise ValueError(f"empty; give a value, or leave the key out for its default ({default})")
    return value


def _not_empty_source(value: str) -> str:
    if not value.strip():
        raise ValueError("an empty source (it would read the current directory); name a file, directory, glob or URL")
    return value


Source = Annotated[str, AfterValidator(_not_empty_source)]  # an entry of data.sources
