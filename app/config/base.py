"""The strict base every config section derives from."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    # attribute docstrings become field descriptions: the JSON schema and chat-ops show them
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)
