"""Chats as token streams: how tool calls are written and parsed (`rollout.multi_turn.format`),
and how each new message becomes the tokens appended after the policy's turn (`Transcript`).

Formats:
- `hermes`: the policy writes `<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`
  (any number per turn), as the chat templates of Qwen2.5, Qwen3 and Hermes models teach it;
  the tools' schemas reach the template as `tools=`, their results come back as `tool` messages.
- `tiny`: for the built-in character-level models, whose vocabulary has no braces or quotes: a
  turn that ends with `=` is a call, `NAME:ARGUMENT=` or just `ARGUMENT=` for the first tool,
  the argument filling the tool's first required parameter (`37*48+19=` asks the calculator).
  `=` therefore ends a policy turn too.

A call that cannot be parsed (bad JSON, an unknown tool, a missing name) is a `ToolCall` with
an `error`: the policy reads the error as the tool's answer, and it is counted.

Token streams: the chat template renders the whole conversation as text. After each policy turn
the conversation is rendered again with the new messages; the part of the text after what the
policy wrote is the observation, tokenized on its own. The policy's own tokens are never
re-tokenized, so the log-probs the rollout recorded are those of the tokens trained on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: dict | None = None     # None when the call could not be parsed
    error: str = ""                   # why it could not be parsed


class HermesFormat:
    """`<tool_call>{json}</tool_call>` (see the module docstring)."""

    name = "hermes"
    stop_strings: tuple[str, ...] = ()
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str, tools: Sequence[str]) -> list[ToolCall]:
        calls = []
        for body in self._CALL.findall(text):
            calls.append(self._one(body.strip(), tools))
        # A call the policy opened and never closed (e.g. cut by the token budget).
        if text.count("<tool_call>") > text.count("</tool_call>"):
            calls.append(ToolCall("?", error="a <tool_call> without its </tool_call>"))
        return calls

    @staticmethod
    def _one(body: str, tools: Sequence[str]) -> ToolCall:
        try:
            call = json.loads(body)
        except json.JSONDecodeError as err:
            return ToolCall("?", error=f"the tool call is not valid JSON ({err.msg} at "
                                       f"character {err.pos})")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return ToolCall("?", error='a tool call must be a JSON object with a "name"')
        name, arguments = call["name"], call.get("arguments", {})
        if isinstance(arguments, str):   # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return ToolCall(name, error=f"{name}: the arguments are not valid JSON")
        if name not in tools:
            return ToolCall(name, error=f"there is no tool {name!r}; the tools are "
                                        f"{', '.join(tools)}")
        return ToolCall(name, arguments)


class TinyFormat:
    """`[NAME:]ARGUMENT=` ending a turn (see the module docstring)."""

    name = "tiny"
    stop_strings = ("=",)

    def __init__(self, first_parameters: dict[str, str]) -> None:
        """`first_parameters`: tool name -> the parameter a bare argument fills."""
        self.first_parameters = first_parameters

    def parse(self, text: str, tools: Sequence[str]) -> list[ToolCall]:
        if not text.endswith("="):
            return []
        body = text[:-1]
        name, sep, argument = body.partition(":")
        if not sep or name not in tools:
            name, argument = tools[0], body
        if not argument.strip():
            return [ToolCall(name, error=f"{name}: the call has no argument")]
        return [ToolCall(name, {self.first_parameters[name]: argument})]


FORMATS = ("hermes", "tiny")


def first_required_parameter(schema: dict) -> str:
    """The parameter a `tiny` call's bare argument fills: the first required one."""
    required = schema.get("required") or list(schema.get("properties", {}))
    if not required:
        raise ValueError("format=tiny needs tools with at least one parameter")
    return required[0]


def render(tokenizer, messages: Sequence[dict], tools: Sequence[dict] | None) -> str:
    """The chat template's text of `messages`, ready for the policy's next turn."""
    kwargs: dict[str, Any] = {"tools": list(tools)} if tools else {}
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                         tokenize=False, **kwargs)


class ChatTemplateError(ValueError):
    """The chat template does not reproduce the conversation so far: the new messages cannot
    be appended as tokens after the policy's turn."""


@dataclass
class Transcript:
    """One conversation's messages and its rendered text, kept in step with its token stream:
    the stream is the rendering with the policy's end-of-turn tokens left where it wrote them
    (a template may render them, like `<|im_end|>`, or not, like the tiny models' EOS)."""
    tokenizer: Any
    tools: list[dict] | None
    messages: list[dict]
    text: str = ""
    _pending: tuple[str, str] | None = field(default=None, repr=False)

    def prompt_ids(self) -> list[int]:
        self.text = render(self.tokenizer, self.messages, self.tools)
        return self.tokenizer(self.text, add_special_tokens=False)["input_ids"]

    def policy_turn(self, content: str, end_token_text: str) -> None:
        """The policy wrote `content`, then the end-of-turn token whose text is
        `end_token_text` ("" when the turn ended otherwise)."""
        self.messages.append({"role": "assistant", "content": content})
        self._pending = (content, end_token_text)

    def observation_ids(self, new_messages: Sequence[dict]) -> list[int]:
        """Append messages (tool results, an environment's answer) after the policy's turn and
        return the tokens that follow the policy's in the stream: the rendered text from the
        end of its turn to the start of its next one."""
        content, end_text = self._pending
        self.messages.extend(new_messages)
        full = render(self.tokenizer, self.messages, self.tools)
        expected = self.text + content
        if not full.startswith(expected):
            at = next((i for i, (a, b) in enumerate(zip(full, expected, strict=False)) if a != b),
                      min(len(full), len(expected)))
            raise ChatTemplateError(
                "the chat template renders the conversation so far differently after new "
                f"messages (from character {at}: {expected[at:at + 40]!r} became "
                f"{full[at:at + 40]!r}), so they cannot be appended after the policy's tokens; "
                "use a template that renders earlier messages unchanged")
        rest = full[len(expected):]
        if end_text and rest.startswith(end_text):   # already in the stream: the policy wrote it
            rest = rest[len(end_text):]
        self.text = full
        return self.tokenizer(rest, add_special_tokens=False)["input_ids"]
