"""The byte streams' kinds as the rest of the server sees them: plain typed values.

Protobuf stops at the agent link's edge (as `messages.py` for sessions): a component opens a
stream with one of the specs here (`ExecSpec`, `FileUpload`, `PortSpec`, …; `LinkStreams.open`
turns it into the `StreamOpen`), reads the accept's info as a typed value (`ServerStream.started()`:
`ExecStarted`, `FileInfo`, `PortConnected`) and the agent's close as its kind's typed result
(`ServerStream.result()`: `ExecResult`, `FileResult`, `FileInfo`, `FileListing`,
`FileRemoved`, `PortResult`) or a `StreamError`.

The values are mechanical copies: what an agent sends stays untrusted (sizes, strings, paths);
the component decides what it accepts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from agentic_sandbox.proto import agent_pb2 as pb


# ---- exec ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class BudgetSpec:
    """What a run may use (0: no limit)."""

    timeout_ms: int = 0
    memory_bytes: int = 0
    cpu_millis: int = 0  # thousandths of a CPU
    pids: int = 0
    output_bytes: int = 0

    def to_pb(self) -> pb.Budget:  # an exec's and a PTY session's (OpenSession.budget)
        return pb.Budget(
            timeout_ms=self.timeout_ms,
            memory_bytes=self.memory_bytes,
            cpu_millis=self.cpu_millis,
            pids=self.pids,
            output_bytes=self.output_bytes,
        )


@dataclass(slots=True)
class ExecSpec:
    argv: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str = ""
    user: str = ""
    stdin: bool = False  # channel 0 carries stdin
    budget: BudgetSpec = field(default_factory=BudgetSpec)
    egress_token: str = ""  # the run's proxy userinfo (accounting of its egress bytes)


@dataclass(slots=True)
class ExecStarted:
    pid: int
    enforcement: str


@dataclass(slots=True)
class ExecResult:
    code: int | None  # None: a signal ended it (or it never ran)
    signal: str = ""
    reason: str = ""
    duration_us: int = 0
    cpu_us: int = 0
    peak_memory_bytes: int = 0
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    enforcement: str = ""


# ---- files ------------------------------------------------------------------------------------
@dataclass(slots=True)
class FileUpload:
    """Channel 0: the bytes (a tar stream when `directory`); channel `DIGEST`: the SHA-256."""

    path: str
    directory: bool = False
    mode: int | None = None
    owner: str = ""
    group: str = ""
    follow_symlinks: bool = False
    parents: bool = False
    size: int = 0  # announced (0: unknown)


@dataclass(slots=True)
class FileDownload:
    """Channel 1: the bytes (a tar stream for a directory)."""

    path: str
    follow_symlinks: bool = False


@dataclass(slots=True)
class FileStat:
    path: str
    follow_symlinks: bool = False


@dataclass(slots=True)
class FileList:
    path: str
    follow_symlinks: bool = False
    limit: int = 0


@dataclass(slots=True)
class FileMkdir:
    path: str
    parents: bool = False
    mode: int | None = None
    owner: str = ""
    group: str = ""


@dataclass(slots=True)
class FileRemove:
    path: str
    recursive: bool = False


@dataclass(slots=True)
class FileInfo:
    path: str
    name: str
    type: str  # file, directory, symlink, other
    size: int
    mode: int
    uid: int
    gid: int
    owner: str
    group: str
    mtime_ns: int
    link_target: str = ""

    @classmethod
    def from_pb(cls, m: pb.FileInfo) -> FileInfo:
        return cls(
            path=m.path,
            name=m.name,
            type=m.type,
            size=m.size,
            mode=m.mode,
            uid=m.uid,
            gid=m.gid,
            owner=m.owner,
            group=m.group,
            mtime_ns=m.mtime_ns,
            link_target=m.link_target,
        )


@dataclass(slots=True)
class FileResult:
    path: str
    size: int
    sha256: bytes
    entries: int = 0


@dataclass(slots=True)
class FileListing:
    entries: list[FileInfo]
    truncated: bool


@dataclass(slots=True)
class FileRemoved:
    path: str
    removed: int


# ---- ports -------------------------------------------------------------------------------------
@dataclass(slots=True)
class PortSpec:
    """A TCP connection to 127.0.0.1:`port` in the guest: channel 0 to it, 1 from it."""

    port: int


@dataclass(slots=True)
class PortConnected:
    """The agent is connected to the port (its accept)."""


@dataclass(slots=True)
class PortResult:
    bytes_in: int  # written to the port
    bytes_out: int  # read from it


# ---- egress (opened by the agent) ---------------------------------------------------------------
@dataclass(slots=True)
class EgressOpened:
    """An agent-opened egress stream: one guest tool's connection to the agent's proxy listener.
    `client` is the guest-side peer as the agent says it (informational, for the audit only)."""

    client: str


@dataclass(slots=True)
class EgressResult:
    bytes_up: int  # from the guest
    bytes_down: int  # to the guest
    verdict: str  # allowed, denied, failed
    reason: str


def opened(msg: pb.StreamOpen) -> EgressOpened | None:
    """The typed spec of a stream the agent opened (None: a kind the server accepts none of)."""
    if msg.WhichOneof("kind") == "egress":
        return EgressOpened(client=msg.egress.client)
    return None


def to_accept(opened: EgressOpened) -> pb.StreamAccept:
    """The accept for an agent-opened stream of `opened`'s kind."""
    return pb.StreamAccept(egress=pb.EgressAccepted())


