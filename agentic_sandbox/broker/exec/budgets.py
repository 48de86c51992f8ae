"""The budget of one exec: the request's values within the loadout's defaults and ceilings,
checked against what the instance's agent can enforce.

- Each field: the request's value if given (422 `body.budget.<field>` above the ceiling), else
  the loadout's default, else its ceiling, else no limit.
- The loadout: the instance record's `spec.budgets` (written when the instance was created
  from its loadout), else the named loadout in the server's catalog, else the built-in budgets
  (a 600 s timeout, a 1 day ceiling).
- A limit the agent cannot enforce (no cgroups, no such controller: `BudgetSupport` from its
  registration) is refused with 422 naming the field and the agent's reason — never run
  unenforced.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from agentic_sandbox.broker.agentlink import BudgetSpec
from agentic_sandbox.broker.exec.models import BudgetIn, BudgetOut
from agentic_sandbox.broker.http.problems import ProblemError
from agentic_sandbox.provision import Budgets, LoadoutCatalog, LoadoutError

FIELDS = ("timeout_seconds", "memory_mib", "cpus", "pids", "output_bytes")
#: what the agent calls each field in `BudgetSupport.budgets` / `StreamError.field`
AGENT_NAMES = {
    "timeout_seconds": "timeout",
    "memory_mib": "memory",
    "cpus": "cpu",
    "pids": "pids",
    "output_bytes": "output_bytes",
}


def _field_problem(name: str, message: str) -> ProblemError:
    where = f"body.budget.{name}"
    return ProblemError(
        422,
        f"{where}: {message}",
        errors=[{"field": where, "message": message, "type": "value"}],
    )


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


def resolve(asked: BudgetIn, budgets: Budgets) -> BudgetOut:
    values: dict[str, Any] = {}
    for name in FIELDS:
        try:
            values[name] = budgets.effective(name, getattr(asked, name))
        except ValueError as exc:
            raise _field_problem(name, str(exc)) from None
    return BudgetOut(**values)


def check_support(
    budget: BudgetOut, enforcement: str, supported: tuple[str, ...], problem: str, instance: str
) -> None:
    for name in FIELDS:
        if getattr(budget, name) is None or AGENT_NAMES[name] in supported:
            continue
        why = problem or f"its budget enforcement is {enforcement or 'unknown'}"
        raise _field_problem(name, f"the agent of {instance} cannot enforce this budget ({why})")


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
