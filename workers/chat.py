"""Conversations: a row's messages rendered with a chat template into tokens and a label mask.

A row holds `messages` ([{role, content}], roles system, user, assistant, tool) or ShareGPT's
`conversations` ([{from, value}], from human, gpt, system, tool). The conversation is rendered
into pieces of text, each either trained (the loss counts the tokens) or not:

- ChatML (the default, and a tokenizer without a chat template): each message is
  `<|im_start|>{role}\\n{content}<|im_end|>\\n`; an assistant message's content and its
  `<|im_end|>` are trained, the header and the newline after the end marker are not.
- A tokenizer's own Jinja chat template (tokenizer_config.json's `chat_template`): the template
  is rendered for the first k messages, for k = 1..n; what message k adds is the text after the
  rendering of the k - 1 before it (a template must render a conversation as its messages one
  after another: one that rewrites earlier turns, e.g. dropping old reasoning, is refused; one
  that takes back its own closing text of the last message once another follows, as Qwen 2.5
  does between two tool replies, is followed). In
  an assistant message's text its content is found as written (or stripped, as `| trim`
  templates show it): the content and what follows it up to trailing whitespace (the end
  marker, such as `<|eot_id|>` or `<|im_end|>`) are trained; the header before it is not. A
  template with `{% generation %}` blocks marks what is trained itself: what its blocks render.

Each piece is tokenized on its own and the pieces' tokens put end to end, so no token straddles
a trained and an untrained part (a tokenizer may merge across a boundary when given the whole
text; here it cannot). With train_on=all every token is trained.

The mask marks targets: the batch's labels[i] is input_ids[i + 1] where token i + 1 is trained,
else -100 (omniload.batch_arrays.expand). A conversation longer than seq_len is cut after the
last whole message that fits and has trained tokens (--long-chats truncate), or dropped (drop,
and when no such message fits): it is never split between rows.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from omniload.errors import ConfigError
from omniload.formats.lane_config import ChatConfig
from omniload.workers.transforms import tokenizer_file

CHATML_START, CHATML_END = "<|im_start|>", "<|im_end|>"
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "tool": "tool"}


class ChatError(ValueError):
    """A conversation that cannot be rendered; the message says which message and why."""


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class Piece:
    text: str
    trained: bool
    message: int  # the message it belongs to


@dataclass(frozen=True, slots=True)
class ChatSample:
    tokens: np.ndarray  # int32
    mask: np.ndarray  # uint8, 1 where the token is trained
    truncated: bool = False


def parse_messages(value: object) -> list[Message]:
    """The messages of a row's `messages` or `conversations` value; ChatError naming what is wrong."""
    if not isinstance(value, (list, tuple)) or not value:
        raise ChatError(f"has no messages (expected a list of {{role, content}}, got {_shown(value)})")
    messages = []
    for i, raw in enumerate(value):
        if not isinstance(raw, dict):
            raise ChatError(f"message {i} is {_shown(raw)}, not a mapping with role and content")
        if "role" in raw:
            role, content = raw["role"], raw.get("content")
            if role not in ROLES:
                raise ChatError(f"message {i} has role {role!r}; expected one of {', '.join(ROLES)}")
        elif "from" in raw:
            role, content = SHAREGPT_ROLES.get(raw["from"]), raw.get("value")
            if role is None:
                raise ChatError(f"message {i} is from {raw['from']!r}; expected one of {', '.join(SHAREGPT_ROLES)}")
        else:
            raise ChatError(f"message {i} has neither 'role' nor 'from' (keys: {', '.join(map(str, raw))})")
        messages.append(Message(role, _text(content, i)))
    return messages


def _text(content: object, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)  # OpenAI-style text parts
    raise ChatError(f"message {i} has content {_shown(content)}; expected text")


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


Render = Callable[[Sequence[Message]], str]


def chatml_pieces(messages: Sequence[Message], train_all: bool = False) -> list[Piece]:
    pieces = []
    for i, m in enumerate(messages):
        trained = train_all or m.role == "assistant"
        pieces += [
            Piece(f"{CHATML_START}{m.role}\n", train_all, i),
            Piece(m.content, trained, i),
            Piece(CHATML_END, trained, i),
            Piece("\n", train_all, i),
        ]
    return pieces


_STAND_IN = "\ue000omniload-reply\ue000"  # private-use characters: in no template and no tokenizer's specials
# What a template's {% generation %} block renders is put between these two (private-use, as
# _STAND_IN) so the pieces can find it; they never reach the tokenizer.
_GENERATION_OPEN, _GENERATION_CLOSE = "\ue001", "\ue002"


