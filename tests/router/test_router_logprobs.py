"""Logprobs, penalties and logit bias through ``pdd router`` with the official openai client."""

import openai
import pytest

pytestmark = pytest.mark.integration

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Count the sheep jumping over the fence."}]
PROMPT = "The sheep jump over the"


@pytest.fixture(scope="module")
def api(worker_flags, start_router) -> openai.OpenAI:
    router = start_router(*worker_flags())
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)


def test_chat_logprobs_streaming_and_not(api):
    args = {"model": MODEL, "messages": MESSAGES, "max_tokens": 16, "temperature": 0.0}
    extra = {"ignore_eos": True}
    whole = api.chat.completions.create(**args, logprobs=True, top_logprobs=3, extra_body=extra)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 16
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the top
        assert entry.logprob <= 0
    raw = bytes(b for entry in content for b in entry.bytes)  # the tokens' own bytes
    assert raw.decode("utf-8", errors="replace") == whole.choices[0].message.content
    stream = api.chat.completions.create(
        **args, logprobs=True, top_logprobs=3, stream=True, extra_body=extra
    )
    streamed = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    plain = api.chat.completions.create(**args, extra_body=extra)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_and_offsets(api):
    out = api.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.0, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    for top, value in zip(lp.top_logprobs, lp.token_logprobs, strict=True):
        # Alternatives whose texts coincide (bytes that are no character alone) share a key.
        assert 1 <= len(top) <= 2
        assert all(v <= value + 1e-6 for v in top.values())  # greedy: the token is the top
    expected = [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]
    assert lp.text_offset == expected


def test_tokens_named_by_id_match_the_tokens_named_by_text(api):
    """``return_tokens_as_token_ids``: the same greedy tokens, each named by its id (the
    tiny model's ids are bytes, so the id is the byte of its text), offsets unchanged."""
    args = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "logprobs": 2}
    extra = {"ignore_eos": True}
    by_text = api.completions.create(**args, extra_body=extra).choices[0]
    by_id = api.completions.create(
        **args, extra_body={**extra, "return_tokens_as_token_ids": True}
    ).choices[0]
    assert by_id.text == by_text.text
    ids = [int(t.removeprefix("token_id:")) for t in by_id.logprobs.tokens]
    assert all(t.startswith("token_id:") for t in by_id.logprobs.tokens)
    assert bytes(ids).decode("utf-8", errors="replace") == by_text.text
    assert by_id.logprobs.text_offset == by_text.logprobs.text_offset
    assert all(k.startswith("token_id:") for top in by_id.logprobs.top_logprobs for k in top)
    streamed = api.completions.create(
        **args, stream=True, extra_body={**extra, "return_tokens_as_token_ids": True}
    )
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.tokens]  # fmt: skip
    assert tokens == by_id.logprobs.tokens
    chat = api.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0.0, logprobs=True,
        top_logprobs=1, extra_body={**extra, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    for entry in chat.choices[0].logprobs.content:
        assert entry.token == f"token_id:{entry.bytes[0]}"  # a byte token's id is its byte


def test_penalties_and_bias_change_the_greedy_output(api):
    args = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0.0}
    plain = api.completions.create(**args, extra_body={"ignore_eos": True}).choices[0].text
    penalized = (
        api.completions.create(
            **args, frequency_penalty=2.0, presence_penalty=2.0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    assert penalized != plain
    assert len(set(penalized)) >= len(set(plain))
    banned = next(ord(c) for c in plain if ord(c) < 128)  # the tiny model's tokens are bytes
    biased = (
        api.completions.create(
            **args, logit_bias={str(banned): -100}, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    assert chr(banned) not in biased


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": {"5": 150}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"extra_body": {"min_tokens": 50}}, "min_tokens"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_out_of_range_sampling_is_a_400_naming_the_field(api, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, **kwargs)
    assert param in str(info.value)


def test_completion_logprobs_above_five_is_a_400(api):
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=6)
