"""Mono: the colocated baseline, prefill and decode in one instance, streamed from position 0."""

from __future__ import annotations

from typing import Any

from pdd.common.vocabulary import Role
from pdd.common.wire import PipelinePlan
from pdd.worker.engine.request import RequestOutput
from pdd.worker.roles.base import NoSuchRequestError, RoleBase, sampling_params
from pdd.worker.roles.session import DecodeSession


class MonoRole(RoleBase):
    role = Role.MONO

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sessions: dict[str, DecodeSession] = {}

    async def start_request(self, plan: PipelinePlan) -> None:
        if plan.pipeline != "mono":
            raise ValueError(f"a mono instance runs pipeline 'mono', not {plan.pipeline}")
        rid = plan.request_id
        if rid in self.sessions:
            raise ValueError(f"request {rid!r} is already running here")
        self.cancelled.check(rid)  # its cancel overtook it
        session = DecodeSession(rid, self.hub)
        n, params = len(plan.prompt_ids), sampling_params(plan)

        def on_output(out: RequestOutput) -> None:
            if session.cached_tokens is None:  # the first output: the admission's real hit
                session.cached_tokens = session.md_hit_tokens = out.num_cached_tokens
                self.metrics.count_prompt(n, out.num_cached_tokens)
            self.metrics.observe_first_token(out)
            session.on_output(out)

        self.sessions[rid] = session
        self.live.add(rid)
        self.hub.get(rid).start()
        self.runner.subscribe(rid, on_output)
        try:
            await self.runner.call(lambda e: e.add_request(plan.prompt_ids, params, rid))
        except Exception:
            self._forget(rid)
            raise
        self.spawn(self._forget_when_done(rid, session), f"mono-{rid}")

    async def _forget_when_done(self, rid: str, session: DecodeSession) -> None:
        await session.done.wait()
        self._forget(rid)

    def _forget(self, rid: str) -> None:
        self.runner.unsubscribe(rid)
        self.sessions.pop(rid, None)
        self.live.discard(rid)

    async def stop_request(self, request_id: str) -> None:
        session = self.sessions.get(request_id)
        if session is None:
            raise NoSuchRequestError(request_id)
        await self.abort_engine_request(request_id)
        session.end_silently()
