"""Human-in-the-loop prompt detection: output that waits for a person.

A prompt is recognised when output *stops* on a line that looks like a question for a person
(`(y/n)`, `[Y/n]`, `(yes/no)`, `Are you sure`, `Press ENTER`, `Password:` …). Detection runs
only after the session has been quiet for a short while (the hub's timer), on the last line of
the output tail after stripping ANSI sequences and control characters — so a flood costs
nothing here, and a line that scrolls past is not a prompt.
"""

from __future__ import annotations

import re

ANSI_RE = re.compile(
    rb"\x1b\[[0-?]*[ -/]*[@-~]"  # CSI
    rb"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"  # OSC
    rb"|\x1b[PX^_][^\x1b]*(?:\x1b\\)?"  # DCS, SOS, PM, APC
    rb"|\x1b[()*+][0-9A-Za-z]"  # charset designation
    rb"|\x1b[@-Z\\-_=>78]"  # two-byte sequences
)
CONTROL_RE = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")

PROMPT_RE = re.compile(
    r"""(
        [(\[]\s*y(?:es)?\s*/\s*n(?:o)?\s*[)\]]        # (y/n) [Y/n] (yes/no) [yes/No]
      | [(\[]\s*n(?:o)?\s*/\s*y(?:es)?\s*[)\]]        # [n/Y]
      | \bare\s+you\s+sure\b
      | \bpress\s+(?:enter|return|any\s+key)\b
      | \bpass(?:word|phrase)(?:\s+for\s+[^:]{1,64})?\s*:\s*$
      | \bdo\s+you\s+want\s+to\s+(?:continue|proceed)\b
      | \b(?:continue|proceed|overwrite|replace)\s*\?\s*$
      | \byes\s+or\s+no\b
      | \btype\s+['"]?yes['"]?\s+to\s+(?:continue|confirm)\b
    )""",
    re.IGNORECASE | re.VERBOSE,
)

TAIL_BYTES = 2048
MAX_PROMPT_CHARS = 300


def strip_ansi(data: bytes) -> str:
    return CONTROL_RE.sub(b"", ANSI_RE.sub(b"", data)).decode("utf-8", "replace")


def last_line(tail: bytes) -> str:
    """The text the cursor sits on at the end of `tail` ('' when output ended with a newline)."""
    text = strip_ansi(tail)
    line = text.rsplit("\n", 1)[-1]
    parts = [p for p in line.split("\r") if p.strip()]
    return parts[-1].strip()[-MAX_PROMPT_CHARS:] if parts else ""


def detect_prompt(tail: bytes) -> str | None:
    """The prompt line if output ends on one, else None."""
    line = last_line(tail)
    if line and PROMPT_RE.search(line):
        return line
    return None
