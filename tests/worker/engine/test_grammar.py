"""Structured output in the engine: the grammar mask, EOS and stop, handed tokens, errors."""

import json

import pytest
import torch

from pdd.common.vocabulary import ToolCallFormat
from pdd.common.wire import GuidedDecoding, GuidedTool
from pdd.worker.engine import Engine
from pdd.worker.engine.grammar import (
    GrammarCompiler,
    GrammarRequestError,
    GrammarStateError,
    mask_logits,
)
from pdd.worker.engine.request import FinishReason
from pdd.worker.engine.sampling import SamplingParams

pytestmark = pytest.mark.unit

#: Bounded everywhere (short strings, small integers, an enum): a sampled output must end.
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
SCHEMA = GuidedDecoding(kind="json_schema", schema_text=json.dumps(PERSON))
TOOLS = (
    GuidedTool(name="add", parameters_json=json.dumps(PERSON)),
    GuidedTool(name="ping"),
)


@pytest.fixture
def engine(tiny):
    return Engine(tiny, block_size=16, num_blocks=128)


def compiler(engine: Engine) -> GrammarCompiler:
    return engine.grammars


def text_ids(text: str) -> list[int]:
    return list(text.encode())


def allowed_bytes(state) -> set[int]:
    return {i for i in range(256) if state.allowed()[i]}


def test_the_mask_allows_exactly_what_the_schema_can_continue_with(engine) -> None:
    state = compiler(engine).start(SCHEMA)
    assert allowed_bytes(state) == {ord("{")}
    state.advance(text_ids('{"name":"ab'))
    in_string = allowed_bytes(state)
    assert ord('"') in in_string and ord("}") in in_string and ord("\n") not in in_string
    out = text_ids('{"name":"ab","age":4')
    state.advance(out)
    assert allowed_bytes(state) == {*b"0123456789", ord(",")}
    assert not state.complete


def test_eos_only_where_the_grammar_accepts_and_a_whole_object_stops(engine) -> None:
    eos = engine.tokenizer.eos_token_ids[0]
    state = compiler(engine).start(SCHEMA)
    out = text_ids('{"name":"ab","age":4,"pet":"cat"')
    state.advance(out)
    assert not state.allowed()[eos]
    state.advance([*out, ord("}")])
    assert state.complete  # nothing may follow: the request stops without sampling EOS


def test_tokens_past_the_tokenizer_are_never_allowed(tiny) -> None:
    wide = GrammarCompiler(tiny.tokenizer, vocab_size=tiny.tokenizer.vocab_size + 13)
    allowed = wide.start(GuidedDecoding(kind="json_object")).allowed()
    assert allowed.shape == (tiny.tokenizer.vocab_size + 13,)
    assert not allowed[tiny.tokenizer.vocab_size :].any()


def test_mask_logits_touches_only_guided_rows(engine) -> None:
    logits = torch.zeros(2, engine.model_config.vocab_size)
    masked = mask_logits(logits, [None, compiler(engine).start(SCHEMA)])
    assert torch.equal(masked[0], logits[0])
    assert masked[1, ord("{")] == 0 and torch.isinf(masked[1]).sum() == logits.shape[1] - 1


@pytest.mark.parametrize("seed", range(4))
def test_sampled_outputs_at_temperature_one_parse_and_stop(engine, seed) -> None:
    params = SamplingParams(max_tokens=80, temperature=1.0, seed=seed, guided=SCHEMA)
    rid = engine.add_request(text_ids("person: "), params)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert outs[-1].finish_reason is FinishReason.STOP
    value = json.loads(bytes(t for o in outs for t in o.new_token_ids))
    assert set(value) == {"name", "age", "pet"} and 0 <= value["age"] <= 99


