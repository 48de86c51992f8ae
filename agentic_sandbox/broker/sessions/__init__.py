"""PTY sessions: the hub, the attach WebSocket, recordings (see contract.py).

Public face: the contract (`SessionService`, `SessionSpec`, `OutputChunk`, `ExitStatus`,
`RunUsage`, `Prompt` and the errors), run budgets (`resolve_budget` and its helpers:
resolution within a loadout's defaults and ceilings, shared by exec, sessions and task runs;
`BudgetIn`, `BudgetOut`, `BudgetInvalid`) and `SessionsComponent` (wired in `broker/components.py`).
"""

from agentic_sandbox.broker.sessions.budgets import (
    BudgetIn,
    BudgetInvalid,
    BudgetOut,
    instance_budgets,
    loadout_budgets,
)
from agentic_sandbox.broker.sessions.budgets import agent_spec as agent_budget_spec
from agentic_sandbox.broker.sessions.budgets import check_support as check_budget_support
from agentic_sandbox.broker.sessions.budgets import request_field as budget_request_field
from agentic_sandbox.broker.sessions.budgets import resolve as resolve_budget
from agentic_sandbox.broker.sessions.budgets import to_spec as budget_spec
from agentic_sandbox.broker.sessions.contract import (
    AgentUnavailable,
    BudgetSupport,
    ExitStatus,
    OutputChunk,
    Prompt,
    PromptListener,
    RunUsage,
    SessionEnded,
    SessionError,
    SessionNotFound,
    SessionService,
    SessionSpec,
)

__all__ = [
    "AgentUnavailable",
    "BudgetIn",
    "BudgetInvalid",
    "BudgetOut",
    "BudgetSupport",
    "ExitStatus",
    "OutputChunk",
    "Prompt",
    "PromptListener",
    "RunUsage",
    "SessionEnded",
    "SessionError",
    "SessionNotFound",
    "SessionService",
    "SessionSpec",
    "agent_budget_spec",
    "budget_request_field",
    "budget_spec",
    "check_budget_support",
    "instance_budgets",
    "loadout_budgets",
    "resolve_budget",
]
