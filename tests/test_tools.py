"""Tools and environments: the calculator, the tool-call formats, argument checks, a user's tools
and environments loaded by `file.py:name`, the built-in guess_number environment, and the `http`
tool against a local service (the agentic bench's calculator service: test_bench_agentic.py)."""

from __future__ import annotations

import asyncio
import json
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dagrl.config.loader import ConfigError
from dagrl.config.multi_turn import HttpToolConfig, MultiTurnConfig
from dagrl.envs import ENVIRONMENTS, load_environment, step
from dagrl.rollout.chat import HermesFormat, TinyFormat
from dagrl.tools import ToolError, load_tools, openai_schema
from dagrl.tools.base import check_arguments
from dagrl.tools.builtin import Calculator, calculate

CFG = MultiTurnConfig(tool_timeout_s=2.0)


@pytest.mark.parametrize("expression, value", [
    ("37*48+19", "1795"), ("7/2", "3.5"), ("6/3", "2"), ("2**10", "1024"), ("-5-3", "-8"),
    (" (1+2)*3 ", "9"), ("7//2", "3"), ("7%3", "1"), ("1/3", "0.333333333333"),
])
def test_calculator_values(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, error", [
    ("1/0", "division by zero"), ("9**9**9", "too large"), ("1+", "not an arithmetic"),
    ("__import__('os').system('id')", "not Call"), ("x+1", "not Name"), ("'a'*3", "not Constant"),
    ("1" * 300, "longer than"), ("(-8)**0.5", "not a real number"),
])
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, error):
    with pytest.raises(ToolError, match=error):
        calculate(expression)


def test_hermes_calls_are_parsed_and_malformed_ones_explained():
    fmt, tools = HermesFormat(), ["calculator", "python"]
    text = ('Let me compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": '
            '"2+2"}}\n</tool_call><tool_call>{"name": "python", "arguments": "{\\"code\\": '
            '\\"print(1)\\"}"}</tool_call>')
    calls = fmt.parse(text, tools)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "2+2"}, ""), ("python", {"code": "print(1)"}, "")]
    assert fmt.parse("The answer is 4.", tools) == []
    bad = {
        "<tool_call>{'name': 'calculator'}</tool_call>": "not valid JSON",
        '<tool_call>["calculator"]</tool_call>': 'with a "name"',
        '<tool_call>{"name": "search", "arguments": {}}</tool_call>': "there is no tool 'search'",
        '<tool_call>{"name": "calculator", "arguments": {"expr': "without its </tool_call>",
    }
    for text, message in bad.items():
        (call,) = fmt.parse(text, tools)
        assert call.arguments is None and message in call.error


def test_tiny_calls_end_with_equals():
    fmt = TinyFormat({"calculator": "expression", "python": "code"})
    tools = ["calculator", "python"]
    assert fmt.parse("37*48+19=", tools)[0].arguments == {"expression": "37*48+19"}
    (call,) = fmt.parse("python:print(1)=", tools)
    assert (call.name, call.arguments) == ("python", {"code": "print(1)"})
    assert fmt.parse("1795", tools) == []
    assert "no argument" in fmt.parse("=", tools)[0].error


def test_arguments_are_checked_against_the_schema():
    calc = Calculator()
    check_arguments(calc, {"expression": "1+1"})
    for arguments, message in (({}, "'expression' is a required property"),
                               ({"expression": 3}, "is not of type 'string'"),
                               ({"expression": "1", "x": 1}, "Additional properties"),
                               ("1+1", "must be a JSON object")):
        with pytest.raises(ToolError, match=message):
            check_arguments(calc, arguments)


USER_TOOLS = '''
import asyncio

def lookup_price(item: str, quantity: int = 1) -> str:
    """The price of some items in the shop.

    Args:
        item: the item's name
        quantity: how many
    """
    return str({"apple": 3}.get(item, 0) * quantity)

async def slow(seconds: float) -> str:
    """Wait a while.

    Args:
        seconds: how long
    """
    await asyncio.sleep(seconds)
    return "done"

def undocumented(x):
    return x

class Waiter:
    """A Tool object of its own (no docstring schema needed)."""
    name, description = "waiter", "Waits."
    parameters = {"type": "object", "properties": {"seconds": {"type": "number"}}}

    async def call(self, arguments):
        await asyncio.sleep(arguments["seconds"])
        return "waited"
'''


