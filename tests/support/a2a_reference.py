"""A reference A2A server made of a2a-sdk's own parts, for `tests/bench/bench_a2a.py` to
measure ours beside: `DefaultRequestHandler` + `InMemoryTaskStore` behind the SDK's JSON-RPC and
agent-card routes, under uvicorn, whose executor runs the message's text the way our task
runner does — `bash -lc TEXT` as a subprocess, with the HOME it is given — and completes the
task (failed on a non-zero exit).

Run: ``python -m tests.support.a2a_reference --port P --home DIR`` (loopback only; ready once
its agent card answers). No authentication, no persistence, no sessions: what the SDK's
server does for a trivial task, nothing more.
"""

from __future__ import annotations

import argparse
import asyncio
import os

import uvicorn
from a2a.helpers.proto_helpers import new_task
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import a2a_pb2 as pb
from starlette.applications import Starlette

RPC_PATH = "/a2a"


class ShellExecutor(AgentExecutor):
    def __init__(self, home: str) -> None:
        self.env = {**os.environ, "HOME": home}

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        task_id, context_id = context.task_id or "", context.context_id or ""
        updater = TaskUpdater(event_queue, task_id, context_id)
        if context.current_task is None:
            history = [context.message] if context.message is not None else []
            await event_queue.enqueue_event(
                new_task(task_id, context_id, pb.TaskState.TASK_STATE_SUBMITTED, history=history)
            )
        text = context.get_user_input()
        proc = await asyncio.create_subprocess_exec(
            "bash",
            "-lc",
            text,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            env=self.env,
        )
        if await proc.wait() == 0:
            await updater.complete()
        else:
            await updater.failed()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        await TaskUpdater(event_queue, context.task_id or "", context.context_id or "").cancel()


def card(url: str) -> pb.AgentCard:
    c = pb.AgentCard(
        name="sdk reference",
        description="a2a-sdk DefaultRequestHandler + InMemoryTaskStore: bash -lc TEXT",
        version="1.0",
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        capabilities=pb.AgentCapabilities(streaming=False),
    )
    c.supported_interfaces.append(
        pb.AgentInterface(url=url, protocol_binding="JSONRPC", protocol_version="1.0")
    )
    c.skills.append(
        pb.AgentSkill(id="shell", name="shell", description="bash -lc TEXT", tags=["shell"])
    )
    return c


def app(port: int, home: str) -> Starlette:
    agent_card = card(f"http://127.0.0.1:{port}{RPC_PATH}")
    handler = DefaultRequestHandler(
        agent_executor=ShellExecutor(home), task_store=InMemoryTaskStore(), agent_card=agent_card
    )
    routes = create_agent_card_routes(agent_card) + create_jsonrpc_routes(handler, RPC_PATH)
    return Starlette(routes=routes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--home", required=True)
    args = ap.parse_args()
    config = uvicorn.Config(
        app(args.port, args.home),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
    )
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main()