def template_pieces(messages: Sequence[Message], render: Render, train_all: bool = False) -> list[Piece]:
    """The pieces of a conversation under a chat template, by rendering growing prefixes (see above)."""
    by_message: list[list[Piece]] = []
    before = ""
    for i, m in enumerate(messages):
        text = render(messages[: i + 1])
        if not text.startswith(before):
            kept = len(os.path.commonprefix([before, text]))
            if not _closes_later(messages, i - 1, render, before[kept:], by_message):
                raise ChatError(
                    f"the chat template renders message {i} by changing what it rendered for the messages "
                    "before it; omniload needs a template that renders a conversation message after message"
                )
            _trim(by_message[-1], len(before) - kept)
            before = before[:kept]
        added, before = text[len(before) :], text
        if _GENERATION_OPEN in text:  # the template marks what is trained itself
            by_message.append(_generation_pieces(added, train_all, i))
        elif train_all or m.role != "assistant":
            by_message.append([Piece(added, train_all, i)])
        else:
            by_message.append(_reply_pieces(messages, i, render, added, len(text) - len(added)))
    return [piece for pieces in by_message for piece in pieces]


def _closes_later(
    messages: Sequence[Message], last: int, render: Render, dropped: str, by_message: list[list[Piece]]
) -> bool:
    """Whether a template may take back the `dropped` end of message `last`'s text once another
    follows: it must be the template's own text after that message's content (Qwen 2.5 ends a
    tool reply with <|im_end|> only when no tool reply follows), found by rendering the message
    with a stand-in content, and lie within that message's text. A template that rewrites
    earlier turns (dropping old reasoning) takes back content, and is refused."""
    if not by_message or len(dropped) > sum(len(p.text) for p in by_message[-1]):
        return False
    if _GENERATION_OPEN in dropped or _GENERATION_CLOSE in dropped:  # (the pieces hold no marks to count)
        return False
    around = _around_content(messages, last, render)
    return around is not None and around[1].endswith(dropped)


def _trim(pieces: list[Piece], count: int) -> None:
    """Take `count` characters off the end of a message's pieces."""
    while count:
        last = pieces.pop()
        if len(last.text) > count:
            pieces.append(Piece(last.text[: len(last.text) - count], last.trained, last.message))
            return
        count -= len(last.text)


def _generation_pieces(added: str, train_all: bool, i: int) -> list[Piece]:
    """A message's text under a template with {% generation %} blocks: what the blocks render
    is trained, the rest is not (as transformers' return_assistant_tokens_mask)."""
    pieces = []
    for j, part in enumerate(added.replace(_GENERATION_CLOSE, _GENERATION_OPEN).split(_GENERATION_OPEN)):
        pieces.append(Piece(part, train_all or j % 2 == 1, i))
    return pieces


def _reply_pieces(messages: Sequence[Message], i: int, render: Render, added: str, earlier: int) -> list[Piece]:
    """An assistant message's text cut at its content: the header before it is not trained, the
    content and the end marker after it are."""
    around = _around_content(messages, i, render)
    shown = around is not None and len(around[0]) >= earlier
    head, rest = (around[0][earlier:], around[1]) if around is not None else ("", "")
    if not shown or not added.startswith(head) or not added.endswith(rest) or len(head) + len(rest) > len(added):
        raise ChatError(f"the chat template does not show the content of message {i} (assistant) as written")
    at, content = len(head), added[len(head) : len(added) - len(rest)]
    tail = added[at + len(content) :]
    marker = tail.rstrip()
    return [
        Piece(added[:at], False, i),
        Piece(content, True, i),
        Piece(marker, True, i),
        Piece(tail[len(marker) :], False, i),
    ]


def _around_content(messages: Sequence[Message], i: int, render: Render) -> tuple[str, str] | None:
    """The text before and after message i's content when the first i + 1 messages are rendered,
    found with a stand-in content, so a content that also occurs in the template's own text (say
    "end" inside "<|im_end|>") is never mistaken for it; None if the template does not show it."""
    head, found, after = render([*messages[:i], Message(messages[i].role, _STAND_IN)]).partition(_STAND_IN)
    return (head, after) if found else None


def rendered_text(text: str) -> str:
    """What a Render returned, as the template renders it (without the generation marks)."""
    return text.replace(_GENERATION_OPEN, "").replace(_GENERATION_CLOSE, "")


