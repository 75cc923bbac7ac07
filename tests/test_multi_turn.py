"""The multi-turn loop (dagrl/rollout/multi_turn.py): token streams, masks with gaps, log-probs,
tool calls (concurrent, malformed ones answered and counted), environment rewards at the right
tokens, on a scripted engine (exact layouts) and on the real native and hf backends (log-probs
equal to the teacher-forced pass over the whole chat)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from dagrl.config.multi_turn import MultiTurnConfig
from dagrl.engines.forward import response_logprobs
from dagrl.engines.models import build_char_tokenizer, load_model, write_tiny_model
from dagrl.rollout import model_rollout
from dagrl.rollout.base import GenerationOutput, padded_output, unpadded_prompts
from dagrl.rollout.chat import render
from dagrl.rollout.multi_turn import MultiTurnRollout
from dagrl.rollout.sampling import SamplingParams
from dagrl.tools import load_tools

CPU = torch.device("cpu")


class ScriptedEngine:
    """A RolloutEngine whose policy is a function of the decoded context: `script(text)` gives
    the next turn's text, ending with the EOS token when it ends with `<eos>`. Token t of a turn
    gets the log-prob -(t + 1) / 100, so the test can see where each turn's log-probs land."""

    def __init__(self, tokenizer, script, stop_token_ids):
        self.tokenizer, self.script = tokenizer, script
        self.stop_token_ids = list(stop_token_ids)
        self.weights_version = 0
        self.calls = 0

    def generate(self, prompt_ids, prompt_mask, sample_seed, params, *, max_new_tokens,
                 min_new_tokens=0) -> GenerationOutput:
        self.calls += 1
        tokens = []
        for context in unpadded_prompts(prompt_ids, prompt_mask):
            text = self.script(self.tokenizer.decode(context, skip_special_tokens=False))
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            tokens.append(ids[:max_new_tokens])
        logprobs = [[-(t + 1) / 100 for t in range(len(ids))] for ids in tokens]
        return padded_output(tokens, logprobs, max_new_tokens, self.tokenizer.pad_token_id, CPU)

    def update_weights(self, named_tensors, version):
        # A scripted policy has no weights; the multi-turn loop must never push any.
        raise AssertionError("the multi-turn loop called update_weights on a rollout engine")


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def tiny_loop(tok, script, cfg: MultiTurnConfig, *, tools=None, env=None, width=48):
    stops = [tok.eos_token_id, *MultiTurnRollout.format_stop_token_ids(tok, cfg.format)]
    engine = ScriptedEngine(tok, script, stops)
    tools = load_tools(cfg.tools, cfg) if tools is None else tools
    return MultiTurnRollout(engine, tok, cfg, tools=tools, env_factory=env, prompt_width=16,
                            response_width=width, pad_token_id=tok.pad_token_id)


def calculator_policy(context: str) -> str:
    """Calls the calculator on the prompt, then repeats its result."""
    if context.endswith(" "):                       # a tool's answer ends with a space
        return context.rstrip().rsplit(" ", 1)[-1].rsplit("=", 1)[-1] + "<eos>"
    return context.removeprefix("<bos>") + "="


def rows(*prompts):
    return [{"prompt": [{"role": "user", "content": p}]} for p in prompts]


def test_the_tiny_model_tokenizer_loaded_from_its_directory_keeps_spaces(tokenizer, tok):
    # A tool's answer ends with a space (the tiny template's separator); transformers 5's
    # AutoTokenizer would load the tiny qwen2 directory with Qwen2's pre-tokenizer and drop it.
    text = "37*48+19=1795 guess a number from 1 to 100: "
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == tok(text, add_special_tokens=False)["input_ids"] and len(ids) == len(text)
    assert tokenizer.decode(ids) == text


