"""Structured output across the handoff: every role that samples obeys the same grammar.

In-process on a virtual clock (deterministic). P samples token 0 under the grammar, the
relay continues, and MD takes over from the handed token IDs mid-object: it must advance
its matcher over them before its first pick, or it would restart the object (or refuse
the tokens). The tiny model's random weights sample at temperature 1, so only the mask
makes the output JSON.

Why ``length`` cannot happen here (and every request must end with ``stop``): the schema
bounds every value. Compact JSON, one token per byte (the tiny model's byte tokenizer):
``{"name":"`` 9 + at most 5 characters of at most 6 bytes each (a 4-byte UTF-8 character,
or a 6-byte ``\\u00XX`` escape) 30 + ``","age":`` 8 + at most 2 digits + ``,"pet":"`` 8 +
``dog"`` 4 + ``}`` 1 = at most 62 tokens, under ``MAX_TOKENS``.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from pdd.common.wire import GuidedDecoding, SamplingSpec, TokenEvent
from pdd.router.errors import InvalidRequestError
from pdd.worker.engine.grammar import GrammarCompiler, GrammarRequestError

pytestmark = pytest.mark.virtual_clock  # tiers per test: the 100-output run is slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pet": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
GUIDED = GuidedDecoding(kind="json_schema", schema_text=json.dumps(PERSON))
MAX_TOKENS = 64  # above the 62-token bound in the module docstring
#: Tokens the relay streams before MD's KV may arrive: the handoff lands inside the
#: object (the shortest possible one is 30 tokens).
RELAYED = 12


def sampling(i: int) -> SamplingSpec:
    return SamplingSpec(max_tokens=MAX_TOKENS, temperature=1.0, seed=7000 + i, guided=GUIDED)


def parsed_person(token_ids: list[int]) -> dict:
    """The output as JSON, checked against ``PERSON`` (each constraint by hand)."""
    value = json.loads(bytes(token_ids).decode())
    assert list(value) == ["name", "age", "pet"]
    assert isinstance(value["name"], str) and len(value["name"]) <= 5
    assert type(value["age"]) is int and 0 <= value["age"] <= 99
    assert value["pet"] in ("cat", "dog")
    return value


async def relayed_then_handed_over(vdp, plans) -> list:
    """Run ``plans`` (P-RLD-MD) with MD's KV held back until every relay streamed
    ``RELAYED`` tokens, so every request is handed over mid-object.

    That holds only if no relay finished its request before the release (a relay that
    did streamed all of it: there is nothing left to hand over), so this asserts it: a
    burst whose relays start too far apart (P prefilling it over many small steps)
    fails here, by name, instead of as a shortfall in the handover count."""
    path = vdp.cluster.wan_path("md")
    streamed: dict[str, int] = {}
    finished_before_release: set[str] = set()

    def release_once_every_relay_streamed_enough(event: TokenEvent) -> None:
        if path.paused and event.finished:
            finished_before_release.add(event.request_id)
        streamed[event.request_id] = event.seq
        if len(streamed) == len(plans) and min(streamed.values()) >= RELAYED - 1:
            path.resume()

    path.pause()
    runs = await vdp.run_all(plans, on_token=release_once_every_relay_streamed_enough)
    assert not finished_before_release, (
        f"{len(finished_before_release)} of {len(plans)} relays finished before MD's path "
        "was released: their requests started too far apart to all be handed over"
    )
    return runs


def handed_over_inside(run) -> bool:
    """RLD streamed the start, MD the rest, and MD's first token is inside the object."""
    first_md = run.sources.index("md") if "md" in run.sources else -1
    return run.sources[0] == "rld" and 0 < first_md < len(run.sources) - 1