def jinja_render(config: ChatConfig) -> Render:
    """The tokenizer's template as a function of the messages, rendered as transformers'
    apply_chat_template renders it: a sandbox, trim_blocks and lstrip_blocks, loop controls,
    its `tojson` (no ASCII or HTML escaping, keys in their order, indent= and separators=), its
    {% generation %} tag, tools and documents None, bos_token and eos_token, no generation
    prompt. One difference, on purpose: strftime_now gives a fixed date, so the batches of a run
    do not depend on the day it ran. The text returned carries generation marks
    (rendered_text removes them)."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_marked"), [], [], body).set_lineno(lineno)

        def _marked(self, caller: Callable[[], str]) -> str:
            return _GENERATION_OPEN + caller() + _GENERATION_CLOSE

    def raise_exception(message: str) -> None:
        raise ChatError(f"the chat template refused the conversation: {message}")

    def strftime_now(fmt: str) -> str:  # templates that print today's date get a fixed one: batches are reproducible
        import datetime

        return datetime.date(2024, 1, 1).strftime(fmt)

    def tojson(
        value: object, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    template = env.from_string(config.template or "")

    def render(messages: Sequence[Message]) -> str:
        try:
            return template.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                tools=None,
                documents=None,
                bos_token=config.bos,
                eos_token=config.eos,
                add_generation_prompt=False,
            )
        except jinja2.TemplateError as exc:
            raise ChatError(f"the chat template failed: {type(exc).__name__}: {exc}") from None

    return render


def conversation_pieces(value: object, config: ChatConfig, render: Render | None) -> list[Piece]:
    messages = parse_messages(value)
    train_all = config.train_on == "all"
    return chatml_pieces(messages, train_all) if render is None else template_pieces(messages, render, train_all)


def assemble(pieces: Sequence[Piece], tokens: Sequence[np.ndarray]) -> tuple[ChatSample, np.ndarray, np.ndarray]:
    """The conversation's tokens and mask from its pieces' tokens; also where each message's
    tokens end, and which messages have trained tokens (messages are numbered from 0, in order)."""
    count = pieces[-1].message + 1 if pieces else 0
    ends, trains = np.zeros(count, dtype=np.int64), np.zeros(count, dtype=bool)
    total = 0
    for piece, ids in zip(pieces, tokens):
        total += len(ids)
        ends[piece.message] = total
        trains[piece.message] |= piece.trained and len(ids) > 0
    lengths = [len(t) for t in tokens]
    ids = np.concatenate([np.asarray(t, dtype=np.int32) for t in tokens]) if tokens else np.zeros(0, np.int32)
    mask = np.repeat(np.array([p.trained for p in pieces], dtype=np.uint8), lengths)
    return ChatSample(ids, mask), ends, trains


def fit(
    sample: ChatSample, message_ends: np.ndarray, trains: np.ndarray, seq_len: int, drop: bool
) -> ChatSample | None:
    """The conversation within seq_len tokens: whole, cut after the last whole message that fits
    and has trained tokens, or None (dropped)."""
    if len(sample.tokens) <= seq_len:
        return sample
    if drop:
        return None
    fitting = np.flatnonzero((message_ends <= seq_len) & trains)
    if not len(fitting):
        return None
    stop = int(message_ends[fitting[-1]])
    return ChatSample(sample.tokens[:stop], sample.mask[:stop], truncated=True)


def encode(
    values: Sequence[Any], config: ChatConfig, tokenize: Callable[[list[str]], list[np.ndarray]], render: Render | None
) -> list[ChatSample | ChatError | int]:
    """Each conversation as a ChatSample, the ChatError that it is, or (dropped) its token count.
    The pieces of all conversations are tokenized in one call."""
    rendered: list[list[Piece] | ChatError] = []
    for value in values:
        try:
            rendered.append(conversation_pieces(value, config, render))
        except ChatError as exc:
            rendered.append(exc)
    texts = [p.text for pieces in rendered if isinstance(pieces, list) for p in pieces if p.text]
    flat = iter(tokenize(texts))
    out: list[ChatSample | ChatError | int] = []
    for pieces in rendered:
        if isinstance(pieces, ChatError):
            out.append(pieces)
            continue
        tokens = [next(flat) if p.text else np.zeros(0, np.int32) for p in pieces]
        if not any(len(t) for t in tokens):  # a document of no tokens has no place in a batch
            out.append(ChatError("the conversation renders to no tokens"))
            continue
        sample, ends, trains = assemble(pieces, tokens)
        fitted = fit(sample, ends, trains, config.seq_len, config.drop_long)
        out.append(len(sample.tokens) if fitted is None else fitted)
    return out


def chat_config(tokenizer: str, seq_len: int, train_on: str, drop_long: bool) -> ChatConfig:
    """A chat source's config: the chat template of a tokenizer.json's tokenizer_config.json
    beside it (with its bos and eos tokens), else ChatML. Raises ConfigError naming the file
    when the template cannot be read or compiled."""
    template, bos, eos = _template_of(tokenizer)
    config = ChatConfig(seq_len, train_on, drop_long, template, bos, eos)
    if template is not None:
        try:
            jinja_render(config)
        except ImportError:
            raise ConfigError(
                f"tokenizer {tokenizer!r} has a chat template, which needs Jinja2: pip install 'omniload[tokenizers]'"
            ) from None
        except Exception as exc:  # jinja2.TemplateSyntaxError and kin: the file is at fault
            raise ConfigError(f"the chat template of {tokenizer!r} does not compile: {exc}") from None
    return config


def _template_of(tokenizer: str) -> tuple[str | None, str, str]:
    file = tokenizer_file(tokenizer)
    if file is None:
        return None, "", ""
    path = os.path.join(os.path.dirname(os.path.abspath(file)), "tokenizer_config.json")
    if not os.path.isfile(path):
        return None, "", ""
    try:
        with open(path, "rb") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"tokenizer config {path!r} cannot be read: {exc}") from None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    if template is not None and not isinstance(template, str):
        raise ConfigError(f"tokenizer config {path!r}: chat_template is {type(template).__name__}, not text")
    return template, _token(config.get("bos_token")), _token(config.get("eos_token"))


def _token(value: object) -> str:
    """A special token as tokenizer_config.json gives it: text, or {"content": text, ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""