def test_a_tool_call_interleaves_policy_and_tool_tokens(tok):
    cfg = MultiTurnConfig(enable=True, tools=["calculator"], format="tiny", max_turns=3)
    loop = tiny_loop(tok, calculator_policy, cfg)
    out = loop.generate(rows("12*34+5"), torch.tensor([7]), SamplingParams(1.0), CPU)
    # "12*34+5=" (policy) "413 " (the calculator's answer) "413<eos>" (policy)
    n = int(out.attention_mask[0].sum())
    assert tok.decode(out.responses[0, :n], skip_special_tokens=False) == "12*34+5=413 413<eos>"
    assert out.response_mask[0, :n].tolist() == [1.0] * 8 + [0.0] * 4 + [1.0] * 4
    assert out.attention_mask[0].tolist() == [1.0] * 16 + [0.0] * 32
    expected = [-(t + 1) / 100 for t in range(8)] + [0.0] * 4 + [-(t + 1) / 100 for t in range(4)]
    assert torch.allclose(out.logprobs[0, :n], torch.tensor(expected))
    assert out.logprobs[0, n:].abs().sum() == 0
    assert out.final_texts == ["413"]
    assert (out.turns.tolist(), out.tool_calls.tolist(), out.tool_errors.tolist()) == \
        ([2.0], [1.0], [0.0])
    assert tok.decode(out.prompt_ids[0][out.prompt_mask[0].bool()],
                      skip_special_tokens=False) == "<bos>12*34+5"
    assert out.turn_scores.abs().sum() == 0


def test_a_malformed_call_is_answered_with_an_error_and_counted(tok):
    cfg = MultiTurnConfig(enable=True, tools=["calculator"], format="tiny", max_turns=3)

    def policy(context):
        return "1+=" if context.endswith("x") else "no<eos>"

    loop = tiny_loop(tok, policy, cfg, width=96)
    out = loop.generate(rows("x"), torch.tensor([1]), SamplingParams(1.0), CPU)
    n = int(out.attention_mask[0].sum())
    text = tok.decode(out.responses[0, :n], skip_special_tokens=False)
    observation = text[len("1+="):-len("no<eos>")]
    assert observation.startswith("error: calculator: ") and observation.endswith(" ")
    assert out.response_mask[0, 3:3 + len(tok(observation)["input_ids"])].sum() == 0
    assert (out.tool_calls.tolist(), out.tool_errors.tolist()) == ([1.0], [1.0])
    assert "is not an arithmetic expression" in out.first_error
    assert out.final_texts == ["no"]


def test_episodes_end_at_max_turns_and_at_the_budget(tok):
    always_call = MultiTurnConfig(enable=True, tools=["calculator"], format="tiny", max_turns=2)
    loop = tiny_loop(tok, lambda context: "1+1=", always_call)
    out = loop.generate(rows("a"), torch.tensor([1]), SamplingParams(1.0), CPU)
    # two turns; the second turn's call is not run (no turn left to read its answer)
    assert tok.decode(out.responses[0, :int(out.attention_mask[0].sum())]) == "1+1=2 1+1="
    assert (out.turns.tolist(), out.tool_calls.tolist()) == ([2.0], [1.0])
    long_turns = MultiTurnConfig(enable=True, tools=["calculator"], format="tiny", max_turns=5)
    loop = tiny_loop(tok, lambda context: "1234567+1=", long_turns, width=14)
    out = loop.generate(rows("a"), torch.tensor([1]), SamplingParams(1.0), CPU)
    # "1234567+1=" then "1234568 " fills 18 > 14: cut at the budget, no third turn
    assert out.attention_mask[0].sum() == 14 and out.turns.tolist() == [1.0]


def test_tool_calls_run_concurrently_up_to_the_limit(tok):
    class Probe:
        name, description = "probe", "waits"
        parameters = {"type": "object", "properties": {"x": {"type": "string"}},
                      "required": ["x"]}
        in_flight = peak = 0

        async def call(self, arguments):
            Probe.in_flight += 1
            Probe.peak = max(Probe.peak, Probe.in_flight)
            await asyncio.sleep(0.05)
            Probe.in_flight -= 1
            return arguments["x"]

    cfg = MultiTurnConfig(enable=True, tools=["probe"], format="tiny", max_turns=2,
                          max_concurrent_calls=3)
    loop = tiny_loop(tok, lambda context: "a=" if context.endswith("q") else "b<eos>", cfg,
                     tools={"probe": Probe()})
    out = loop.generate(rows(*["q"] * 8), torch.arange(8), SamplingParams(1.0), CPU)
    assert Probe.peak == 3 and out.tool_calls.sum() == 8
    assert loop.engine.calls == 2   # one batched generate per turn, not one per episode


