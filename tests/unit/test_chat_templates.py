"""Real chat templates render byte for byte as transformers' apply_chat_template renders them:
Llama 3.1 Instruct, Qwen 2.5 Instruct and a plain ChatML one (tests/chat_templates/, each its
model's tokenizer_config.json chat_template), plus the {% generation %} tag that marks what is
trained. The text a conversation's pieces are tokenized from is the template's text."""

from __future__ import annotations

from pathlib import Path

import pytest

from omniload.formats.lane_config import ChatConfig
from omniload.workers.chat import Message, jinja_render, parse_messages, rendered_text, template_pieces

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TEMPLATES = Path(__file__).parent.parent / "chat_templates"
BOS, EOS = "<|begin_of_text|>", "<|eot_id|>"

CONVERSATIONS = {
    "plain": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello world"},
        {"role": "assistant", "content": "hi there"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "hello"},
    ],
    # what the default Jinja tojson escapes (non-ASCII, <, >, &, ') and Hugging Face's does not
    "escapes": [
        {"role": "user", "content": "Ist 2 < 3 && 5 > 4? Ça va, l'ami? 日本語"},
        {"role": "assistant", "content": ' Oui: "2 < 3" & naïve café.\n'},
    ],
    # a tool's reply: Llama 3.1 shows it through tojson (a string is iterable to Jinja)
    "tool": [
        {"role": "system", "content": "You call tools."},
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": "Checking."},
        {"role": "tool", "content": '{"temp": "3 °C", "sky": "<cloudy> & grey"}'},
        {"role": "assistant", "content": "3 °C, cloudy & grey."},
    ],
    # two tool replies in a row (parallel calls): Qwen 2.5 closes a tool turn only once it sees
    # that no tool reply follows, so the first reply's <|im_end|> is taken back
    "tools": [
        {"role": "user", "content": "Weather in Bern and Basel?"},
        {"role": "assistant", "content": "Checking both."},
        {"role": "tool", "content": '{"city": "Bern", "temp": 2}'},
        {"role": "tool", "content": '{"city": "Basel", "temp": 4}'},
        {"role": "assistant", "content": "Bern 2 °C, Basel 4 °C."},
    ],
    # the same with contents that occur in the template's own text ("m", "end" in <|im_end|>)
    "tools-short": [
        {"role": "user", "content": "m"},
        {"role": "assistant", "content": "end"},
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "ok"},
    ],
}


def _hf_render(template: str, conversation: list[dict]) -> str:
    empty = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=empty, bos_token=BOS, eos_token=EOS)
    tokenizer.chat_template = template
    return str(tokenizer.apply_chat_template(conversation, tokenize=False))


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("name", ["llama-3.1-instruct", "qwen-2.5-instruct", "chatml"])
def test_a_real_template_renders_as_transformers_renders_it(name, conversation):
    template = (TEMPLATES / f"{name}.jinja").read_text()
    messages = CONVERSATIONS[conversation]
    render = jinja_render(ChatConfig(4096, "assistant", False, template, BOS, EOS))
    expected = _hf_render(template, messages)
    parsed = parse_messages(messages)
    assert rendered_text(render(parsed)) == expected
    pieces = template_pieces(parsed, render)
    assert "".join(p.text for p in pieces) == expected, "the pieces tokenized are the template's text"
    trained = [p.text for p in pieces if p.trained and p.text]
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    assert [t for t in trained if t.strip() not in ("<|eot_id|>", "<|im_end|>")] == [
        r.strip() if name == "llama-3.1-instruct" else r for r in replies
    ]


# the form transformers' docs give for return_assistant_tokens_mask: a ChatML template whose
# {% generation %} block holds what the model is trained to write
GENERATION = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
)


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_a_generation_block_is_what_is_trained_where_transformers_puts_its_assistant_mask(conversation):
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = CONVERSATIONS[conversation]
    (expected,), (spans,) = render_jinja_template(
        [messages], chat_template=GENERATION, return_assistant_tokens_mask=True, bos_token=BOS, eos_token=EOS
    )
    render = jinja_render(ChatConfig(4096, "assistant", False, GENERATION, BOS, EOS))
    pieces = template_pieces(parse_messages(messages), render)
    assert "".join(p.text for p in pieces) == expected
    ours, at = [], 0
    for piece in pieces:
        if piece.trained and piece.text:
            ours.append((at, at + len(piece.text)))
        at += len(piece.text)
    assert ours == [tuple(span) for span in spans]
    assert all(expected[start:end].endswith("<|im_end|>") for start, end in ours)
    everything = template_pieces(parse_messages(messages), render, train_all=True)
    assert all(p.trained for p in everything), "train_on=all trains every token whatever the blocks say"


def test_a_template_that_prints_the_date_gets_a_fixed_one_so_a_rerun_makes_the_same_batches():
    template = "{{ strftime_now('%d %b %Y') }}{% for m in messages %}{{ m.content }}{% endfor %}"
    render = jinja_render(ChatConfig(4096, "assistant", False, template, BOS, EOS))
    assert render([Message("user", "x")]) == "01 Jan 2024x"
