"""Multi-turn rollouts: the policy chats with tools and environments, on any RolloutEngine.

Each episode (one sample) starts from its row's messages (or an environment's `reset`), rendered
with the chat template and the tools' schemas. Every turn, the engine generates for all live
episodes at once (left-padded contexts: prompt + response so far); then, concurrently over the
batch (asyncio), each turn's tool calls are parsed (chat.py) and run, or the environment takes
the turn; their answers are appended to the chat and, as tokens, to the response; the next turn
follows. A turn ends at a stop token or after `max_tokens_per_turn` tokens. An episode ends
when a turn calls no tool and no environment goes on, when the environment says done, after
`max_turns` turns, or when the response budget (`rollout.max_new_tokens`, tool tokens
included) is spent.

The response [B, R] interleaves the policy's tokens and the observation tokens:

    response_mask      1 on the policy's tokens only (the loss mask: gaps at observations)
    attention_mask     1 on every token (what teacher-forced passes read)
    logprobs           the rollout's log-probs at the policy's tokens, 0 elsewhere
    turn_scores        an environment's reward at the last token of the turn it rewards
    token_versions     (an engine that reports them: the async rollout side) the policy
                       version that drew each policy token, -1 elsewhere

An image-text model's episode keeps its row's images (the first turn's `<image>`s) and hands
them to the engine with every turn's context, which holds their image tokens.

Turn k of sample b samples with the seed mix(sample_seed[b], k): draws stay the sample's own
whatever its batch, and differ from turn to turn.

Answers are awaited on an event loop in a thread of its own (`_answer_loop`), so the calling
thread is free while a turn's tool calls are in flight. The async rollout side uses that time
(`look_ahead`): while this batch's slowest calls are out, it starts the next step's batch, whose
first turn it generates and whose first calls it sends, as soon as its weights are fresh enough
for that step (runtime/streams.py); the next `generate` with the same sample seeds goes on from
there. A long-tailed tool then delays one batch, not the rollout rank's whole pipeline.

An engine sharded over several ranks (rollout tensor parallelism: `EngineReplica`) must get
the same requests from each: the replica's first rank runs the tools and environments, and
broadcasts each turn's answers (and what they counted) to the others, which run none.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

import torch

from dagrl.config.multi_turn import MultiTurnConfig
from dagrl.data.vision import ImageEncoder, ImageInputs, image_blocks
from dagrl.envs.base import Environment
from dagrl.envs.base import step as env_step
from dagrl.rollout.base import RolloutEngine
from dagrl.rollout.chat import (
    HermesFormat,
    TinyFormat,
    ToolCall,
    Transcript,
    first_required_parameter,
)
from dagrl.rollout.sampling import SamplingParams, mix_seed
from dagrl.tools.base import Tool, ToolError, check_arguments, openai_schema


@dataclass
class MultiTurnOutput:
    prompt_ids: torch.Tensor       # [B, P] the rendered prompts (with the tools), left-padded
    prompt_mask: torch.Tensor      # [B, P]
    responses: torch.Tensor        # [B, R]
    response_mask: torch.Tensor    # [B, R] float32, 1 on the policy's tokens
    attention_mask: torch.Tensor   # [B, R] float32, 1 on every response token
    logprobs: torch.Tensor         # [B, R] float32, 0 off the policy's tokens
    turn_scores: torch.Tensor      # [B, R] float32, environment rewards at their turn's end
    final_texts: list[str]         # each episode's last policy turn (its final answer)
    turns: torch.Tensor            # [B] policy turns
    tool_calls: torch.Tensor       # [B] calls made (parsed or not)
    tool_errors: torch.Tensor      # [B] calls that failed (bad format, bad arguments, a raise)
    format_errors: torch.Tensor    # [B] calls that could not be parsed
    calls_by_tool: Counter = field(default_factory=Counter)
    first_error: str = ""          # one failed call's message, for the log
    token_versions: torch.Tensor | None = None   # [B, R] int64, see the module docstring
    started_ahead: bool = False   # its first turn came during the previous batch's tool wait


@dataclass(frozen=True)
class EngineReplica:
    """The ranks that drive one engine together (rollout tensor parallelism): they must send it
    the same requests, so one answer per turn must be theirs. Its first rank (`leader`, a
    global rank) runs the tools and environments; the others take its answers over `group`."""
    group: object            # torch.distributed.ProcessGroup of the replica's ranks
    leader: int
    leads: bool


# A follower's answers: what the leader broadcasts when they are read.
_FROM_LEADER: Future = Future()


@dataclass
class _Episode:
    transcript: Transcript
    prompt: list[int]
    budget: int
    env: Environment | None
    images: ImageInputs | None = None   # the first turn's (an image-text model's prompt)
    response: list[int] = field(default_factory=list)
    policy: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    rewards: dict[int, float] = field(default_factory=dict)
    turns: int = 0
    calls: int = 0
    errors: int = 0
    format_errors: int = 0
    final_text: str = ""
    done: bool = False

    def left(self) -> int:
        return self.budget - len(self.response)

    def append(self, tokens: Sequence[int], policy: bool,
               logprobs: Sequence[float] | None = None,
               versions: Sequence[int] | None = None) -> None:
        tokens = list(tokens)[:self.left()]
        self.response += tokens
        self.policy += [float(policy)] * len(tokens)
        self.logprobs += list(logprobs[:len(tokens)]) if logprobs is not None else \
            [0.0] * len(tokens)
        self.versions += list(versions[:len(tokens)]) if versions is not None else \
            [-1] * len(tokens)


# How often a batch awaiting its answers asks whether the next one may start.
LOOK_AHEAD_POLL_S = 0.02

# The next step's batch, started ahead: () -> (rows, sample seeds), or None when it may not
# be generated yet.
LookAhead = Callable[[], "tuple[Sequence[dict], torch.Tensor] | None"]


@dataclass
class _Run:
    """One batch of episodes in flight: the turn it reached and the answers it awaits."""
    episodes: list[_Episode]
    seeds: torch.Tensor    # [B] sample seeds
    params: SamplingParams
    device: torch.device
    turn: int = 0
    live: list[int] = field(default_factory=list)   # the episodes that took turn `turn`
    answers: Future | None = None   # their replies; None once every episode has ended
    calls_by_tool: Counter = field(default_factory=Counter)
    first_error: list[str] = field(default_factory=list)
    reports_versions: bool = False   # the engine's outputs carried token_versions
    started_ahead: bool = False


_loop_lock = threading.Lock()
_loop: tuple[int, asyncio.AbstractEventLoop] | None = None


def _answer_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop for tool calls and environment steps, running in a daemon
    thread (a forked child starts its own: the parent's thread does not exist there)."""
    global _loop
    with _loop_lock:
        if _loop is None or _loop[0] != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="dagrl-agent-answers",
                             daemon=True).start()
            _loop = (os.getpid(), loop)
        return _loop[1]


