"""``OOMReport``: the figures of one out-of-memory message, as ``parse_oom`` reads them.

A record and nothing else, so that the readers (``oom_pytorch``, ``oom_runtimes``) and ``oom`` can all use it
without importing one another. Import it from ``oommagic.oom``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..sizes import plausible_bytes

# The fields that hold bytes: a value no device can hold (a misread, or a message cut into a longer number)
# is not known, rather than a headline of 10^38 bytes.
BYTE_FIELDS = (
    "requested",
    "capacity",
    "free",
    "allocated",
    "reserved",
    "reserved_unallocated",
    "process_used",
    "limit",
)


@dataclass(frozen=True)
class OOMReport:
    """The figures of one out-of-memory message. Bytes as ``int``; ``None`` where the message does not say."""

    text: str
    device: str | None = None
    gpu_index: int | None = None
    requested: int | None = None
    capacity: int | None = None
    free: int | None = None
    allocated: int | None = None
    reserved: int | None = None
    reserved_unallocated: int | None = None
    process_used: int | None = None
    other_processes: tuple[tuple[int, int], ...] = field(default_factory=tuple)
    limit: int | None = None
    source: str = "allocator"
    emulated: bool = False
    # Serving engines (vLLM) count the KV cache in tokens: the sequence length asked for and what fits.
    tokens_requested: int | None = None
    tokens_capacity: int | None = None

    def __post_init__(self) -> None:
        for name in BYTE_FIELDS:
            value = getattr(self, name)
            if value is not None and plausible_bytes(value) is None:
                object.__setattr__(self, name, None)
        others = tuple((pid, n) for pid, n in self.other_processes if plausible_bytes(n) is not None)
        if len(others) != len(self.other_processes):
            object.__setattr__(self, "other_processes", others)

    def to_json(self) -> dict:
        data = asdict(self)
        data["other_processes"] = [list(p) for p in self.other_processes]
        return data

    @classmethod
    def from_json(cls, data: dict) -> OOMReport:
        data = dict(data)
        data["other_processes"] = tuple(tuple(p) for p in data.get("other_processes", ()))
        return cls(**data)
