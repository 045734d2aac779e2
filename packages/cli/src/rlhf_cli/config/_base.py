"""The base of every configuration section: strict, typed, documented by attribute docstrings."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["Section"]


class Section(BaseModel):
    """A namespace of the configuration tree. Unknown keys are errors; each field's docstring is its
    ``--help`` line."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
        frozen=False,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,  # a field named after a Python keyword (``async_``) is ``async`` outside
    )
