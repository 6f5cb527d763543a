"""``RunSpec``: what one execution of a cell runs — the source, the options, the fixes in force."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..diagnosis.findings import Remedy
from ..options import Options


@dataclass(frozen=True)
class RunSpec:
    """What to run: the source (with the rewrites of ``applied`` in it), the options, the fixes in force
    in the order they were applied, and where the run belongs in the notebook."""

    source: str
    options: Options = field(default_factory=Options)
    applied: tuple[Remedy, ...] = ()
    cell_id: str | None = None
    execution_count: int | None = None
    parent: str | None = None
    original: str | None = None  # the cell as the person wrote it (None: ``source``)

    @property
    def written(self) -> str:
        return self.source if self.original is None else self.original
