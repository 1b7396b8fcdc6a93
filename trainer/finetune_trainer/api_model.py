"""The base of every API object (the spec's sections, the trainer config, an objective's
settings): a module of its own so that an objective's settings (objectives/<name>/settings.py)
and config.py, which composes them, import it without importing each other."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class ApiModel(BaseModel):
    """Base of every API object: camelCase on the wire, unknown fields refused."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
    )

    def to_dict(self) -> dict[str, Any]:
        """The wire form: camelCase keys, unset optional fields left out."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


def section(cls: type[ApiModel]) -> Any:
    """A sub-object that is always present; `default: {}` lets the API server fill it in."""
    return Field(default_factory=cls, json_schema_extra={"default": {}})
