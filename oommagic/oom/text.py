"""Out-of-memory text as the readers see it: cleaned, re-joined, and the pattern pieces they are built from.

``Page`` strips ANSI colours, log prefixes and quote marks line by line, then joins the lines with nothing
between them, so a message wrapped anywhere (even mid-word) reads as one line again; ``words`` and ``SIZE``
build patterns that allow optional whitespace wherever the original had a space. Pure: no torch, no IPython.
"""

from __future__ import annotations

import bisect
import re

from ..sizes import REPORTED_UNITS, reported_bytes


def words(phrase: str) -> str:
    """A phrase as a pattern: literal words, any whitespace (or none, where a wrap ate the space) between."""
    return r"\s*".join(re.escape(word) for word in phrase.split())


# Longest first, so that "GiB" is not read as XLA's one-letter "G". No word boundary after it: a wrap that
# ate the space glues the next word on ("10.51Gat the bottom").
_UNIT = "|".join(sorted(REPORTED_UNITS, key=len, reverse=True))
# A printed size. Digit runs are capped so that a number can neither blow up the arithmetic nor make a
# failed match re-scan a long run of digits.
SIZE = r"(\d{1,30}(?:\.\d{1,30})?)\s*(" + _UNIT + r")"
# For patterns that start with the size: not in the middle of a number ("2.80" but not its "80").
LEAD = r"(?<!\d)(?<!\d\.)"

_ANSI = re.compile(r"\x1b(?:\[[0-?]{0,40}[ -/]{0,5}[@-~]|\][^\x07\x1b\n]{0,300}(?:\x07|\x1b\\)|[@-Z\\-_])?")
# Colour codes whose escape character was lost on the way (GitHub, some CI logs): "[36m(pid=1)[0m".
_ANSI_ORPHAN = re.compile(r"\[\d{1,3}(?:;\d{1,3}){0,4}m")
# One leading decoration of a line; stripped repeatedly. Each alternative is anchored and bounded, and eats at
# most one space after itself, so that what is left shows whether the line had content, only spaces (a wrapped
# run of spaces: the message goes on) or nothing (a paragraph break).
_PREFIX = re.compile(
    r"""[ \t]*(?:
        >+                                                         # markdown or e-mail quote
      | \[\s*rank\s*\d{1,6}\s*\]:?                                 # torchrun: [rank0]:
      | \[?\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d{1,9})?(?:Z|[+-]\d\d:?\d\d)?\]?:?   # ISO time
      | \d\d-\d\d[ ]\d\d:\d\d:\d\d(?:\.\d{1,9})?                   # vLLM: 03-13 09:00:43
      | [IWEFD]\d{4}[ ]\d\d:\d\d:\d\d(?:\.\d{1,9})?(?:[ ]+\d{1,9})?   # glog: E0323 21:57:08.583 23
      | \d\d:\d\d:\d\d(?:[.,]\d{1,9})?:?                           # bare time
      | \d{1,4}\.\d\d\.\d{3}\.\d{3}[ ]+[IWEFDT](?=[ ])                # llama.cpp server: 1.06.520.077 E
      | \#{1,6}(?=[ \t])                                           # markdown heading, shell or Python comment
      | (?:ERROR|WARNING|WARN|INFO|DEBUG|CRITICAL|FATAL|TRACE)(?::[\w.]{0,40}:|:|\b)   # levels, ERROR:root:
      | \((?:\w{1,40}[ ]+)?[\w.-]{1,40}=[\w.:-]{1,40}(?:,?[ ]+[\w.-]{1,40}=[\w.:-]{1,40}){0,4}\)   # Ray, vLLM
      | \[?[\w./\\:-]{0,200}\.(?:py|cc|cpp|cu|c|h|hpp):\d{1,6}\]   # glog / vLLM source: [core.py:330]
      | [\w.-]{1,40}[ ]+\|(?=[ ])                                  # docker compose: sglang-1  |
    )[ \t]?""",
    re.VERBOSE,
)


class Page:
    """The text, cleaned and with its lines joined; ``flat`` is what the patterns search.

    An empty line, or one that held only a log prefix, is a paragraph break and stays as "\\n", so a message
    never runs on into the next paragraph; a line of spaces is a wrapped run of spaces and is dropped.
    ``breaks`` remembers where line breaks were removed, to give them back in ``OOMReport.text``.
    """

    def __init__(self, text: str) -> None:
        text = _ANSI_ORPHAN.sub("", _ANSI.sub("", text))
        parts: list[str] = []
        self.breaks: list[int] = []
        size = 0
        for raw in text.splitlines():
            line = raw
            for _ in range(12):
                match = _PREFIX.match(line)
                if not match or not match.end():
                    break
                line = line[match.end() :]
            if not line:
                if parts and parts[-1] != "\n":
                    parts.append("\n")
                    size += 1
                continue
            line = line.strip()
            if not line:
                continue
            if parts and parts[-1] != "\n":
                self.breaks.append(size)
            parts.append(line)
            size += len(line)
        self.flat = "".join(parts)

    def text(self, start: int, end: int) -> str:
        """``flat[start:end]`` with its removed line breaks put back."""
        pieces = []
        at = start
        for cut in self.breaks[
            bisect.bisect_right(self.breaks, start) : bisect.bisect_left(self.breaks, end)
        ]:
            pieces.append(self.flat[at:cut])
            at = cut
        pieces.append(self.flat[at:end])
        return "\n".join(pieces).strip()


def matched_bytes(match: re.Match, group: int = 1) -> int:
    """The size that a pattern built with ``SIZE`` matched at ``group`` (number, then unit), in bytes."""
    return reported_bytes(match.group(group), match.group(group + 1))