class MultiTurnRollout:
    """The agent loop over one engine (see the module docstring)."""

    def __init__(self, engine: RolloutEngine, tokenizer, cfg: MultiTurnConfig, *,
                 tools: dict[str, Tool], env_factory: Callable[[], Environment] | None,
                 prompt_width: int | None, response_width: int, pad_token_id: int,
                 replica: EngineReplica | None = None,
                 images: ImageEncoder | None = None) -> None:
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg
        self.images = images   # an image-text model's: expands each image's pad
        self.replica = replica
        self.tools, self.env_factory = tools, env_factory
        self.prompt_width, self.response_width = prompt_width, response_width
        self.pad_token_id = pad_token_id
        self.schemas = [openai_schema(t) for t in tools.values()] or None
        if cfg.format == "tiny":
            self.format = TinyFormat({n: first_required_parameter(t.parameters)
                                      for n, t in tools.items()})
        else:
            self.format = HermesFormat()
        # Tokens that end a turn without being part of its text (EOS, <|im_end|>); the tiny
        # format's `=` ends a turn and belongs to it.
        content_stops = {tid for s in self.format.stop_strings
                         for tid in tokenizer(s, add_special_tokens=False)["input_ids"]}
        self.end_tokens = set(engine.stop_token_ids) - content_stops
        self.stop_tokens = set(engine.stop_token_ids)
        self._ahead: _Run | None = None   # the next step's batch, started by `look_ahead`

    @staticmethod
    def format_stop_token_ids(tokenizer, fmt: str) -> list[int]:
        """Tokens the engine must stop at for `fmt` (the tiny format's `=`); each stop string
        must be one token."""
        strings = TinyFormat.stop_strings if fmt == "tiny" else HermesFormat.stop_strings
        ids = []
        for s in strings:
            tokens = tokenizer(s, add_special_tokens=False)["input_ids"]
            if len(tokens) != 1:
                raise ValueError(f"rollout.multi_turn.format={fmt}: {s!r} must be one token of "
                                 f"the tokenizer, it is {tokens}")
            ids += tokens
        return ids

    # ---- the loop ---------------------------------------------------------------------------

    def generate(self, rows: Sequence[dict], sample_seed: torch.Tensor, params: SamplingParams,
                 device: torch.device, look_ahead: LookAhead | None = None) -> MultiTurnOutput:
        """One episode per row; `rows[i]` holds prompt (messages), data_source, ground_truth,
        extra_info; sample_seed: [B]. `look_ahead`: while this batch awaits answers, the next
        step's (rows, seeds) to start, or None if they may not be generated yet (see the
        module docstring)."""
        run = self._started_ahead(sample_seed, params, dropping_others=look_ahead is not None)
        if run is None:
            run = self._begin(rows, sample_seed, params, device)
        while run.answers is not None:
            # Until the next batch is started, ask again while the answers are awaited: its
            # weights may arrive during this wait.
            while look_ahead is not None and self._ahead is None and \
                    not wait([run.answers], timeout=LOOK_AHEAD_POLL_S).done:
                self._start_ahead(look_ahead, params, device)
            self._read_answers(run)
            self._next_turn(run)
        return self._output(run)

    def _begin(self, rows: Sequence[dict], sample_seed: torch.Tensor, params: SamplingParams,
               device: torch.device) -> _Run:
        run = _Run([self._start(row, i) for i, row in enumerate(rows)], sample_seed, params,
                   device)
        self._next_turn(run)
        return run

    def _next_turn(self, run: _Run) -> None:
        """Turn `run.turn` of every live episode: the policy's, then its answers set going."""
        run.answers = None
        run.live = [i for i, e in enumerate(run.episodes) if not e.done and e.left() > 0]
        if run.turn >= self.cfg.max_turns or not run.live:
            return
        self._policy_turn(run)
        if self.replica is not None and not self.replica.leads:
            run.answers = _FROM_LEADER
            return
        last_turn = run.turn == self.cfg.max_turns - 1
        answering = self._answer([run.episodes[i] for i in run.live], last_turn,
                                 run.calls_by_tool, run.first_error)
        run.answers = asyncio.run_coroutine_threadsafe(answering, _answer_loop())

    def _read_answers(self, run: _Run) -> None:
        """Wait for the answers to turn `run.turn` and append them to their episodes."""
        answers = run.answers.result() if self.replica is None else self._agree(run)
        for i, messages in zip(run.live, answers, strict=True):
            e = run.episodes[i]
            if e.done or messages is None:
                e.done = True
                continue
            e.append(e.transcript.observation_ids(messages), policy=False)
            e.done = e.left() <= 0
        run.turn += 1

    def _agree(self, run: _Run) -> list[list[dict] | None]:
        """The replica leader's answers to turn `run.turn` and what they counted, on every rank
        of the replica (one object broadcast)."""
        import torch.distributed as dist

        live = [run.episodes[i] for i in run.live]
        box: list = [None]
        if self.replica.leads:
            box = [(run.answers.result(),
                    [(e.calls, e.errors, e.format_errors, dict(e.rewards)) for e in live],
                    dict(run.calls_by_tool), list(run.first_error))]
        dist.broadcast_object_list(box, src=self.replica.leader, group=self.replica.group)
        answers, counts, by_tool, first_error = box[0]
        if not self.replica.leads:
            for e, (calls, errors, format_errors, rewards) in zip(live, counts, strict=True):
                e.calls, e.errors, e.format_errors, e.rewards = (calls, errors, format_errors,
                                                                 rewards)
            run.calls_by_tool = Counter(by_tool)
            run.first_error[:] = first_error
        return answers

    def _start_ahead(self, look_ahead: LookAhead, params: SamplingParams,
                     device: torch.device) -> None:
        work = look_ahead()
        if work is not None:
            rows, seeds = work
            self._ahead = self._begin(rows, seeds, params, device)
            self._ahead.started_ahead = True

    def _started_ahead(self, sample_seed: torch.Tensor, params: SamplingParams,
                       dropping_others: bool) -> _Run | None:
        """The batch started ahead if it is this one (same sample seeds and sampling). Another
        is dropped by the call that would have started it (`dropping_others`): its step read
        other prompts (DAPO's filter took them as more prompts of the step before)."""
        ahead = self._ahead
        if ahead is None:
            return None
        if params == ahead.params and torch.equal(ahead.seeds.cpu(), sample_seed.cpu()):
            self._ahead = None
            return ahead
        if dropping_others:
            self._ahead = None
            if ahead.answers is not None:
                ahead.answers.cancel()
        return None

    def _start(self, row: dict, index: int) -> _Episode:
        env = self.env_factory() if self.env_factory is not None else None
        messages = env.reset(row) if env is not None else row["prompt"]
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        images = row.get("images")
        if images is not None:
            if self.images is None:
                raise ValueError(f"sample {index} has images but the agent loop has no image "
                                 "encoder (the model reads text only)")
            # The transcript keeps one image pad per image, so every later rendering (and the
            # observations cut from it) is plain text; the prompt's tokens repeat each pad
            # once per image token, as the single-turn prompts do (data/vision.py).
            messages = image_blocks(messages)
        transcript = Transcript(self.tokenizer, self.schemas, [dict(m) for m in messages])
        prompt = transcript.prompt_ids()
        if images is not None:
            try:
                prompt = self.images.expand(prompt, images)
            except ValueError as err:   # an environment's opening messages lost a placeholder
                raise ValueError(f"multi-turn sample {index}: {err} (one <image> per image in "
                                 "the opening messages)") from None
        if self.prompt_width is not None and len(prompt) > self.prompt_width:
            raise ValueError(f"multi-turn prompt of sample {index} has {len(prompt)} tokens with "
                             f"the tools' schemas, more than data.max_prompt_length="
                             f"{self.prompt_width}; raise it")
        return _Episode(transcript, prompt, self.response_width, env, images)

    def _policy_turn(self, run: _Run) -> None:
        """Generate the next turn of every live episode, one batch through the engine."""
        episodes, live, device = run.episodes, run.live, run.device
        contexts = [episodes[i].prompt + episodes[i].response for i in live]
        width = max(len(c) for c in contexts)
        ids = torch.full((len(live), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(live), width, dtype=torch.long)
        for row, context in enumerate(contexts):   # left padding, as every engine expects
            ids[row, width - len(context):] = torch.tensor(context)
            mask[row, width - len(context):] = 1
        limit = max(episodes[i].left() for i in live)
        if self.cfg.max_tokens_per_turn:
            limit = min(limit, self.cfg.max_tokens_per_turn)
        seeds = mix_seed(run.seeds[live].cpu(), run.turn)
        # Every turn reads its episode's first-turn images again: each context is a new prompt.
        images = ImageInputs.concat([episodes[i].images for i in live])
        out = self.engine.generate(ids.to(device), mask.to(device), seeds.to(device), run.params,
                                   max_new_tokens=limit,
                                   **({"images": images.to(device)} if images is not None else {}))
        lengths = out.response_mask.sum(-1).long().tolist()
        for row, i in enumerate(live):
            e = episodes[i]
            left = e.left()
            tokens = out.responses[row, :lengths[row]].tolist()[:left]
            versions = (out.token_versions[row, :len(tokens)].tolist()
                        if out.token_versions is not None else None)
            e.append(tokens, policy=True, logprobs=out.logprobs[row, :len(tokens)].tolist(),
                     versions=versions)
            run.reports_versions = out.token_versions is not None
            e.turns += 1
            stopped = bool(tokens) and tokens[-1] in self.stop_tokens
            ends = stopped and tokens[-1] in self.end_tokens
            text_ids = tokens[:-1] if ends else tokens
            content = self.tokenizer.decode(text_ids, skip_special_tokens=False)
            end_text = self.tokenizer.decode(tokens[-1:], skip_special_tokens=False) if ends else ""
            e.transcript.policy_turn(content, end_text)
            e.final_text = self.tokenizer.decode(text_ids, skip_special_tokens=True)
            # Cut by the response budget: the episode ends mid-turn. (A turn cut by
            # max_tokens_per_turn is a turn like any other.)
            e.done = not stopped and len(tokens) >= left

    async def _answer(self, live: list[_Episode], last_turn: bool, calls_by_tool: Counter,
                      first_error: list[str]) -> list[list[dict] | None]:
        """The messages that answer each live episode's turn (None: the episode ends), its tool
        calls run and environments stepped concurrently over the batch."""
        limit = asyncio.Semaphore(self.cfg.max_concurrent_calls)

        async def one(e: _Episode) -> list[dict] | None:
            content = e.transcript.messages[-1]["content"]
            calls = self.format.parse(content, list(self.tools)) if self.tools else []
            if calls and (e.done or last_turn):   # no turn left to read the results
                return None
            if calls:
                e.calls += len(calls)
                results = await asyncio.gather(*(self._call(c, e, limit, calls_by_tool,
                                                             first_error) for c in calls))
                return [{"role": "tool", "content": r} for r in results]
            if e.env is None or e.done:
                return None
            observation, reward, done = await env_step(e.env, content)
            e.rewards[len(e.response) - 1] = e.rewards.get(len(e.response) - 1, 0.0) + reward
            return None if done or last_turn else [{"role": "user", "content": observation}]

        return list(await asyncio.gather(*(one(e) for e in live)))

    async def _call(self, call: ToolCall, e: _Episode, limit: asyncio.Semaphore,
                    calls_by_tool: Counter, first_error: list[str]) -> str:
        """Run one call; every failure becomes an `error: ...` result, counted."""
        calls_by_tool[call.name] += 1
        try:
            if call.error:
                e.format_errors += 1
                raise ToolError(call.error)
            tool = self.tools[call.name]
            check_arguments(tool, call.arguments)
            async with limit:
                result = await tool.call(call.arguments)
        except Exception as err:   # the policy reads what went wrong; the run goes on
            e.errors += 1
            message = str(err) if isinstance(err, ToolError) else \
                f"{call.name}: {type(err).__name__}: {err}"
            if not first_error:
                first_error.append(message)
            result = f"error: {message}"
        limit_chars = self.cfg.max_tool_output_chars
        return result if len(result) <= limit_chars else result[:limit_chars] + " [cut]"

    def _output(self, run: _Run) -> MultiTurnOutput:
        episodes, device = run.episodes, run.device
        # None: as wide as the longest prompt (another policy's answers, not the dataset's)
        p = self.prompt_width or max(len(e.prompt) for e in episodes)
        b, r = len(episodes), self.response_width
        prompt_ids = torch.full((b, p), self.pad_token_id, dtype=torch.long)
        prompt_mask = torch.zeros(b, p, dtype=torch.long)
        responses = torch.full((b, r), self.pad_token_id, dtype=torch.long)
        policy, attention, logprobs, scores = (torch.zeros(b, r) for _ in range(4))
        versions = torch.full((b, r), -1, dtype=torch.long)
        for i, e in enumerate(episodes):
            n = len(e.response)
            prompt_ids[i, p - len(e.prompt):] = torch.tensor(e.prompt, dtype=torch.long)
            prompt_mask[i, p - len(e.prompt):] = 1
            responses[i, :n] = torch.tensor(e.response, dtype=torch.long)
            policy[i, :n] = torch.tensor(e.policy)
            attention[i, :n] = 1.0
            logprobs[i, :n] = torch.tensor(e.logprobs)
            versions[i, :n] = torch.tensor(e.versions, dtype=torch.long)
            for position, reward in e.rewards.items():
                scores[i, position] += reward

        def per_sample(name: str) -> torch.Tensor:
            return torch.tensor([float(getattr(e, name)) for e in episodes])

        return MultiTurnOutput(
            prompt_ids.to(device), prompt_mask.to(device), responses.to(device),
            policy.to(device), attention.to(device), logprobs.to(device), scores.to(device),
            [e.final_text for e in episodes], per_sample("turns"), per_sample("calls"),
            per_sample("errors"), per_sample("format_errors"), run.calls_by_tool,
            run.first_error[0] if run.first_error else "",
            versions.to(device) if run.reports_versions else None, run.started_ahead)
