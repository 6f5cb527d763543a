"""What the trials of a plan or a search kept and put back, as the plan's summary says it: the objects
by name, the rest counted by kind, the files by name, and what could not be kept or differs after the
restore, by name. Never a blanket sentence: only what the snapshot held."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..sizes import format_bytes

# Things named in the sentence before "and N more".
_SHOWN = 14


@dataclass(frozen=True)
class Restored:
    """``kept``: what the snapshot held ("model", "opt (AdamW)", "2 tensors"); ``files``: the files the
    trials wrote and were put back; ``not_kept``: "path (why)"; ``differs``: what a check after a restore
    found not as kept; ``snapshot``: False under ``--no-snapshot``."""

    kept: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    not_kept: tuple[str, ...] = ()
    differs: tuple[str, ...] = ()
    nbytes: int = 0
    snapshot: bool = True

    def merged(self, other: Restored) -> Restored:
        """Both trials' records: what either kept, wrote or missed."""

        def union(a: tuple, b: tuple) -> tuple:
            return tuple(dict.fromkeys(a + b))

        return Restored(
            kept=union(self.kept, other.kept),
            files=union(self.files, other.files),
            not_kept=union(self.not_kept, other.not_kept),
            differs=union(self.differs, other.differs),
            nbytes=max(self.nbytes, other.nbytes),
            snapshot=self.snapshot and other.snapshot,
        )

    def sentence(self) -> str:
        """One sentence for the plan's summary, ending with a full stop."""
        files = ""
        if self.files:
            names = ", ".join(os.path.basename(f) for f in self.files[:3])
            more = f" and {len(self.files) - 3} more" if len(self.files) > 3 else ""
            files = f"{len(self.files)} file{'s' if len(self.files) != 1 else ''} ({names}{more})"
        if not self.snapshot:
            text = "trials ran with --no-snapshot: what they changed in the namespace remains"
            return text + (f"; {files} put back." if files else ".")
        parts = [*self.kept, "the global RNGs", *([files] if files else [])]
        shown = ", ".join(parts[:_SHOWN]) + (
            f" and {len(parts) - _SHOWN} more" if len(parts) > _SHOWN else ""
        )
        text = f"restored after each trial: {shown}"
        if self.nbytes:
            text += f" ({format_bytes(self.nbytes)} kept in host memory)"
        if self.not_kept:
            text += f"; not restored: {', '.join(self.not_kept[:3])}"
        if self.differs:
            text += f"; not as before after the restore: {', '.join(self.differs[:3])}"
        return text + "."