def test_a_users_tools_load_from_a_file_with_schemas_from_their_docstrings(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(textwrap.dedent(USER_TOOLS))
    tools = load_tools(["calculator", f"{path}:lookup_price", f"{path}:slow"], CFG)
    assert list(tools) == ["calculator", "lookup_price", "slow"]
    schema = openai_schema(tools["lookup_price"])["function"]
    assert schema["description"] == "The price of some items in the shop."
    assert schema["parameters"]["required"] == ["item"]
    assert schema["parameters"]["properties"]["quantity"]["type"] == "integer"
    assert asyncio.run(tools["lookup_price"].call({"item": "apple", "quantity": 2})) == "6"
    assert asyncio.run(tools["slow"].call({"seconds": 0.01})) == "done"
    with pytest.raises(ToolError, match="no result within 2 s"):
        asyncio.run(tools["slow"].call({"seconds": 60}))
    # A Tool class's calls get the same wall-time limit (rollout.multi_turn.tool_timeout_s).
    waiter = load_tools([f"{path}:Waiter"], CFG)["waiter"]
    assert asyncio.run(waiter.call({"seconds": 0.01})) == "waited"
    with pytest.raises(ToolError, match="waiter: no result within 2 s"):
        asyncio.run(waiter.call({"seconds": 60}))
    with pytest.raises(ValueError, match="docstring"):
        load_tools([f"{path}:undocumented"], CFG)
    with pytest.raises(ValueError, match="two tools are named 'calculator'"):
        load_tools(["calculator", "calculator"], CFG)
    with pytest.raises(ValueError, match="unknown tool 'calculater'.*Did you mean 'calculator'"):
        load_tools(["calculater"], CFG)


def test_guess_number_rewards_each_turn_and_ends_at_the_secret():
    env = ENVIRONMENTS.get("guess_number")()
    messages = env.reset({"ground_truth": "42", "prompt": None, "extra_info": {"low": 1,
                                                                              "high": 100}})
    assert messages == [{"role": "user", "content": "guess a number from 1 to 100: "}]
    assert asyncio.run(step(env, "50")) == ("lower. ", -0.1, False)
    assert asyncio.run(step(env, "i say 12")) == ("higher. ", -0.1, False)
    assert asyncio.run(step(env, "no idea")) == ("say a number. ", -0.1, False)
    assert asyncio.run(step(env, "42")) == ("correct", 1.0, True)


def test_a_users_environment_loads_from_a_file(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text(textwrap.dedent('''
        class Echo:
            def reset(self, row):
                return [{"role": "user", "content": "say hi"}]
            async def step(self, text):
                return text.upper(), 0.5, text == "hi"

        class Broken:
            def reset(self, row):
                return []
    '''))
    env = load_environment(f"{path}:Echo")()
    assert env.reset({}) == [{"role": "user", "content": "say hi"}]
    assert asyncio.run(step(env, "hi")) == ("HI", 0.5, True)
    with pytest.raises(TypeError, match="no step method"):
        load_environment(f"{path}:Broken")
    with pytest.raises(ValueError, match="unknown environment"):
        load_environment("no_such_env")


class _Service(BaseHTTPRequestHandler):
    """Answers by path, as web services do: a JSON result or error, plain text, a failure."""

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        arguments = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        status, kind, body = {
            "/json": (200, "application/json", {"result": arguments["input"].upper()}),
            "/refuse": (200, "application/json", {"error": "no results for that query"}),
            "/text": (200, "text/plain", f"plain {arguments['input']}"),
            "/fail": (500, "application/json", {"error": "the index is rebuilding"}),
        }.get(self.path, (404, "text/plain", "not here"))
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_the_http_tool_posts_its_arguments_and_reports_failures_as_tool_errors():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Service)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"

    def call(path: str, url: str = "") -> str:
        cfg = MultiTurnConfig(tools=["http"], tool_timeout_s=5.0,
                              http=HttpToolConfig(url=url or base + path, name="search"))
        tool = load_tools(["http"], cfg)["search"]
        check_arguments(tool, {"input": "cats"})   # the default schema: one string, `input`
        return asyncio.run(tool.call({"input": "cats"}))

    try:
        assert call("/json") == "CATS"
        assert call("/text") == "plain cats"
        for path, message in {"/refuse": "search: no results for that query",
                              "/fail": "search: HTTP 500: the index is rebuilding",
                              "/nowhere": "search: HTTP 404: not here"}.items():
            with pytest.raises(ToolError, match=message):
                call(path)
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(ToolError, match="search: cannot reach http://127.0.0.1:"):
        call("", url=base + "/json")   # the server is gone
    with pytest.raises(ConfigError, match="http.url"):
        MultiTurnConfig(tools=["http"])
    with pytest.raises(ConfigError, match="url must start with http"):
        HttpToolConfig(url="ftp://example.org")