def to_close(result: EgressResult) -> pb.StreamClose:
    """Our close of an agent-opened stream, with its result."""
    return pb.StreamClose(
        egress=pb.EgressResult(
            bytes_up=result.bytes_up,
            bytes_down=result.bytes_down,
            verdict=result.verdict,
            reason=result.reason,
        )
    )


# ---- egress trust (opened by the server) --------------------------------------------------------
@dataclass(slots=True)
class EgressTrust:
    """The CA certificate (PEM) of the instance's egress proxy, for the guest's trust store."""

    ca_pem: bytes


@dataclass(slots=True)
class EgressTrustResult:
    path: str  # where the agent wrote it (untrusted: for the record only)
    refreshed: bool


# ---- agent upgrades (opened by the server) ------------------------------------------------------
@dataclass(slots=True)
class AgentBundleSpec:
    """Channel 0: an agent bundle of `size` bytes whose SHA-256 is `digest` (agent/upgrade.py)."""

    digest: str
    size: int
    trial_seconds: int = 0  # 0: the agent's default


@dataclass(slots=True)
class AgentBundleResult:
    digest: str  # untrusted: compared with what was sent
    restarting: bool  # False: the agent runs this bundle already


DIGEST = 3  # the upload's channel for the sender's SHA-256 (after channel 0's end)

OpenSpec = (
    ExecSpec
    | FileUpload
    | FileDownload
    | FileStat
    | FileList
    | FileMkdir
    | FileRemove
    | PortSpec
    | EgressTrust
    | AgentBundleSpec
)
Started = ExecStarted | FileInfo | PortConnected | None
Result = (
    ExecResult
    | FileResult
    | FileInfo
    | FileListing
    | FileRemoved
    | PortResult
    | EgressTrustResult
    | AgentBundleResult
)

#: the agent's name for each kind (what it lists in `Register.stream_kinds`)
KIND_NAMES: dict[type, str] = {
    ExecSpec: "exec",
    FileUpload: "file_upload",
    FileDownload: "file_download",
    FileStat: "file_stat",
    FileList: "file_list",
    FileMkdir: "file_mkdir",
    FileRemove: "file_remove",
    PortSpec: "port",
    EgressTrust: "egress_trust",
    AgentBundleSpec: "agent_bundle",
}


def _mode(mode: int | None) -> dict[str, object]:
    return {} if mode is None else {"has_mode": True, "mode": mode}


