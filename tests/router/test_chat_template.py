"""Chat templates render exactly as transformers renders them.

The templates in chat_templates/ are real-looking: Llama-3 style, Llama-3.1 style with
JSON tool calls, Qwen2.5 style ChatML with tools, Qwen3 style (tools and ``<think>`` in
the assistant history), and a strict one that relies on trim_blocks/lstrip_blocks, loop controls,
the generation tag and raise_exception.
"""

import json
from pathlib import Path

import jinja2
import pytest
from transformers import AutoTokenizer

from pdd.common.vocabulary import ToolCallFormat
from pdd.router.chat_template import ChatTemplate, ChatTemplateError, render_plain
from pdd.router.tokenization import load_prompt_tokenizer
from pdd.router.tool_calls import detect_format

pytestmark = pytest.mark.unit

TEMPLATES = Path(__file__).parent / "chat_templates"
LLAMA3 = (TEMPLATES / "llama3.jinja").read_text()
QWEN = (TEMPLATES / "qwen.jinja").read_text()
STRICT = (TEMPLATES / "strict.jinja").read_text()
QWEN3 = (TEMPLATES / "qwen3.jinja").read_text()
LLAMA31 = (TEMPLATES / "llama31.jinja").read_text()

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "hello world  "},
    {"role": "assistant", "content": "how are you?"},
    {"role": "user", "content": "The quick brown fox, ünïcödé ✓"},
]
TOOL_CONVERSATION = [
    {"role": "user", "content": "weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "content": "sunny"},
    {"role": "tool", "content": "22 C"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": 'Weather <now> & "here"',
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CASES = [
    ("llama3", LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
    ("qwen", QWEN, None, "<|im_end|>"),
    ("strict", STRICT, "<|begin_of_text|>", "<|eot_id|>"),
    ("qwen3", QWEN3, None, "<|im_end|>"),
    ("llama31", LLAMA31, "<|begin_of_text|>", "<|eot_id|>"),
]
#: Qwen3's assistant history: the reasoning of turns before the last user query is
#: dropped, that of the turns after it (a tool loop) is kept in ``<think>``.
THINKING_CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": "<think>\nold reasoning\n</think>\n\nIt is sunny."},
    {"role": "user", "content": "and in Rome?"},
    {
        "role": "assistant",
        "content": "<think>\nI should call the tool.\n</think>\n\n",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
        ],
    },
    {"role": "tool", "content": "rainy"},
]


def _pair(write_checkpoint, template, bos, eos):
    model_dir = write_checkpoint(template, bos, eos)
    return load_prompt_tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir))


