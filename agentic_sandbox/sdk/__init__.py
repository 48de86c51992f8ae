"""The Python SDK of agentic-sandbox: a typed client for the admin API (sync and async).

    from agentic_sandbox import Client

    with Client() as sbx:                      # the local server and its admin token
        inst = sbx.instances.wait_ready(sbx.instances.create("dev-1", loadout="minimal"))
        s = sbx.sessions.create("dev-1", ["bash", "-lc", "uname -a"])
        with sbx.sessions.attach(s.id, from_offset=0) as term:
            for offset, data in term:
                print(data.decode(), end="")

`AsyncClient` is the same with `await` (and `async for` over attachments and event streams).
Refusals raise the exceptions below, built from the server's problem+json.
"""

from agentic_sandbox.sdk.attach import Attachment as AsyncAttachment
from agentic_sandbox.sdk.attach import NotController, Resync
from agentic_sandbox.sdk.client import AsyncClient
from agentic_sandbox.sdk.contexts import Contexts, Credentials, UnknownContext
from agentic_sandbox.sdk.errors import (
    ApiError,
    ConfigError,
    Conflict,
    ConnectionFailed,
    Forbidden,
    NotFound,
    OperationFailed,
    RateLimited,
    SandboxError,
    ServerError,
    SignatureInvalid,
    Unauthorized,
    Unavailable,
    ValidationFailed,
)
from agentic_sandbox.sdk.files import TransferFailed
from agentic_sandbox.sdk.models import (
    Agent,
    ApiKey,
    AuditEntry,
    AuditPage,
    Console,
    CreatedApiKey,
    CreatedToken,
    Download,
    EnrollmentToken,
    Event,
    EventPage,
    ExecResult,
    FileInfo,
    FileList,
    Host,
    HostInstance,
    Image,
    Instance,
    Loadout,
    LoadoutActivated,
    LoadoutSaved,
    LoadoutVersion,
    LoadoutVersions,
    Operation,
    Output,
    Pool,
    Removed,
    Screen,
    Secret,
    Session,
    SessionExit,
    Snapshot,
    SubmittedTask,
    Task,
    TaskDetail,
    TaskPage,
    Token,
    Upload,
    VerifiedCard,
    WhoAmI,
)
from agentic_sandbox.sdk.sync import Attachment, Client
from agentic_sandbox.sdk.tasks import TaskLog

__all__ = [
    "Agent",
    "ApiError",
    "ApiKey",
    "AsyncAttachment",
    "AsyncClient",
    "Attachment",
    "AuditEntry",
    "AuditPage",
    "Client",
    "ConfigError",
    "Conflict",
    "ConnectionFailed",
    "Console",
    "Contexts",
    "CreatedApiKey",
    "CreatedToken",
    "Credentials",
    "Download",
    "EnrollmentToken",
    "Event",
    "EventPage",
    "ExecResult",
    "FileInfo",
    "FileList",
    "Forbidden",
    "Host",
    "HostInstance",
    "Image",
    "Instance",
    "Loadout",
    "LoadoutActivated",
    "LoadoutSaved",
    "LoadoutVersion",
    "LoadoutVersions",
    "NotController",
    "NotFound",
    "Operation",
    "OperationFailed",
    "Output",
    "Pool",
    "RateLimited",
    "Removed",
    "Resync",
    "SandboxError",
    "Screen",
    "Secret",
    "ServerError",
    "Session",
    "SessionExit",
    "SignatureInvalid",
    "Snapshot",
    "SubmittedTask",
    "Task",
    "TaskDetail",
    "TaskLog",
    "TaskPage",
    "Token",
    "TransferFailed",
    "Unauthorized",
    "Unavailable",
    "UnknownContext",
    "Upload",
    "ValidationFailed",
    "VerifiedCard",
    "WhoAmI",
]
