"""The `reward_model` and `judge` sections: rewards computed by a model instead of a rule.

`reward.source` picks who scores the rollout node's responses (the built-in graphs put that
role on their `reward` node):

    rule          the rule scorers / reward.custom_fn (dagrl/rewards/manager.py), the default
    reward_model  a Hugging Face sequence-classification model, one scalar per sample
                  (dagrl/engines/reward_model.py), sharded over the reward node's ranks
    judge         a generative model asked to grade each response through a rollout backend;
                  the score is parsed from its answer (dagrl/engines/judge.py)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from dagrl.config.loader import ConfigError, require


@dataclass
class RewardModelConfig:
    # A Hugging Face `*ForSequenceClassification` directory with one label (verl's and
    # OpenRLHF's reward models), or `builtin:tiny-digit-rm`: a tiny classifier trained in code
    # once into $DAGRL_CACHE_DIR (default ~/.cache/dagrl) and copied into the run directory
    # (examples/reward_model.yaml, dagrl/engines/tiny_reward_model.py).
    path: str = ""
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    # Samples per forward pass.
    micro_batch_size: int = 16
    # Tokens of prompt + response given to the reward model; longer inputs keep their last
    # max_length tokens (the response's end, where the model reads its score).
    max_length: int = 1024

    def __post_init__(self) -> None:
        require(self.micro_batch_size >= 1, "micro_batch_size must be >= 1")
        require(self.max_length >= 2, "max_length must be >= 2")


# The default judge prompt: {prompt} is the last user message of the sample's prompt,
# {response} the policy's answer, {ground_truth} the row's reward_model.ground_truth.
DEFAULT_JUDGE_TEMPLATE = (
    "Rate the answer to the question from 0 to 10.\n"
    "Question: {prompt}\nReference answer: {ground_truth}\nAnswer: {response}\n"
    "Reply with the rating only."
)
TEMPLATE_FIELDS = ("prompt", "response", "ground_truth")


@dataclass
class JudgeConfig:
    # A causal LM directory (or GGUF file in it, judge.gguf_file) that grades each response.
    path: str = ""
    gguf_file: str = ""
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    # Where the judge generates: in this process with native (Llama/Qwen2 families), hf (any
    # causal LM) or auto (native when it can); or `server`: OpenAI-compatible servers serving
    # the judge model (`vllm serve judge.path`), at judge.server_urls. judge.path still gives
    # the tokenizer (the prompts are sent as token ids).
    backend: Literal["auto", "native", "hf", "server"] = "auto"
    # backend=server: the servers' base URLs (requests routed over them as the rollout's
    # are) and the served model name (empty: the first one a server lists at /v1/models).
    server_urls: list[str] = field(default_factory=list)
    server_model: str = ""
    template: str = DEFAULT_JUDGE_TEMPLATE
    # A regular expression with one group: the first match in the judge's answer is the score.
    score_pattern: str = r"(-?\d+(?:\.\d+)?)"
    # Scores are divided by this (10: a 0-10 rating becomes a 0-1 reward).
    score_scale: float = 10.0
    max_new_tokens: int = 16
    # Greedy (0) by default: a judge should grade the same answer the same way.
    temperature: float = 0.0
    # The reward of an answer the judge's output does not parse for: counted in the metric
    # judge/unparseable (the first such output is logged), the run goes on.
    unparseable_score: float = 0.0
    micro_batch_size: int = 32

    def __post_init__(self) -> None:
        require(self.max_new_tokens >= 1, "max_new_tokens must be >= 1")
        require(self.temperature >= 0, "temperature must be >= 0")
        require(self.score_scale > 0, "score_scale must be > 0")
        require(self.micro_batch_size >= 1, "micro_batch_size must be >= 1")
        require((self.backend == "server") == bool(self.server_urls),
               "backend=server needs server_urls, and server_urls need backend=server")
        require(all(u.startswith(("http://", "https://")) for u in self.server_urls),
               "server_urls must be http:// or https:// base URLs")
        try:
            groups = re.compile(self.score_pattern).groups
        except re.error as err:
            raise ConfigError(f"score_pattern {self.score_pattern!r} is not a regular "
                              f"expression: {err}") from err
        require(groups == 1, f"score_pattern {self.score_pattern!r} must have exactly one group "
                            f"(the score), it has {groups}")
        try:
            self.template.format(**{k: "" for k in TEMPLATE_FIELDS})
        except (KeyError, IndexError, ValueError) as err:
            raise ConfigError(f"template may use only the fields {{prompt}}, {{response}} and "
                              f"{{ground_truth}} (write {{{{ and }}}} for literal braces): "
                              f"{type(err).__name__}: {err}") from err