@pytest.mark.unit
@pytest.mark.parametrize("mode", ["one-shot", "catch-up"])
async def test_a_handoff_in_the_middle_of_an_object_continues_it_as_mono_would(vdp, mode) -> None:
    prompts = vdp.prompts(4, seed=5, lo=8, hi=40)
    mono = vdp.cluster
    refs = await vdp.run_all(
        [
            mono.plan(f"so-mono-{i}", p, "mono", sampling(i), main="mono")
            for i, p in enumerate(prompts)
        ]
    )
    plans = [
        mono.plan(f"so-{mode}-{i}", p, "P-RLD-MD", sampling(i), handoff=mode)
        for i, p in enumerate(prompts)
    ]
    runs = await relayed_then_handed_over(vdp, plans)
    assert [r.token_ids for r in runs] == [r.token_ids for r in refs]
    for run in runs:
        assert handed_over_inside(run), run.sources
        parsed_person(run.token_ids)
        assert run.events[-1].finish_reason == "stop"
    await vdp.assert_quiescent()


@pytest.mark.unit
async def test_every_request_of_a_burst_is_handed_over_mid_object(vdp_burst) -> None:
    """Forty requests at once (P's burst is several steps of prefill): every relay is
    still inside its object when MD's KV lands, so every request is handed over there.
    The fast guard of the 100-request run below: under a 32-token step budget P
    staggers such a burst and 30 of these 40 finish on the relay before the release."""
    prompts = vdp_burst.prompts(40, seed=17, lo=4, hi=24)
    plans = [
        vdp_burst.cluster.plan(f"burst-{i}", p, "P-RLD-MD", sampling(i))
        for i, p in enumerate(prompts)
    ]
    runs = await relayed_then_handed_over(vdp_burst, plans)
    assert [r.request_id for r in runs if not handed_over_inside(r)] == []
    for run in runs:
        parsed_person(run.token_ids)
    await vdp_burst.assert_quiescent()


@pytest.mark.slow
async def test_a_hundred_sampled_outputs_parse_and_validate_through_p_md_and_p_rld_md(
    vdp_burst,
) -> None:
    """The done-when bar: 100 outputs at temperature 1 with random weights, all valid,
    through P-MD and through P-RLD-MD with every request handed over mid-object; the
    same seeds give the same outputs on both paths. A burst of 100: its prefills must
    not be staggered (``vdp_burst``), or the early relays finish before the release."""
    vdp = vdp_burst
    prompts = vdp.prompts(100, seed=17, lo=4, hi=24)
    direct = await vdp.run_all(
        [vdp.cluster.plan(f"pmd-{i}", p, "P-MD", sampling(i)) for i, p in enumerate(prompts)]
    )
    relayed = await relayed_then_handed_over(
        vdp,
        [vdp.cluster.plan(f"prm-{i}", p, "P-RLD-MD", sampling(i)) for i, p in enumerate(prompts)],
    )
    for run in [*direct, *relayed]:
        parsed_person(run.token_ids)
        assert run.events[-1].finish_reason == "stop"  # the grammar ended it, not max_tokens
    assert [r.token_ids for r in relayed] == [r.token_ids for r in direct]
    assert len({bytes(r.token_ids) for r in direct}) > 90  # sampled, not one output repeated
    assert [r.request_id for r in relayed if not handed_over_inside(r)] == []
    await vdp.assert_quiescent()


@pytest.mark.unit
async def test_a_grammar_the_worker_cannot_compile_reaches_the_client_as_a_400(vdp) -> None:
    """The router checks schemas first; should one still reach a worker that cannot
    compile it, the worker's refusal is the client's 400 with the reason, not a retry."""
    bad = GuidedDecoding(kind="json_schema", schema_text='{"type": "strnig"}')
    plan = vdp.cluster.plan("so-bad", [1, 2, 3], "P-MD", SamplingSpec(guided=bad))
    with pytest.raises(InvalidRequestError, match="strnig") as e:
        await vdp.run_all([plan])
    assert e.value.status == 400
    await vdp.assert_quiescent()


#: The spec whose grammar the engines fail (``doomed_grammar``): an object whose string
#: runs past every ``fail_at`` below, so no output ends before its grammar fails.
LONG_STRING = {
    "type": "object",
    "properties": {"s": {"type": "string", "minLength": 20, "maxLength": 24}},
    "required": ["s"],
}
DOOMED = GuidedDecoding(kind="json_schema", schema_text=json.dumps(LONG_STRING))


