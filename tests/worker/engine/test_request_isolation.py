"""One request's own failure ends that request alone: the rest of its batch goes on.

Each per-request stage of a step (the grammar's advance, its mask, a mask that allows no
token, the logits processors, the sampler, the logprobs) is made to fail for one request
of a batch, once it has a few tokens out. The others must produce exactly the tokens of
a run without it; the failed one ends with its own error, typed as the request's
(``error_type``: the router answers it instead of routing around the instance), and no
block or lock is left behind.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pdd.common.grammar import GRAMMAR_ERROR_TYPE, grammar_text
from pdd.common.wire import REQUEST_FAILED_ERROR_TYPE, GuidedDecoding
from pdd.worker.engine import Engine
from pdd.worker.engine import engine as engine_module
from pdd.worker.engine import grammar as grammar_module
from pdd.worker.engine.request import FinishReason, RequestOutput, UnknownRequestError
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.model.loader import LoadedModel

pytestmark = pytest.mark.unit

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
SCHEMA = GuidedDecoding(kind="json_schema", schema_text=json.dumps(PERSON))
#: The schema that once failed every request in the batch it joined: the value of the
#: required property "c" must again be such an object, so the grammar forces an endless
#: prefix and llguidance gives up on it after the first token.
RECURSIVE = {
    "$defs": {
        "n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}
    },
    "$ref": "#/$defs/n",
}
#: Greedy, sampled, steered with logprobs, guided: every path the batched stages take.
INNOCENT = [
    SamplingParams(max_tokens=10, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True),
    SamplingParams(
        max_tokens=10, temperature=0.8, seed=12, ignore_eos=True, frequency_penalty=1.0,
        repetition_penalty=1.3, logit_bias=((65, 5.0),), min_tokens=4, logprobs=3,
    ),
    SamplingParams(max_tokens=40, temperature=1.0, seed=13, guided=SCHEMA),
]  # fmt: skip
BAD_SEED = 666
#: The failing request goes through every stage: guided, penalized, sampled, logprobs.
BAD = SamplingParams(
    max_tokens=30, temperature=1.0, seed=BAD_SEED, guided=SCHEMA, presence_penalty=0.5,
    logprobs=2,
)  # fmt: skip
#: Output tokens the failing request has out when its stage fails.
FAIL_AT = 3


def prompts(n: int) -> list[list[int]]:
    return [[(r * 31 + i * 7) % 200 + 32 for i in range(9 + 4 * r)] for r in range(n)]


def run(
    engine: Engine, batch: list[tuple[list[int], SamplingParams]]
) -> dict[str, list[RequestOutput]]:
    """Every output of each request (those added before too), stepping until the engine
    is idle."""
    for i, (prompt, params) in enumerate(batch):
        engine.add_request(prompt, params, f"r{i}")
    outs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in engine.requests}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    return outs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


class Injection:
    """Makes one stage fail for the bad request once it has ``FAIL_AT`` tokens out."""

    def __init__(self, engine: Engine, bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.engine, self.bad, self.monkeypatch = engine, bad, monkeypatch

    def due(self) -> bool:
        try:
            return len(self.engine.requests.get(self.bad).output_ids) >= FAIL_AT
        except UnknownRequestError:  # it has ended (as it should have)
            return False

    def grammar_state(self) -> Any:
        return self.engine.requests.get(self.bad).grammar

    def wrap(self, name: str, fails: Callable[..., bool]) -> None:
        """Replace the engine's ``name`` with one that raises where ``fails(*args)``."""
        real = getattr(engine_module, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if self.due() and fails(*args):
                raise RuntimeError(f"injected failure in {name}")
            return real(*args, **kwargs)

        self.monkeypatch.setattr(engine_module, name, wrapped)


def fail_grammar_advance(inj: Injection) -> None:
    state = inj.grammar_state()
    real = state.advance

    def advance(output_ids: list[int]) -> None:
        if len(output_ids) > FAIL_AT:
            raise RuntimeError("injected failure in the grammar's advance")
        real(output_ids)

    state.advance = advance


def fail_grammar_mask(inj: Injection) -> None:
    state = inj.grammar_state()
    real = state.allowed

    def allowed() -> torch.Tensor:
        if inj.due():
            raise RuntimeError("injected failure in the grammar's mask")
        return real()

    state.allowed = allowed


def mask_nothing(inj: Injection) -> None:
    state = inj.grammar_state()
    real = state.allowed
    state.allowed = lambda: torch.zeros_like(real()) if inj.due() else real()


def fail_logits_processing(inj: Injection) -> None:
    inj.wrap("process_logits", lambda _l, _p, histories, _e: inj.bad in _ids(histories))


def fail_sampling(inj: Injection) -> None:
    inj.wrap("sample", lambda _l, _p, seeds, _pos: BAD_SEED in seeds)


def fail_logprobs(inj: Injection) -> None:
    inj.wrap("token_logprobs", lambda _l, _t, params: any(p.seed == BAD_SEED for p in params))


def _ids(histories: Any) -> set[str]:
    return {h.request_id for h in histories}


STAGES = {
    "grammar advance": (fail_grammar_advance, GRAMMAR_ERROR_TYPE, "advance"),
    "grammar mask": (fail_grammar_mask, GRAMMAR_ERROR_TYPE, "mask"),
    "a mask that allows no token": (mask_nothing, GRAMMAR_ERROR_TYPE, "no token"),
    "logits processing": (fail_logits_processing, REQUEST_FAILED_ERROR_TYPE, "process_logits"),
    "sampling": (fail_sampling, REQUEST_FAILED_ERROR_TYPE, "sample"),
    "logprobs": (fail_logprobs, REQUEST_FAILED_ERROR_TYPE, "token_logprobs"),
}


@pytest.fixture(scope="module")
def clean(tiny: LoadedModel) -> dict[str, list[int]]:
    """The innocent requests' tokens in a batch without the bad one."""
    engine = Engine(tiny, block_size=4, num_blocks=256)
    batch = list(zip(prompts(len(INNOCENT)), INNOCENT, strict=True))
    return {rid: tokens(outs) for rid, outs in run(engine, batch).items()}


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_failure_in_one_requests_stage_ends_that_request_alone(
    tiny: LoadedModel,
    clean: dict[str, list[int]],
    assert_no_leaks: Callable[[Engine], None],
    monkeypatch: pytest.MonkeyPatch,
    stage: str,
) -> None:
    inject, error_type, reason = STAGES[stage]
    engine = Engine(tiny, block_size=4, num_blocks=256)
    free_before = engine.stats.num_free_blocks
    batch = list(zip(prompts(len(INNOCENT)), INNOCENT, strict=True))
    bad = engine.add_request([40, 41, 42, 43, 44, 45], BAD, "bad")
    inject(Injection(engine, bad, monkeypatch))
    outs = run(engine, batch)
    outs_bad = outs.pop(bad)
    assert {rid: tokens(o) for rid, o in outs.items()} == clean
    last = outs_bad[-1]
    assert last.finished and last.finish_reason is FinishReason.ABORT
    assert last.error is not None and reason in last.error, last.error
    assert last.error_type == error_type
    assert len(tokens(outs_bad)) == FAIL_AT
    assert [o for o in outs_bad if o.error is not None] == [last]
    engine.check_integrity()
    assert engine.stats.num_free_blocks + engine.stats.num_cached_blocks == free_before
    assert_no_leaks(engine)


def test_the_recursive_schema_fails_its_own_request_in_a_batch(
    tiny: LoadedModel,
    clean: dict[str, list[int]],
    assert_no_leaks: Callable[[Engine], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The real failure, not an injected one: with the admission checks out of the way
    (as a worker of an older build would have them), llguidance gives up on the schema
    after its first token, and only its own request ends."""
    monkeypatch.setattr(grammar_module, "check_grammar", grammar_text)
    engine = Engine(tiny, block_size=4, num_blocks=256)
    recursive = GuidedDecoding(kind="json_schema", schema_text=json.dumps(RECURSIVE))
    bad = engine.add_request([40, 41, 42], SamplingParams(max_tokens=30, guided=recursive), "bad")
    outs = run(engine, list(zip(prompts(len(INNOCENT)), INNOCENT, strict=True)))
    last = outs.pop(bad)[-1]
    assert {rid: tokens(o) for rid, o in outs.items()} == clean
    assert last.finish_reason is FinishReason.ABORT and last.error_type == GRAMMAR_ERROR_TYPE
    assert last.error is not None and "grammar" in last.error
    assert_no_leaks(engine)


def test_a_grammar_and_min_tokens_that_leave_no_token_fail_that_request(
    tiny: LoadedModel, clean: dict[str, list[int]], assert_no_leaks: Callable[[Engine], None]
) -> None:
    """A JSON object must start with ``{``; this request also makes ``{`` a stop token it
    may not sample before ``min_tokens``: nothing is left to sample, which is its own
    input's doing (a 400 through the router), not a reason to pick a forbidden token."""
    engine = Engine(tiny, block_size=4, num_blocks=256)
    params = SamplingParams(
        max_tokens=8, guided=GuidedDecoding(kind="json_object"), stop_token_ids=(ord("{"),),
        min_tokens=4,
    )  # fmt: skip
    bad = engine.add_request([40, 41, 42], params, "bad")
    outs = run(engine, list(zip(prompts(len(INNOCENT)), INNOCENT, strict=True)))
    [out] = outs.pop(bad)
    assert {rid: tokens(o) for rid, o in outs.items()} == clean
    assert out.new_token_ids == [] and out.finish_reason is FinishReason.ABORT
    assert out.error_type == GRAMMAR_ERROR_TYPE and "no token" in (out.error or "")
    assert_no_leaks(engine)
