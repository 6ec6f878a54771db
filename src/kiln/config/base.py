"""What every config section shares: unknown keys are errors, fields carry their docs, a validated section
is frozen, and the checks across a section's fields (`problems()`) can be deferred so that `load_config`
reports every problem of a config at once."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationInfo, model_validator

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
