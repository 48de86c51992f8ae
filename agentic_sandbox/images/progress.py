"""Build progress: named stages with weights folded into one overall fraction."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

#: Build stages in order, with their share of a typical cold build's wall time.
STAGES: tuple[tuple[str, float], ...] = (
    ("prepare", 0.01),
    ("wheels", 0.02),
    ("debootstrap", 0.62),
    ("customize", 0.04),
    ("runtime", 0.08),
    ("inspect", 0.02),
    ("filesystem", 0.10),
    ("convert", 0.08),
    ("finalize", 0.03),
)
STAGE_NAMES = tuple(name for name, _ in STAGES)


@dataclass(frozen=True)
class Progress:
    """One progress report.

    `fraction` is the whole build's progress in [0, 1] (monotonic); `stage_fraction` is the
    current stage's. `stage` is one of STAGE_NAMES, or `cached` / `done` / `import`.
    """

    stage: str
    fraction: float
    message: str
    stage_fraction: float = 0.0
    elapsed_s: float = 0.0


ProgressCallback = Callable[[Progress], None]


class ProgressTracker:
    """Turns (stage, stage fraction, message) into Progress reports for a callback."""

    def __init__(
        self, callback: ProgressCallback | None, stages: tuple[tuple[str, float], ...] = STAGES
    ) -> None:
        self.callback = callback
        total = sum(w for _, w in stages) or 1.0
        self._start: dict[str, float] = {}
        self._weight: dict[str, float] = {}
        acc = 0.0
        for name, w in stages:
            self._start[name] = acc / total
            self._weight[name] = w / total
            acc += w
        self._t0 = time.monotonic()
        self._last = 0.0
        self.stage = stages[0][0] if stages else "prepare"

    def report(self, stage: str, stage_fraction: float, message: str) -> None:
        self.stage = stage
        sf = min(1.0, max(0.0, stage_fraction))
        if stage in self._start:
            overall = self._start[stage] + self._weight[stage] * sf
        else:
            overall = 1.0 if stage in ("done", "cached") else self._last
        overall = max(self._last, min(1.0, overall))
        self._last = overall
        if self.callback is None:
            return
        try:
            self.callback(
                Progress(
                    stage=stage,
                    fraction=round(overall, 4),
                    message=message,
                    stage_fraction=round(sf, 4),
                    elapsed_s=round(time.monotonic() - self._t0, 2),
                )
            )
        except Exception:  # a broken callback must not break the build
            pass


class DebootstrapProgress:
    """Estimates debootstrap's progress from its `I: <Verb> <package>...` lines.

    Phases (retrieve, validate, extract, unpack, configure) get fixed shares; within a phase the
    count of lines seen against the number of packages retrieved gives the position.
    """

    PHASES: tuple[tuple[str, float], ...] = (
        ("Retrieving", 0.25),
        ("Validating", 0.05),
        ("Extracting", 0.10),
        ("Unpacking", 0.25),
        ("Configuring", 0.35),
    )

    def __init__(self, report: Callable[[float, str], None], expected_packages: int = 200):
        self._report = report
        self._expected = expected_packages
        self._counts: dict[str, int] = {name: 0 for name, _ in self.PHASES}
        self._phase_index = -1

    def feed(self, line: str) -> None:
        if not line.startswith("I: "):
            return
        words = line[3:].split()
        if not words:
            return
        verb = words[0]
        names = [name for name, _ in self.PHASES]
        if verb not in names:
            if verb in ("Resolving", "Checking", "Found", "Base"):
                self._report(0.0, line[3:].strip())
            return
        if (
            verb in ("Retrieving", "Validating")
            and len(words) > 1
            and words[1]
            in (
                "InRelease",
                "Packages",
                "Release",
            )
        ):
            return
        idx = names.index(verb)
        self._phase_index = max(self._phase_index, idx)
        self._counts[verb] += 1
        known = max(self._counts["Retrieving"], self._counts["Validating"])
        total = self._expected if verb in ("Retrieving", "Validating") else known
        if verb == "Extracting":
            total = max(1, known // 2)  # only the required set is extracted first
        within = min(1.0, self._counts[verb] / max(total, 1))
        base = sum(w for _, w in self.PHASES[:idx])
        self._report(base + self.PHASES[idx][1] * within, line[3:].strip())