class SlowCalculator:
    """The calculator answering after `delay_s` (a remote tool's latency); counts its calls."""
    name, description = "calculator", "computes"
    parameters = {"type": "object", "properties": {"expression": {"type": "string"}},
                  "required": ["expression"]}

    def __init__(self, delay_s: float):
        self.delay_s, self.calls = delay_s, []

    async def call(self, arguments):
        self.calls.append(arguments["expression"])
        await asyncio.sleep(self.delay_s)
        return str(eval(arguments["expression"], {}))   # digits and + * only (the test's)


def test_the_next_batch_starts_while_this_one_waits_on_its_tools(tok):
    cfg = MultiTurnConfig(enable=True, tools=["calculator"], format="tiny", max_turns=3)
    first, second = rows("1*2+3", "4*5+6"), rows("7*8+9", "2*3+4")
    seeds1, seeds2 = torch.tensor([11, 12]), torch.tensor([21, 22])
    tool = SlowCalculator(delay_s=0.3)
    loop = tiny_loop(tok, calculator_policy, cfg, tools={"calculator": tool})
    asked = []

    def look_ahead():   # weights too stale on the first ask, fresh enough on the second
        asked.append(len(tool.calls))
        return None if len(asked) == 1 else (second, seeds2)

    out1 = loop.generate(first, seeds1, SamplingParams(1.0), CPU, look_ahead=look_ahead)
    # The second batch's first turn was generated, and its calls sent, during the first
    # batch's wait: 2 generates of the first batch + 1 of the second, 4 calls made.
    assert len(asked) == 2 and loop.engine.calls == 3 and len(tool.calls) == 4
    assert not out1.started_ahead
    out2 = loop.generate(second, seeds2, SamplingParams(1.0), CPU, look_ahead=lambda: None)
    assert out2.started_ahead and loop.engine.calls == 4 and len(tool.calls) == 4
    # Started ahead or not, a batch's episodes are the same.
    fresh = tiny_loop(tok, calculator_policy, cfg, tools={"calculator": SlowCalculator(0.0)})
    for out, batch, seeds in ((out1, first, seeds1), (out2, second, seeds2)):
        alone = fresh.generate(batch, seeds, SamplingParams(1.0), CPU)
        for name in ("responses", "response_mask", "attention_mask", "logprobs", "turns",
                     "tool_calls"):
            assert torch.equal(getattr(out, name), getattr(alone, name)), name
    assert tok.decode(out2.responses[0, :int(out2.attention_mask[0].sum())],
                      skip_special_tokens=False) == "7*8+9=65 65<eos>"


def test_a_batch_started_ahead_for_prompts_that_never_came_is_dropped(tok):
    # DAPO's filter took the next step's prompts as more prompts of this step: the step after
    # reads other prompts (other seeds), and the batch started for it is of no use.
    cfg = MultiTurnConfig(enable=True, tools=["calculator"], format="tiny", max_turns=3)
    tool = SlowCalculator(delay_s=0.2)
    loop = tiny_loop(tok, calculator_policy, cfg, tools={"calculator": tool})
    loop.generate(rows("1+1"), torch.tensor([1]), SamplingParams(1.0), CPU,
                  look_ahead=lambda: (rows("2+2"), torch.tensor([2])))
    # A call without look_ahead (greedy baseline, validation) leaves it for its step.
    loop.generate(rows("5+5"), torch.tensor([0]), SamplingParams(0.0), CPU)
    assert loop._ahead is not None
    out = loop.generate(rows("3+3"), torch.tensor([3]), SamplingParams(1.0), CPU,
                        look_ahead=lambda: None)
    assert not out.started_ahead and loop._ahead is None
    assert tok.decode(out.responses[0, :int(out.attention_mask[0].sum())],
                      skip_special_tokens=False) == "3+3=6 6<eos>"


