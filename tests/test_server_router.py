"""Routing requests over several rollout servers (rollout/router.py), against two real HTTP
servers on 127.0.0.1 that answer `/v1/completions` as vLLM does (token ids and log-probs) and
record what each received."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from dagrl.rollout.router import Router
from dagrl.rollout.sampling import SamplingParams
from dagrl.rollout.server import ServerRollout, ServerSettings


class _Server:
    """An OpenAI-style completions server: answers 3 tokens derived from the prompt after
    `delay_s`, and keeps every prompt it was sent."""

    def __init__(self, delay_s: float) -> None:
        self.prompts: list[list[int]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):   # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.prompts.append(body["prompt"])
                time.sleep(delay_s)
                ids = [(sum(body["prompt"]) + k) % 40 + 3 for k in range(3)]
                reply = {"choices": [{"token_ids": ids,
                                      "logprobs": {"token_logprobs": [-0.5] * 3}}]}
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()


@pytest.fixture
def servers():
    made = [_Server(0.05), _Server(0.05)]
    yield made
    for s in made:
        s.http.shutdown()


def _left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    return ids, (ids != 0).long()


def test_a_context_goes_where_its_prefix_went_and_new_ones_to_the_least_loaded():
    router = Router(["a", "b"])
    with router.route([1, 2, 3]) as first:
        with router.route([7, 8]) as second:       # the first is in flight: the other server
            assert second != first
            with router.route([1, 2, 3, 4, 5]) as turn:   # extends the first: its server
                assert turn == first
        with router.route([9]) as third:           # b idle, a busy
            assert third == second
    with router.route([1, 2, 3, 4, 5, 6, 7]) as longest:   # longest earlier context: [1..5]
        assert longest == first
    assert router.sticky_hits == 2
    router.forget()
    with router.route([1, 2, 3, 4]) as after:      # forgotten: least recently chosen
        assert after == second


def test_episodes_and_groups_stay_on_one_server(servers):
    engine = ServerRollout(ServerSettings(tuple(s.url for s in servers), "tiny", timeout_s=10,
                                          max_retries=0, max_concurrency=8),
                           eos_token_id=2, pad_token_id=0)
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    group = 4   # a GRPO group: a prompt's samples share it
    ids, mask = _left_padded([p for p in prompts for _ in range(group)])
    out = engine.generate(ids, mask, torch.arange(len(ids)), SamplingParams(temperature=1.0),
                          max_new_tokens=3)
    where = {tuple(p): [i for i, s in enumerate(servers) if p in s.prompts] for p in prompts}
    assert sorted(len(w) for w in where.values()) == [1, 1]   # each group on one server
    assert where[(5, 6, 7)] != where[(9, 10, 11, 12)]          # the two groups spread
    # the next turn: each sample's context, its answer and a tool's output appended
    turn = [p + out.responses[i].tolist() + [30, 31]
            for i, p in enumerate(p for p in prompts for _ in range(group))]
    ids, mask = _left_padded(turn)
    engine.generate(ids, mask, torch.arange(len(ids)), SamplingParams(temperature=1.0),
                    max_new_tokens=3)
    for context in turn:
        server = next(s for s in servers if context in s.prompts)
        assert server is servers[where[tuple(context[:len(context) - 5])][0]]
    assert engine.router.sticky_hits >= len(turn) + 2 * (group - 1)
