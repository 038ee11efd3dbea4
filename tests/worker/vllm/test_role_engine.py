"""The roles' KV and handoff surface over vLLM (``pdd.worker.vllm.role_engine``), with a
scripted stand-in for ``AsyncLLM`` and the connector's store written by the test as the
connector writes it (exact PDD chunks): what P exports, what RLD and MD import, and which
prompt and ``kv_transfer_params`` reach vLLM at a handoff. No vLLM needed; the real
engine is ``test_vllm_pipelines.py``'s.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from pdd.common.wire import EngineInfo
from pdd.testing.waiting import until
from pdd.worker.engine.kv_transfer import KVGapError, encode_chunk
from pdd.worker.engine.request import FinishReason, RequestOutput, UnknownRequestError
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.model.kv_cache import KVLayout
from pdd.worker.vllm.params import IMPORT, BadTransferParamsError, Transfer, import_params, parse
from pdd.worker.vllm.role_engine import VllmRoleEngine
from pdd.worker.vllm.sampling import PRIOR_PENALTIES_KEY, VllmSamplingError
from pdd.worker.vllm.serving import KVUsage, VllmRunner
from pdd.worker.vllm.store import DirectoryKVStore
from pdd.worker.vllm.token_kv import TokenKV

from .test_serving import EventFeed, ScriptedLLM

pytestmark = pytest.mark.unit

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=16, dtype=torch.float32)
FINGERPRINT = "model-x"
EOS = 99
INFO = EngineInfo(
    engine="vllm", device="cpu", dtype="float32", block_size=16, kv_blocks=64, kv_tokens=1024,
    kv_bytes=1 << 20, max_running_requests=4, max_model_len=64, max_prompt_tokens=63,
    max_num_batched_tokens=64,
)  # fmt: skip
PROMPT = list(range(10, 30))  # 20 tokens


def prompt_kv(n: int = len(PROMPT)) -> torch.Tensor:
    """A distinct value per element of the prompt's KV ``[L, 2, n, H, D]``."""
    shape = (LAYOUT.num_layers, 2, n, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)


def chunk(start: int, end: int, codec: Any = "none") -> bytes:
    return encode_chunk(prompt_kv()[:, :, start:end], start, FINGERPRINT, PROMPT[:end], codec)


class Rig:
    def __init__(self, root: Path, feed: EventFeed | None = None) -> None:
        self.llm = ScriptedLLM()
        self.store = DirectoryKVStore(root)
        self.engine = VllmRoleEngine(
            self.llm, INFO, KVUsage(), dict, self.store, LAYOUT, FINGERPRINT, [EOS], feed, 16
        )  # type: ignore[arg-type]
        self.runner = VllmRunner(self.engine, asyncio.get_running_loop())
        self.outputs: list[RequestOutput] = []

    def subscribe(self, rid: str) -> None:
        self.runner.subscribe(rid, self.outputs.append)

    async def submitted(self, rid: str) -> tuple[list[int], dict[str, Any]]:
        """The prompt and sampling keyword arguments vLLM got for ``rid``."""
        # The generate task starts on a later turn of the loop.
        await until(lambda: rid in self.llm.prompts, f"vLLM got {rid}")
        prompt, sampling = self.llm.prompts[rid]
        return prompt["prompt_token_ids"], sampling