def test_environment_rewards_land_on_the_last_token_of_their_turn(tok):
    class Counter:
        def reset(self, row):
            self.turn = 0
            return [{"role": "user", "content": "go: "}]

        def step(self, text):
            self.turn += 1
            return f"o{self.turn} ", [0.25, 0.5, 1.0][self.turn - 1], self.turn == 3

    cfg = MultiTurnConfig(enable=True, environment="x", max_turns=5)
    replies = {"<bos>go: ": "a<eos>", "o1 ": "bb<eos>", "o2 ": "ccc<eos>"}
    loop = tiny_loop(tok, lambda context: next(v for k, v in replies.items()
                                                if context.endswith(k)), cfg, env=Counter)
    out = loop.generate([{"prompt": None}] * 2, torch.tensor([3, 4]), SamplingParams(1.0), CPU)
    n = int(out.attention_mask[0].sum())
    assert tok.decode(out.responses[0, :n], skip_special_tokens=False) == \
        "a<eos>o1 bb<eos>o2 ccc<eos>"
    #                     a  <eos> o  1  ' ' b  b  <eos> o  2  ' ' c  c  c  <eos>
    assert out.response_mask[0, :n].tolist() == [1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1]
    expected = torch.zeros(n)
    expected[1], expected[7], expected[14] = 0.25, 0.5, 1.0
    assert torch.equal(out.turn_scores[0, :n], expected)
    assert out.turn_scores[0].sum() == pytest.approx(1.75) and out.turns.tolist() == [3.0, 3.0]


# A Qwen2.5-style template (ChatML with the Hermes tool format) on a byte-level tokenizer.
HERMES_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nYou may call tools.\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '\\n<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>' }}"
    "{%- endif %}"
    "{%- else %}"
    "{{- '\\n<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '\\n<|im_start|>assistant\\n' }}{%- endif %}")


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    core = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", clean_up_tokenization_spaces=False,
                                  additional_special_tokens=["<|im_start|>"])
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.chat_template = HERMES_TEMPLATE
    return tok


def test_hermes_calls_on_a_chatml_template_keep_the_stream_equal_to_the_rendering():
    tok = byte_tokenizer()
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'

    def policy(context):
        return "The answer is 42.<|im_end|>" if "</tool_response>" in context else \
            f"Let me compute.\n{call}<|im_end|>"

    cfg = MultiTurnConfig(enable=True, tools=["calculator"], max_turns=3)
    engine = ScriptedEngine(tok, policy, [tok.eos_token_id])
    loop = MultiTurnRollout(engine, tok, cfg, tools=load_tools(cfg.tools, cfg), env_factory=None,
                            prompt_width=1000, response_width=300, pad_token_id=tok.pad_token_id)
    out = loop.generate(rows("What is 6*7?"), torch.tensor([0]), SamplingParams(1.0), CPU)
    n = int(out.attention_mask[0].sum())
    prompt = tok.decode(out.prompt_ids[0][out.prompt_mask[0].bool()], skip_special_tokens=False)
    response = tok.decode(out.responses[0, :n], skip_special_tokens=False)
    observation = ("\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
                   "<|im_start|>assistant\n")
    assert response == f"Let me compute.\n{call}<|im_end|>{observation}The answer is 42.<|im_end|>"
    assert '"name": "calculator"' in prompt   # the tools' schemas reach the template
    first = len(tok(f"Let me compute.\n{call}<|im_end|>", add_special_tokens=False)["input_ids"])
    gap = len(tok(observation, add_special_tokens=False)["input_ids"])
    assert out.response_mask[0, :n].tolist() == [1.0] * first + [0.0] * gap + \
        [1.0] * (n - first - gap)
    assert out.final_texts == ["The answer is 42."] and out.tool_errors.tolist() == [0.0]
    # The token stream is what the template renders for the whole chat.
    messages = [{"role": "user", "content": "What is 6*7?"},
                {"role": "assistant", "content": f"Let me compute.\n{call}"},
                {"role": "tool", "content": "42"},
                {"role": "assistant", "content": "The answer is 42."}]
    whole = tok.apply_chat_template(messages, tools=loop.schemas, tokenize=False)
    assert whole == prompt + response
    assert render(tok, messages[:1], loop.schemas) == prompt


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("mt") / "tiny", "tiny-qwen2", seed=1))