@pytest.mark.parametrize(("name", "template", "bos", "eos"), CASES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_equals_transformers(
    write_checkpoint, name, template, bos, eos, add_generation_prompt
):
    ours, hf = _pair(write_checkpoint, template, bos, eos)
    expected = hf.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours.template.render(CONVERSATION, add_generation_prompt) == expected
    expected_ids = hf.apply_chat_template(
        CONVERSATION, tokenize=True, add_generation_prompt=add_generation_prompt
    )["input_ids"]
    assert ours.chat_ids(CONVERSATION, add_generation_prompt) == expected_ids


def test_tools_and_tool_calls_equal_transformers(write_checkpoint):
    ours, hf = _pair(write_checkpoint, QWEN, None, "<|im_end|>")
    expected = hf.apply_chat_template(
        TOOL_CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert "<tools>" in expected and '"Paris"' in expected
    assert ours.template.render(TOOL_CONVERSATION, True, tools=TOOLS) == expected


@pytest.mark.parametrize(
    ("template", "bos", "conversation", "shows"),
    [
        (QWEN3, None, THINKING_CONVERSATION, "<think>\nI should call the tool.\n</think>"),
        (QWEN3, None, TOOL_CONVERSATION, "<tool_response>\nsunny\n</tool_response>"),
        (LLAMA31, "<|begin_of_text|>", TOOL_CONVERSATION[:3], '"parameters": {"city": "Paris"}'),
    ],
    ids=["qwen3-thinking", "qwen3-tools", "llama31-tools"],
)
def test_qwen3_and_llama31_tool_conversations_equal_transformers(
    write_checkpoint, template, bos, conversation, shows
):
    eos = "<|im_end|>" if bos is None else "<|eot_id|>"
    ours, hf = _pair(write_checkpoint, template, bos, eos)
    for kwargs in ({}, {"enable_thinking": False}):
        expected = hf.apply_chat_template(
            conversation, tools=TOOLS, tokenize=False, add_generation_prompt=True, **kwargs
        )
        assert shows in expected
        assert ours.template.render(conversation, True, tools=TOOLS, **kwargs) == expected
    if template is QWEN3:
        assert "old reasoning" not in expected  # before the last query: dropped
    fmt = ToolCallFormat.HERMES if template is QWEN3 else ToolCallFormat.LLAMA3_JSON
    assert detect_format(template) is fmt  # what the router reads the output with


def test_tojson_does_not_html_escape():
    rendered = ChatTemplate("{{ messages[0] | tojson }}").render(
        [{"role": "user", "content": "<&>"}]
    )
    assert rendered == '{"role": "user", "content": "<&>"}'


def test_raise_exception_is_a_typed_error(write_checkpoint):
    ours, hf = _pair(write_checkpoint, STRICT, "<|begin_of_text|>", "<|eot_id|>")
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(jinja2.TemplateError):
        hf.apply_chat_template(bad, tokenize=False)
    with pytest.raises(ChatTemplateError, match="must alternate"):
        ours.chat_ids(bad)


def test_sandbox_blocks_escapes():
    escape = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        escape.render([{"role": "user", "content": "x"}])
    mutate = ChatTemplate("{{ messages.append(1) }}")
    with pytest.raises(ChatTemplateError):
        mutate.render([{"role": "user", "content": "x"}])


def test_broken_template_is_a_typed_error():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_kwargs_override_special_tokens():
    template = ChatTemplate("{{ bos_token }}|{{ flag }}", {"bos_token": "<s>"})
    assert template.render([], flag=1) == "<s>|1"
    assert template.render([], bos_token="[B]", flag=2) == "[B]|2"


def test_plain_fallback():
    text = render_plain(
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"},
        ]
    )
    assert text == "user: hi\nassistant: yo\nassistant:"
    assert render_plain([{"role": "user", "content": None}], False) == "user: \n"


def test_no_template_uses_plain_fallback_with_bos(write_checkpoint):
    model_dir = write_checkpoint(None, "<|begin_of_text|>", "<|eot_id|>")
    ours = load_prompt_tokenizer(model_dir)
    assert ours.template is None
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    messages = [{"role": "user", "content": "hello"}]
    assert ours.chat_ids(messages) == hf(render_plain(messages))["input_ids"]
    assert ours.chat_ids(messages)[0] == hf.convert_tokens_to_ids("<|begin_of_text|>")


def test_chat_template_jinja_file_wins(write_checkpoint):
    model_dir = write_checkpoint(LLAMA3, "<|begin_of_text|>", "<|eot_id|>")
    (model_dir / "chat_template.jinja").write_text("JINJA{{ messages | length }}")
    assert load_prompt_tokenizer(model_dir).template.render(CONVERSATION) == "JINJA4"


def test_named_template_list(write_checkpoint):
    named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    model_dir = write_checkpoint(named, None, "<|im_end|>")
    assert load_prompt_tokenizer(model_dir).template.render([]) == "D"


def test_the_plain_fallback_shows_the_tools_and_the_hermes_call_convention():
    messages = [{"role": "user", "content": "weather?"}]
    text = render_plain(messages, True, tools=TOOLS)
    first, second, rest = text.split("\n", 2)
    assert first.startswith("tools: [") and json.loads(first[len("tools: ") :]) == TOOLS
    assert "<tool_call>" in second and rest == "user: weather?\nassistant:"
    assert render_plain(messages, True, tools=None) == "user: weather?\nassistant:"