async def test_p_exports_what_the_connector_wrote_in_the_receivers_codec(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.engine.add_request(PROMPT, SamplingParams(max_tokens=1), "p1", hold_kv=True)
    _, sampling = await rig.submitted("p1")
    export, _ = parse(sampling["extra_args"]["kv_transfer_params"])
    assert export is not None
    assert rig.engine.computed_tokens("p1") == 0  # nothing landed yet
    rig.store.put(export.key, chunk(0, 8))  # the connector, after a step of 8 tokens
    assert rig.engine.computed_tokens("p1") == 8
    rig.store.put(export.key, chunk(8, 20))
    assert rig.engine.computed_tokens("p1") == 20
    # A receiver holding 5 tokens takes [5, 20) in int8, chunks of 6 tokens: its import
    # (the pdd engine's import_chunk) gets the KV back within int8's error.
    receiver = TokenKV(LAYOUT, FINGERPRINT, PROMPT)
    receiver.held = 5
    for blob in rig.engine.export_kv("p1", 5, 20, 6, "int8"):
        receiver.take(blob, "int8")
    assert receiver.held == 20
    got, want = receiver.read_tokens([], 5, 20), prompt_kv()[:, :, 5:20]
    assert torch.allclose(got, want, rtol=0.02, atol=want.abs().max().item() / 100)
    # P's request is over in vLLM; the KV stays held until the role lets go of it.
    rig.llm.feed("p1", [7], finish="length")
    # vLLM's task for p1 is over (and the engine's end-of-request hook has run).
    await until(lambda: not rig.engine.has_unfinished(), "vLLM done with p1")
    assert rig.engine.computed_tokens("p1") == 20
    rig.engine.abort("p1")
    assert rig.store.chunks(export.key) == []
    with pytest.raises(UnknownRequestError):
        rig.engine.computed_tokens("p1")


async def test_md_imports_the_line_then_vllm_computes_only_the_handed_ids(
    tmp_path: Path,
) -> None:
    rig = Rig(tmp_path)
    params = SamplingParams(max_tokens=10)
    assert rig.engine.attach_request(PROMPT, params, "m1") == 0
    with pytest.raises(KVGapError):  # as on the pdd engine: the role keeps it for later
        rig.engine.import_kv("m1", chunk(8, 20))
    assert rig.engine.import_kv("m1", chunk(0, 8)) == 8
    assert rig.engine.import_kv("m1", chunk(8, 20)) == 20
    rig.subscribe("m1")
    handed = [40, 41, 42]  # P's first token and two a relay decoded
    rig.engine.resume("m1", handed[:1], hold=True)  # catch-up: collected, nothing runs
    rig.engine.extend("m1", handed[1:], hold=False)  # the final chunk: one submission
    prompt, sampling = await rig.submitted("m1")
    assert prompt == PROMPT + handed
    assert sampling["max_tokens"] == 10 - len(handed)  # vLLM counts only what it samples
    _, imported = parse(sampling["extra_args"]["kv_transfer_params"])
    assert imported is not None and imported.tokens == len(PROMPT)  # computes only the 3 IDs
    # The connector gets the prompt's KV exactly as it came over the line.
    (blob,) = rig.store.chunks(imported.key)
    connector_view = TokenKV(LAYOUT, FINGERPRINT, PROMPT)
    connector_view.take(blob)
    assert torch.equal(connector_view.read_tokens([], 0, 20), prompt_kv())
    rig.llm.feed("m1", [43], finish="stop")
    await until(lambda: rig.outputs and rig.outputs[-1].finished, "a finished output")
    assert rig.outputs[-1].new_token_ids == [43]
    assert rig.store.chunks(imported.key) == []  # dropped once vLLM is done with it


async def test_handed_ids_that_end_the_request_end_it_without_vllm(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    for rid, params, ids, reason in (
        ("a", SamplingParams(max_tokens=2), [40, 41], FinishReason.LENGTH),
        ("b", SamplingParams(max_tokens=9), [40, EOS], FinishReason.STOP),
        # EOS at the length limit is a stop, as the pdd engine ends it (one rule for both)
        ("c", SamplingParams(max_tokens=2), [40, EOS], FinishReason.STOP),
    ):
        rig.engine.attach_request(PROMPT, params, rid)
        rig.engine.import_kv(rid, chunk(0, 20))
        rig.subscribe(rid)
        rig.engine.resume(rid, ids)
        await until(lambda: rig.outputs and rig.outputs[-1].finished, "a finished output")
        assert (rig.outputs[-1].new_token_ids, rig.outputs[-1].finish_reason) == ([], reason)
        rig.outputs.clear()
    assert rig.llm.prompts == {}


async def test_md_prefills_what_never_came_and_samples_the_first_token(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.engine.attach_request(PROMPT, SamplingParams(max_tokens=4), "m2", samples_first=True)
    rig.engine.import_kv("m2", chunk(0, 8))
    rig.engine.resume("m2", [])
    prompt, sampling = await rig.submitted("m2")
    _, imported = parse(sampling["extra_args"]["kv_transfer_params"])
    assert prompt == PROMPT and sampling["max_tokens"] == 4
    assert imported is not None and imported.tokens == 8


async def test_a_relay_finished_answer_is_computed_for_the_cache(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.engine.attach_request(PROMPT, SamplingParams(max_tokens=9), "m3")
    rig.engine.import_kv("m3", chunk(0, 20))
    rig.engine.finished_elsewhere("m3", [40, 41, EOS])
    prompt, sampling = await rig.submitted("m3")
    assert prompt == [*PROMPT, 40, 41, EOS] and sampling["max_tokens"] == 1
    assert IMPORT in sampling["extra_args"]["kv_transfer_params"]


async def test_sampling_vllm_cannot_resume_is_refused_before_anything_runs(
    tmp_path: Path,
) -> None:
    """A seeded draw at temperature > 0 would be seeded afresh after the handoff."""
    rig = Rig(tmp_path)
    seeded = SamplingParams(max_tokens=4, temperature=0.7, seed=3)
    with pytest.raises(VllmSamplingError, match="seeded"):
        rig.engine.add_request(PROMPT, seeded, "p2", hold_kv=True)
    with pytest.raises(VllmSamplingError, match="seeded"):
        rig.engine.attach_request(PROMPT, seeded, "m4")
    assert rig.engine.attach_request(PROMPT, seeded, "m5", samples_first=True) == 0
    assert rig.llm.prompts == {}


async def test_md_gives_vllm_the_penalties_and_min_tokens_over_the_handed_ids(
    tmp_path: Path,
) -> None:
    """The handed IDs are prompt to vLLM: they count off ``min_tokens`` and reach the
    penalties through ``PriorOutputPenalties``."""
    rig = Rig(tmp_path)
    params = SamplingParams(max_tokens=10, min_tokens=6, frequency_penalty=0.5)
    rig.engine.add_request(PROMPT, params, "p3", hold_kv=True)  # P accepts it now
    rig.engine.attach_request(PROMPT, params, "m8")
    rig.engine.import_kv("m8", chunk(0, 20))
    rig.engine.resume("m8", [40, 41])
    prompt, sampling = await rig.submitted("m8")
    assert prompt == [*PROMPT, 40, 41]
    assert (sampling["max_tokens"], sampling["min_tokens"]) == (8, 4)
    assert sampling["frequency_penalty"] == 0.0
    carried = sampling["extra_args"][PRIOR_PENALTIES_KEY]
    assert (carried["prior_output_tokens"], carried["frequency_penalty"]) == (2, 0.5)


async def test_the_hit_is_what_vllms_events_say_it_caches_and_only_the_rest_crosses(
    tmp_path: Path,
) -> None:
    feed = EventFeed()
    rig = Rig(tmp_path, feed)
    assert rig.engine.attach_request(PROMPT, SamplingParams(max_tokens=4), "m6") == 0
    rig.engine.abort("m6")
    feed.store(b"v1", None, PROMPT[:16])  # vLLM cached the prompt's first 16 tokens
    assert rig.engine.cached_prefix_tokens(PROMPT) == 16
    assert rig.engine.attach_request(PROMPT, SamplingParams(max_tokens=4), "m7") == 16
    assert rig.engine.import_kv("m7", chunk(16, 20)) == 20  # P sends only the miss
    rig.engine.resume("m7", [40])
    prompt, sampling = await rig.submitted("m7")
    _, imported = parse(sampling["extra_args"]["kv_transfer_params"])
    assert prompt == [*PROMPT, 40]
    assert imported is not None and (imported.start, imported.tokens) == (16, 20)
    # The router still gets every event, once, though the engine read them first.
    assert [e.type for e in rig.engine.drain_cache_events()] == ["block_stored"]
    assert rig.engine.drain_cache_events() == []
    naive = rig.engine.attach_request(PROMPT, SamplingParams(), "m8", use_cache=False)
    assert naive == 0  # the naive baseline ships the whole prompt


async def test_vllm_runner_turns_without_outputs(tmp_path: Path) -> None:
    """A role waiting for KV between vLLM's outputs (P's streamed prefill) looks again."""
    rig = Rig(tmp_path)
    assert await asyncio.wait_for(rig.runner.after_next_step(lambda e: e is rig.engine), 5)
    await asyncio.wait_for(rig.runner.next_step(), 5)


def test_an_import_names_where_the_stored_kv_starts() -> None:
    _, imported = parse(import_params("k", 20, start=16))
    assert imported is not None and (imported.start, imported.tokens) == (16, 20)
    assert parse(import_params("k", 20))[1] == Transfer("k", tokens=20)  # as before
    with pytest.raises(BadTransferParamsError, match="starts in"):
        import_params("k", 20, start=20)