def test_real_backends_record_the_log_probs_training_recomputes_over_the_whole_chat(model_dir,
                                                                                   tok):
    class Ok:   # answers every turn, never done: every episode runs all its turns
        def reset(self, row):
            return [{"role": "user", "content": row["prompt"]}]

        def step(self, text):
            return "ok ", 0.0, False

    cfg = MultiTurnConfig(enable=True, environment="ok", max_turns=3, max_tokens_per_turn=5)
    prompts = [{"prompt": p} for p in ("12+3=", "7*8=", "99-1=", "5=")]
    model = load_model(model_dir)
    responses = {}
    for backend in ("native", "hf"):
        engine = model_rollout(backend, load_model(model_dir), eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id)
        loop = MultiTurnRollout(engine, tok, cfg, tools={}, env_factory=Ok, prompt_width=8,
                                response_width=24, pad_token_id=tok.pad_token_id)
        out = loop.generate(prompts, torch.arange(4) * 1000 + 5, SamplingParams(1.0), CPU)
        gaps = (out.attention_mask - out.response_mask).sum(-1)
        assert (gaps == 6).all() and (out.turns == 3).all()   # "ok " after turns 1 and 2
        assert (out.response_mask <= out.attention_mask).all()
        with torch.no_grad():
            recomputed = response_logprobs(model, out.prompt_ids, out.prompt_mask, out.responses,
                                           out.response_mask,
                                           attention_mask=out.attention_mask).logprobs
        torch.testing.assert_close(recomputed, out.logprobs, atol=1e-4, rtol=1e-4)
        assert (out.logprobs[out.response_mask.bool()] < 0).all()
        responses[backend] = out.responses
    # native and hf draw the same tokens, turn by turn
    assert torch.equal(responses["native"], responses["hf"])


class RankCalculator(SlowCalculator):
    """The calculator, off by this rank's number (tools that answer differently on different
    ranks: a clock, a timeout, a sandbox's state)."""

    def __init__(self, rank: int):
        super().__init__(0.0)
        self.rank = rank

    async def call(self, arguments):
        return str(int(await super().call(arguments)) + self.rank)


def _replica_episodes(rank: int, world: int) -> tuple[str, int, list[float]]:
    import torch.distributed as dist

    from dagrl.rollout.multi_turn import EngineReplica

    tok = build_char_tokenizer()
    cfg = MultiTurnConfig(enable=True, tools=["calculator"], format="tiny", max_turns=3)
    tool = RankCalculator(rank)
    loop = tiny_loop(tok, calculator_policy, cfg, tools={"calculator": tool})
    loop.replica = EngineReplica(dist.group.WORLD, leader=0, leads=rank == 0)
    out = loop.generate(rows("12*34+5", "1+2"), torch.tensor([7, 8]), SamplingParams(1.0), CPU)
    n = int(out.attention_mask[0].sum())
    return (tok.decode(out.responses[0, :n], skip_special_tokens=False), len(tool.calls),
            out.tool_calls.tolist())


def test_the_ranks_of_a_sharded_engine_take_the_first_ranks_tool_answers():
    """Rollout tensor parallelism: both ranks must send the engine the same requests, so the
    replica's first rank runs the tools and the other takes its answers (and runs none)."""
    from tests.dist_helpers import run_distributed

    (text0, calls0, counted0), (text1, calls1, counted1) = run_distributed(
        _replica_episodes, 2)
    assert text0 == text1 == "12*34+5=413 413<eos>"   # rank 1's own tool would say 414
    assert (calls0, calls1) == (2, 0)
    assert counted0 == counted1 == [1.0, 1.0]
