"""``OOMReport``: the figures of one out-of-memory message, as ``parse_oom`` reads them.

A record and nothing else, so that the readers (``oom_pytorch``, ``oom_runtimes``) and ``oom`` can all use it
without importing one another. Import it from ``oommagic.oom``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


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

    def to_json(self) -> dict:
        data = asdict(self)
        data["other_processes"] = [list(p) for p in self.other_processes]
        return data

    @classmethod
    def from_json(cls, data: dict) -> OOMReport:
        data = dict(data)
        data["other_processes"] = tuple(tuple(p) for p in data.get("other_processes", ()))
        return cls(**data)
