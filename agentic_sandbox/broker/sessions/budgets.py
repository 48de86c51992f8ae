"""The budget of one run — an exec, a PTY session, a task run: the request's values within the
loadout's defaults and ceilings, checked against what the instance's agent can enforce.

One place for all three (exec and tasks sit above sessions and take it from the sessions face).

- Each field: the request's value if given (422 `<where>.<field>` above the ceiling, `where`
  being `body.budget` for the admin API), else the loadout's default, else its ceiling, else no
  limit. An interactive session is the one exception: its wall-clock timeout is only what its
  request asks for (within the ceiling) — a terminal is not given the runs' default timeout.
- The loadout: the instance record's `spec.budgets` (written when the instance was created
  from its loadout), else the named loadout in the server's catalog, else the built-in budgets
  (a 600 s timeout, a 1 day ceiling).
- A limit the agent cannot enforce (no cgroups, no such controller: `BudgetSupport` from its
  registration) is refused with 422 naming the field and the agent's reason — never run
  unenforced.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError

from agentic_sandbox.broker.agentlink import BudgetSpec
from agentic_sandbox.broker.http.problems import ProblemError
from agentic_sandbox.broker.http.schemas import Input, Output
from agentic_sandbox.broker.store import Database
from agentic_sandbox.broker.store import models as m
from agentic_sandbox.provision import Budgets, LoadoutCatalog, LoadoutError


class BudgetIn(Input):
    """Lower (never raise past the loadout's ceiling) what the run may use; unset fields take
    the loadout's defaults."""

    timeout_seconds: float | None = Field(default=None, gt=0, le=7 * 86400)
    memory_mib: int | None = Field(default=None, ge=4, le=4 * 1024 * 1024)
    cpus: float | None = Field(default=None, ge=0.01, le=1024, description="CPU quota")
    pids: int | None = Field(default=None, ge=1, le=4_194_304, description="processes+threads")
    output_bytes: int | None = Field(
        default=None, ge=1, le=1024**4, description="output bytes the run may write"
    )


class BudgetOut(Output):
    """The budget a run had (null: no limit)."""

    timeout_seconds: float | None
    memory_mib: int | None
    cpus: float | None
    pids: int | None
    output_bytes: int | None

    @property
    def limited(self) -> bool:
        return any(getattr(self, name) is not None for name in FIELDS)


class BudgetInvalid(ProblemError):
    """A budget field above its ceiling, or one the agent cannot enforce (422 naming it)."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(
            422,
            f"{where}: {message}",
            errors=[{"field": where, "message": message, "type": "value"}],
        )
        self.field = where
        self.message = message


FIELDS = ("timeout_seconds", "memory_mib", "cpus", "pids", "output_bytes")
#: what the agent calls each field in `BudgetSupport.budgets` / `StreamError.field`
AGENT_NAMES = {
    "timeout_seconds": "timeout",
    "memory_mib": "memory",
    "cpus": "cpu",
    "pids": "pids",
    "output_bytes": "output_bytes",
}


def _field_problem(name: str, message: str, where: str = "body.budget") -> BudgetInvalid:
    return BudgetInvalid(f"{where}.{name}", message)


def instance_budgets(
    spec: dict[str, Any] | None, loadout: str | None, catalog: LoadoutCatalog | None
) -> Budgets:
    recorded = (spec or {}).get("budgets")
    if isinstance(recorded, dict):
        try:
            return Budgets.model_validate(recorded)
        except ValidationError:
            pass
    if loadout and catalog is not None:
        try:
            return catalog.resolve(loadout).budgets
        except (LoadoutError, KeyError):
            pass
    return Budgets()


async def loadout_budgets(db: Database, instance: m.Instance) -> Budgets:
    """An instance's budgets without the server's catalog: its record's (written at create),
    else the exact loadout version it was made from, else the built-in ones."""
    recorded = (instance.spec or {}).get("budgets")
    if isinstance(recorded, dict) or not (instance.loadout and instance.loadout_version):
        return instance_budgets(instance.spec, None, None)
    async with db.session() as s:
        version = await s.get(m.LoadoutVersion, (instance.loadout, instance.loadout_version))
    resolved = version.resolved if version is not None else None
    return instance_budgets(resolved if isinstance(resolved, dict) else None, None, None)


def resolve(
    asked: BudgetIn, budgets: Budgets, *, where: str = "body.budget", interactive: bool = False
) -> BudgetOut:
    values: dict[str, Any] = {}
    for name in FIELDS:
        value = getattr(asked, name)
        try:
            values[name] = budgets.effective(name, value)
        except ValueError as exc:
            raise _field_problem(name, str(exc), where) from None
        if interactive and name == "timeout_seconds" and value is None:
            values[name] = None
    return BudgetOut(**values)


def check_support(
    budget: BudgetOut,
    enforcement: str,
    supported: tuple[str, ...],
    problem: str,
    instance: str,
    *,
    where: str = "body.budget",
) -> None:
    for name in FIELDS:
        if getattr(budget, name) is None or AGENT_NAMES[name] in supported:
            continue
        why = problem or f"its budget enforcement is {enforcement or 'unknown'}"
        raise _field_problem(
            name, f"the agent of {instance} cannot enforce this budget ({why})", where
        )


def agent_spec(budget: BudgetOut) -> BudgetSpec | None:
    """A session's budget for the agent: None when it has no limit at all (no cgroup)."""
    return to_spec(budget) if budget.limited else None


def to_spec(budget: BudgetOut) -> BudgetSpec:
    return BudgetSpec(
        timeout_ms=int(budget.timeout_seconds * 1000) if budget.timeout_seconds else 0,
        memory_bytes=(budget.memory_mib or 0) * 1024 * 1024,
        cpu_millis=round(budget.cpus * 1000) if budget.cpus else 0,
        pids=budget.pids or 0,
        output_bytes=budget.output_bytes or 0,
    )


def request_field(agent_field: str) -> str:
    """`budget.memory` (the agent's word) → `body.budget.memory_mib`."""
    if agent_field.startswith("budget."):
        short = agent_field.removeprefix("budget.")
        for name, agent_name in AGENT_NAMES.items():
            if agent_name == short:
                return f"body.budget.{name}"
        return "body.budget"
    return f"body.{agent_field}" if agent_field else "body"
