"""Prefill (P): prefill what its own cache misses, then ship KV on two paths at once.

Per request: in parallel, handshake with the decode-side receivers (each
answers how much of the prompt it already holds, and locks it) and prefill;
then stream the KV each receiver lacks, all of it to the relay over the fast
path, only the main decode's miss over the WAN, each followed by the first
token. P never streams a token to the client: the first token the client sees
comes from a decode-side instance. P holds the request's KV until both
transfers have ended, however they ended. The WAN copy is coded with the
deployment's KV codec (``--kv-codec``), named in the handshake; the relay's copy
stays exact.

P's own stream carries one thing: a status event when the KV could not cross the
WAN to MD (refused, reset, no answer to the handshake within the connect timeout,
or stalled mid-transfer). MD cannot say so quickly: across a cut it never hears of
the request and gives up only after its transfer timeout. P knows within its own
connect timeout, so the router hears it from P and recovers (or lets the relay
finish) seconds earlier.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from dataclasses import dataclass

from pdd.common.kv_codec import NO_CODEC, KVCodec, chunk_wire_bytes, handshake_name
from pdd.common.vocabulary import LinkFault, Pipeline, Role
from pdd.common.wire import Endpoint, PipelinePlan, TokenLogprobs
from pdd.worker.engine.request import RequestOutput
from pdd.worker.roles.base import RoleBase, sampling_params
from pdd.worker.roles.protocol import ProtocolError, expect_meta, int_field, send_meta
from pdd.worker.transport import (
    Channel,
    LinkDown,
    MsgType,
    TransferTimeout,
    encode_json,
    request_key,
)

log = logging.getLogger(__name__)

PREFILL_PIPELINES = (Pipeline.P_RLD_MD, Pipeline.P_MD, Pipeline.P_RLD, Pipeline.NAIVE)


@dataclass(frozen=True)
class Prefilled:
    first_token: int
    cached_tokens: int  # prompt tokens P's prefix cache supplied (not prefilled)
    first_logprobs: TokenLogprobs | None = None  # where the request asked for logprobs


@dataclass(frozen=True)
class Target:
    endpoint: Endpoint
    role: Role
    wan: bool

    @property
    def path(self) -> str:
        return "wan" if self.wan else "fast"


def targets_of(plan: PipelinePlan) -> list[Target]:
    """Who gets KV: the relay over the fast path, the main decode over the WAN."""
    out = []
    if plan.relay is not None and plan.pipeline in (Pipeline.P_RLD_MD, Pipeline.P_RLD):
        out.append(Target(plan.relay, Role.RELAY, wan=False))
    if plan.main is not None and plan.pipeline in (
        Pipeline.P_RLD_MD,
        Pipeline.P_MD,
        Pipeline.NAIVE,
    ):
        out.append(Target(plan.main, Role.MAIN, wan=True))
    return out


def link_fault_of(exc: BaseException, handshake: bool) -> LinkFault | None:
    """What a failed transfer says about the line, or None where it says nothing about it
    (MD refused the request, a secret or certificate mismatch: MD reports those itself).
    No answer within the timeout is a cut while connecting, a stall once bytes flowed;
    so is MD hanging up instead of answering (its own timeout fired first)."""
    if isinstance(exc, LinkDown):
        return LinkFault.UNREACHABLE
    if isinstance(exc, TransferTimeout | ProtocolError):
        return LinkFault.UNREACHABLE if handshake else LinkFault.STALLED
    return None


def with_seed(plan: PipelinePlan) -> PipelinePlan:
    """Fix the seed here, so every instance that samples this request draws the same."""
    if plan.sampling.seed is not None:
        return plan
    sampling = plan.sampling.model_copy(update={"seed": secrets.randbits(63)})
    return plan.model_copy(update={"sampling": sampling})


class PrefillRole(RoleBase):
    role = "prefill"

    async def start_request(self, plan: PipelinePlan) -> None:
        if plan.pipeline not in PREFILL_PIPELINES:
            raise ValueError(f"a prefill instance runs {PREFILL_PIPELINES}, not {plan.pipeline}")
        if plan.request_id in self.live:
            raise ValueError(f"request {plan.request_id!r} is already running here")
        self.live.add(plan.request_id)
        if plan.ships_kv_over_wan:
            self.hub.get(plan.request_id).start()  # its reader waits for a report or the end
        self.spawn(self._run(with_seed(plan)), f"prefill-{plan.request_id}")

    async def cancel(self, request_id: str) -> None:
        await self.abort_engine_request(request_id)

    async def _run(self, plan: PipelinePlan) -> None:
        """Prefill and each path run at once; a slow WAN handshake never delays the relay."""
        rid = plan.request_id
        prefill = asyncio.ensure_future(self._prefill(plan))
        try:
            paths = [self._path(plan, t, prefill) for t in targets_of(plan)]
            await asyncio.gather(prefill, *paths)
        except Exception:
            log.exception("prefill of %s failed", rid)
        finally:
            prefill.cancel()
            await self.abort_engine_request(rid)  # releases the held KV (finished or not)
            self.runner.unsubscribe(rid)
            self.live.discard(rid)
            if plan.ships_kv_over_wan:
                self.hub.get(rid).close()  # the router's reader of P's reports stops

    async def _path(self, plan: PipelinePlan, target: Target, prefill: asyncio.Future) -> None:
        """One receiver: handshake (learn its hit), wait for the first token, ship its miss."""
        codec = self.settings.kv_codec if target.wan else NO_CODEC
        try:
            channel, hit = await self._prepare(plan, target, codec)
        except Exception as exc:
            self.metrics.transfer_failures.labels(target.path).inc()
            log.warning(
                "handshake with %s for %s failed: %s",
                target.endpoint.instance_id,
                plan.request_id,
                exc,
            )
            self._report(plan, target, exc, handshake=True)
            return
        try:
            prefilled = await asyncio.shield(prefill)
            await self._ship(plan, target, channel, hit, prefilled, codec)
        finally:
            with contextlib.suppress(Exception):
                await channel.close()

    async def _prefill(self, plan: PipelinePlan) -> Prefilled:
        """Prefill the prompt (only P's miss is computed) and sample the first token."""
        first: asyncio.Future[Prefilled] = asyncio.get_running_loop().create_future()

        def on_output(out: RequestOutput) -> None:
            if out.error is not None and not first.done():
                first.set_exception(RuntimeError(out.error))
            elif out.new_token_ids and not first.done():
                lp = out.logprobs[0] if out.logprobs else None
                first.set_result(Prefilled(out.new_token_ids[0], out.num_cached_tokens, lp))

        params = sampling_params(plan, max_tokens=1)
        self.runner.subscribe(plan.request_id, on_output)
        await self.runner.call(
            lambda e: e.add_request(plan.prompt_ids, params, plan.request_id, hold_kv=True)
        )
        prefilled = await first
        self.metrics.count_prompt(len(plan.prompt_ids), prefilled.cached_tokens)
        return prefilled

    async def _prepare(
        self, plan: PipelinePlan, target: Target, codec: KVCodec
    ) -> tuple[Channel, int]:
        """Open the channel and learn (and have the receiver lock) the prefix it holds;
        the receiver answers with the codec it takes, which must be the one offered."""
        channel = await self.open_channel(target.endpoint, target.role, target.wan, sends=True)
        try:
            await send_meta(
                channel, plan.request_id, op="prepare", plan=plan.model_dump(mode="json"),
                codec=handshake_name(codec),
            )  # fmt: skip
            # Answering "prepare" only locks a prefix: a reply slower than a connect is a
            # line that is not there, reported as such (not after the transfer timeout).
            prepared = await expect_meta(
                channel, "prepared", timeout_s=self.settings.transport.connect_timeout_s
            )
            if prepared.get("codec", NO_CODEC) != handshake_name(codec):
                raise ProtocolError(
                    f"{channel.peer.name} takes KV coded {prepared.get('codec')!r}, this prefill "
                    f"sends {handshake_name(codec)!r}; give P and MD the same "
                    "spec.wan.kvCodec (--kv-codec) and the same build"
                )
            hit = int_field(prepared, "hit")
        except BaseException:
            await channel.close()
            raise
        return channel, hit

    async def _ship(
        self, plan: PipelinePlan, target: Target, channel: Channel, hit: int, first: Prefilled,
        codec: KVCodec,
    ) -> None:  # fmt: skip
        rid, n = plan.request_id, len(plan.prompt_ids)
        key = request_key(rid)
        counter = self.metrics.wan_bytes if target.wan else self.metrics.fastpath_bytes
        try:
            if hit < n:
                chunk_tokens = max(1, self.settings.chunk_bytes // self._bytes_per_token - 1)
                channel.commit(self._coded_bytes(hit, n, codec))  # the backlog
                chunks = await self.runner.call(
                    lambda e: e.export_kv(rid, hit, n, chunk_tokens, codec)
                )
                for start in range(hit, n, chunk_tokens):
                    blob = await self.runner.call(lambda e: next(chunks))
                    await channel.send(MsgType.KV_CHUNK, key, blob)
                    counter.inc(min(chunk_tokens, n - start) * self._bytes_per_token)
                    if target.wan:
                        self.metrics.wan_kv_wire_bytes.inc(len(blob))
            done = {
                "first_token": first.first_token,
                "cached_tokens": first.cached_tokens,
                "first_logprobs": (
                    None if first.first_logprobs is None else first.first_logprobs.model_dump()
                ),
            }
            await channel.send(MsgType.KV_DONE, key, encode_json(done))
            await expect_meta(channel, "imported")
        except Exception as exc:
            self.metrics.transfer_failures.labels(target.path).inc()
            log.warning(
                "KV to %s (%s) for %s failed: %s",
                target.endpoint.instance_id,
                target.path,
                rid,
                exc,
            )
            self._report(plan, target, exc, handshake=False)

    def _report(
        self, plan: PipelinePlan, target: Target, exc: BaseException, handshake: bool
    ) -> None:
        """Tell the router on P's stream, at once, that MD will not get this request's KV
        over the line (MD itself would say so only after its transfer timeout)."""
        fault = link_fault_of(exc, handshake)
        if not target.wan or fault is None:
            return
        md = target.endpoint.instance_id
        self.hub.fail(
            plan.request_id,
            0,
            f"{self.settings.instance_id} could not send the KV to {md} over the WAN "
            f"({fault}): {exc}",
            culprit=md,
            link_fault=fault,
        )

    def _coded_bytes(self, start: int, end: int, codec: KVCodec) -> int:
        """Payload bytes of positions ``start..end`` (the same in any chunking: the codecs
        scale each token on its own)."""
        lay = self.runner.engine.layout
        return chunk_wire_bytes(
            codec, lay.num_layers, end - start, lay.num_kv_heads, lay.head_dim, lay.itemsize
        )

    @property
    def _bytes_per_token(self) -> int:
        return self.runner.engine.layout.bytes_per_token