def doomed_grammar(monkeypatch: pytest.MonkeyPatch, fail_at: int) -> None:
    """Every engine's matcher of ``DOOMED`` gives up once ``fail_at`` tokens are out, as
    llguidance does on a grammar it cannot go on with (one the router did not catch)."""
    real_start = GrammarCompiler.start

    def start(self: GrammarCompiler, spec: GuidedDecoding, prior_output=()):  # type: ignore[no-untyped-def]
        state = real_start(self, spec, prior_output)
        if spec == DOOMED:
            advance = state.advance

            def failing(output_ids) -> None:  # type: ignore[no-untyped-def]
                if len(output_ids) > fail_at:
                    raise RuntimeError("injected: the grammar engine gave up")
                advance(output_ids)

            state.advance = failing
        return state

    monkeypatch.setattr(GrammarCompiler, "start", start)


async def doomed_beside_innocent(vdp, pipeline: str, setup) -> InvalidRequestError:
    """Run three innocent requests alone, then again beside one whose grammar ``setup``
    dooms: the innocent ones stream the same tokens, the doomed one's error is returned,
    and nothing is left held."""
    cluster = vdp.cluster
    main = "mono" if pipeline == "mono" else "md"
    prompts = vdp.prompts(3, seed=23, lo=8, hi=40)

    def innocent(tag: str) -> list:
        return [
            cluster.plan(f"{tag}-{i}", p, pipeline, sampling(i), main=main)
            for i, p in enumerate(prompts)
        ]

    alone = await vdp.run_all(innocent("alone"))
    setup()
    spec = SamplingSpec(max_tokens=MAX_TOKENS, temperature=1.0, seed=1, guided=DOOMED)
    doomed = asyncio.ensure_future(
        vdp.run_all([cluster.plan("doomed", [5, 6, 7, 8], pipeline, spec, main=main)])
    )
    beside = await vdp.run_all(innocent("beside"))
    with pytest.raises(InvalidRequestError) as e:
        await doomed
    assert [r.token_ids for r in beside] == [r.token_ids for r in alone]
    assert all(not r.errors for r in beside)
    await vdp.assert_quiescent()
    return e.value


@pytest.mark.unit
@pytest.mark.parametrize(
    ("pipeline", "fail_at"),
    [("P-RLD-MD", 0), ("P-RLD-MD", 6), ("P-MD", 0), ("P-MD", 3), ("mono", 4)],
)
async def test_a_grammar_that_fails_in_an_engine_is_that_requests_400_alone(
    vdp, monkeypatch, pipeline, fail_at
) -> None:
    """The grammar fails on P (its first token), on the relay or MD mid-answer, or on
    mono: its own request gets a 400 with the reason (no instance is blamed, nothing is
    retried), while the requests sharing those engines' batches stream on unchanged."""
    error = await doomed_beside_innocent(
        vdp, pipeline, lambda: doomed_grammar(monkeypatch, fail_at)
    )
    assert error.status == 400 and "grammar engine gave up" in error.message


@pytest.mark.unit
async def test_a_grammar_the_engines_cannot_compile_after_admission_is_a_400(
    vdp, monkeypatch
) -> None:
    """The entry checked the spec, but P's engine (and the receivers') cannot compile it
    over the model's vocabulary: P fails the request after accepting it, and the 400
    still reaches the client through the relay and MD, not a retry elsewhere."""
    real = GrammarCompiler._compile

    def compile_(self: GrammarCompiler, spec: GuidedDecoding):  # type: ignore[no-untyped-def]
        if spec == DOOMED:
            raise GrammarRequestError("injected: this vocabulary cannot spell it")
        return real(self, spec)

    def setup() -> None:
        monkeypatch.setattr(GrammarCompiler, "_compile", compile_)

    error = await doomed_beside_innocent(vdp, "P-RLD-MD", setup)
    assert error.status == 400 and "cannot spell it" in error.message