def to_open(spec: OpenSpec) -> pb.StreamOpen:
    if isinstance(spec, ExecSpec):
        b = spec.budget
        return pb.StreamOpen(
            exec=pb.ExecSpec(
                argv=list(spec.argv),
                env=dict(spec.env),
                cwd=spec.cwd,
                user=spec.user,
                stdin=spec.stdin,
                budget=b.to_pb(),
                egress_token=spec.egress_token,
            )
        )
    if isinstance(spec, FileUpload):
        return pb.StreamOpen(
            file_upload=pb.FileUpload(
                path=spec.path,
                directory=spec.directory,
                owner=spec.owner,
                group=spec.group,
                follow_symlinks=spec.follow_symlinks,
                parents=spec.parents,
                size=spec.size,
                **_mode(spec.mode),  # type: ignore[arg-type]
            )
        )
    if isinstance(spec, FileDownload):
        return pb.StreamOpen(
            file_download=pb.FileDownload(path=spec.path, follow_symlinks=spec.follow_symlinks)
        )
    if isinstance(spec, FileStat):
        return pb.StreamOpen(
            file_stat=pb.FilePath(path=spec.path, follow_symlinks=spec.follow_symlinks)
        )
    if isinstance(spec, FileList):
        return pb.StreamOpen(
            file_list=pb.FileList(
                path=spec.path, follow_symlinks=spec.follow_symlinks, limit=spec.limit
            )
        )
    if isinstance(spec, FileMkdir):
        return pb.StreamOpen(
            file_mkdir=pb.FileMkdir(
                path=spec.path,
                parents=spec.parents,
                owner=spec.owner,
                group=spec.group,
                **_mode(spec.mode),  # type: ignore[arg-type]
            )
        )
    if isinstance(spec, PortSpec):
        return pb.StreamOpen(port=pb.PortSpec(port=spec.port))
    if isinstance(spec, EgressTrust):
        return pb.StreamOpen(egress_trust=pb.EgressTrust(ca_pem=spec.ca_pem))
    if isinstance(spec, AgentBundleSpec):
        return pb.StreamOpen(
            agent_bundle=pb.AgentBundle(
                digest=spec.digest, size=spec.size, trial_seconds=spec.trial_seconds
            )
        )
    return pb.StreamOpen(file_remove=pb.FileRemove(path=spec.path, recursive=spec.recursive))


def accept_info(accept: pb.StreamAccept) -> Started:
    which = accept.WhichOneof("info")
    if which == "exec":
        return ExecStarted(pid=accept.exec.pid, enforcement=accept.exec.enforcement)
    if which == "file_download":
        return FileInfo.from_pb(accept.file_download)
    if which == "port":
        return PortConnected()
    return None


def _file_result(m: pb.FileResult) -> FileResult:
    return FileResult(path=m.path, size=m.size, sha256=bytes(m.sha256), entries=m.entries)


def close_result(close: pb.StreamClose) -> Result | None:
    """The typed result of an agent's close (None when it carries none)."""
    which = close.WhichOneof("result")
    if which == "exec":
        r = close.exec
        return ExecResult(
            code=r.code if r.has_code else None,
            signal=r.signal,
            reason=r.reason,
            duration_us=r.duration_us,
            cpu_us=r.cpu_us,
            peak_memory_bytes=r.peak_memory_bytes,
            stdout_bytes=r.stdout_bytes,
            stderr_bytes=r.stderr_bytes,
            enforcement=r.enforcement,
        )
    if which == "file_upload":
        return _file_result(close.file_upload)
    if which == "file_download":
        return _file_result(close.file_download)
    if which in ("file_stat", "file_mkdir"):
        return FileInfo.from_pb(getattr(close, which))
    if which == "file_list":
        return FileListing(
            entries=[FileInfo.from_pb(e) for e in close.file_list.entries],
            truncated=close.file_list.truncated,
        )
    if which == "file_remove":
        return FileRemoved(path=close.file_remove.path, removed=close.file_remove.removed)
    if which == "port":
        return PortResult(bytes_in=close.port.bytes_in, bytes_out=close.port.bytes_out)
    if which == "egress_trust":
        return EgressTrustResult(
            path=close.egress_trust.path[:4096], refreshed=close.egress_trust.refreshed
        )
    if which == "agent_bundle":
        return AgentBundleResult(
            digest=close.agent_bundle.digest[:64], restarting=close.agent_bundle.restarting
        )
    return None
