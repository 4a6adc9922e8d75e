"""The base of every recipe section (specdistill/recipe.py and each draft kind's own section in
specdistill/kinds/): unknown keys refused, types strict, assignments validated."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)