def test_hermes_tool_calls_one_or_more_with_valid_arguments(engine) -> None:
    spec = GuidedDecoding(kind="tool_calls", tools=TOOLS, single_call=False)
    state = compiler(engine).start(spec)
    one = '<tool_call>\n{"name":"add","arguments":{"name":"x","age":3,"pet":"dog"}}\n</tool_call>'
    state.advance(text_ids(one))
    assert not state.complete and state.allowed()[engine.tokenizer.eos_token_ids[0]]
    state.advance(text_ids(one + '\n<tool_call>\n{"name":"ping","arguments":{}}\n</tool_call>'))
    with pytest.raises(GrammarStateError):  # a tool that is not listed
        compiler(engine).start(spec).advance(text_ids('<tool_call>\n{"name":"rm"'))


def test_a_named_llama3_call_is_one_bare_object(engine) -> None:
    spec = GuidedDecoding(
        kind="tool_calls", tools=TOOLS[1:], tool_call_format=ToolCallFormat.LLAMA3_JSON
    )
    state = compiler(engine).start(spec)
    assert allowed_bytes(state) == {ord("{")}
    state.advance(text_ids('{"name":"ping","parameters":{}}'))
    assert state.complete


def test_a_resumed_request_starts_after_what_was_emitted(engine) -> None:
    sent = text_ids('{"name":"ab",')
    state = compiler(engine).start(SCHEMA, sent)
    assert allowed_bytes(state) == {ord('"')}
    state.advance(text_ids('"age":1,"pet":"cat"}'))  # output positions count from 0
    assert state.complete
    with pytest.raises(GrammarRequestError, match="sent so far"):
        compiler(engine).start(SCHEMA, [ord("[")])


def test_a_resumed_request_reads_its_prior_output_from_the_prompt(engine) -> None:
    """The engine starts the grammar after the prompt's last ``prior_output_tokens``."""
    sent = text_ids('{"name":"ab","age":')
    params = SamplingParams(max_tokens=30, guided=SCHEMA, prior_output_tokens=len(sent))
    rid = engine.add_request(text_ids("person: ") + sent, params)
    [out] = engine.step()
    assert out.request_id == rid and out.new_token_ids[0] in b"0123456789"
    broken = SamplingParams(guided=SCHEMA, prior_output_tokens=1)
    with pytest.raises(GrammarRequestError, match="sent so far"):
        engine.add_request(text_ids("person: ["), broken)
    engine.abort(rid)


def test_handed_over_tokens_advance_the_grammar_before_the_next_pick(engine) -> None:
    """As a main decode after a handoff: the tokens another instance sampled are appended,
    and the next pick continues the same object (here only digits or ',' may follow)."""
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=3, guided=SCHEMA)
    rid = engine.add_request(text_ids("person: "), params)
    engine.step()  # prefill + the first token, '{'
    engine.extend(rid, text_ids('"name":"ab","age":1'))
    [out] = engine.step()
    assert out.new_token_ids[0] in {*b"0123456789", ord(",")}


def test_a_schema_the_engine_cannot_compile_is_a_request_error(engine) -> None:
    bad = GuidedDecoding(kind="json_schema", schema_text=json.dumps({"type": "strnig"}))
    with pytest.raises(GrammarRequestError, match="strnig"):
        engine.add_request([1, 2], SamplingParams(guided=bad))
    assert not engine.has_unfinished()


def test_a_broken_handed_over_token_fails_the_request_with_the_reason(engine) -> None:
    params = SamplingParams(max_tokens=20, guided=SCHEMA)
    rid = engine.add_request(text_ids("x"), params)
    engine.step()
    engine.extend(rid, [ord("]")])
    [out] = engine.step()
    assert out.finished and out.finish_reason is FinishReason.ABORT
    assert "breaks the grammar" in out.error


def test_compiled_grammars_are_cached_by_spec(engine) -> None:
    c = compiler(engine)
    c.start(SCHEMA)
    c.start(SCHEMA, [ord("{")])
    c.start(GuidedDecoding(kind="json_object"))
    assert c.num_compiled == 2
