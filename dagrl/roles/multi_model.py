"""Several policies in one graph: how a node of an extra model sees the batch, and the roles
that pass data between models.

All policies share one batch, one row per sample of the main policy. The fields of an extra
model `m` carry the prefix `m/` (`refiner/responses`, `refiner/scores`, ...). A node with
`model: m` runs its role on a *view*: the run-wide fields (uid, row_index, data_source, ...)
plus m's fields with the prefix taken off, so every built-in role (rollout, reward,
advantage, actor_update, ...) works unchanged for any model; what it writes goes back under
the prefix. Metrics of m's nodes are prefixed the same way (`refiner/actor/pg_loss`).

A policy with rollout.multi_turn runs its own episodes (its agent loop over its own rollout
engine, with the tools of its config): its re-rendered prompt_ids / prompt_mask, its
response_attention_mask and turn_scores are its own fields like any other, so its reward,
advantage and update read its own gapped masks. Its metrics (`checker/tools/calls_mean`)
count its own tool calls.

Roles that move data between models run as nodes of the main policy, which see every field:

    handoff      m's prompts from the main policy's responses (options: to, template)
    mix_rewards  the main policy's reward mixed with m's (options: from, weight)
"""

from __future__ import annotations

import torch

from dagrl.dag.spec import GraphError
from dagrl.data.batch import Batch
from dagrl.data.dataset import encode_prompt
from dagrl.engines.judge import question_text
from dagrl.roles.registry import NodeContext, register_role
from dagrl.roles.score import episode_texts, last_token_index

# Fields every model reads: what identifies a sample and what its reward is checked against.
SHARED_FIELDS = ("uid", "row_index", "batch_position", "data_source", "ground_truth",
                 "extra_info")


def prefix_of(model: str) -> str:
    return f"{model}/"


def model_view(batch: Batch, model: str) -> Batch:
    """The batch as a node of `model` sees it: shared fields + model's fields, unprefixed."""
    prefix = prefix_of(model)
    fields = batch.keys()   # a Batch is not iterable: its fields are a list
    view = batch.select_keys([k for k in fields if k in SHARED_FIELDS])
    for key in fields:
        if key.startswith(prefix):
            view[key[len(prefix):]] = batch[key]
    return view


def merge_view(batch: Batch, view: Batch, model: str, node_id: str) -> Batch:
    """Write what a node of `model` returned back into the shared batch, under the prefix; a
    field the node dropped is dropped there too."""
    if len(view) != len(batch):
        raise GraphError(f"node {node_id!r} of model {model!r} returned {len(view)} samples "
                         f"for {len(batch)}: an extra model's nodes must keep the batch's rows "
                         "(one answer per sample of the main policy)")
    prefix = prefix_of(model)
    own = [k for k in view.keys() if k not in SHARED_FIELDS]   # noqa: SIM118 (not a dict)
    kept = {prefix + k for k in own}
    fields = batch.keys()
    batch = batch.drop_keys([k for k in fields if k.startswith(prefix) and k not in kept])
    for key in own:
        batch[prefix + key] = view[key]
    return batch


class PrefixedMetrics:
    """A StepMetrics whose names get the model's prefix (every add_* takes the name first)."""

    def __init__(self, metrics, prefix: str) -> None:
        self._metrics, self._prefix = metrics, prefix

    def __getattr__(self, attr: str):
        method = getattr(self._metrics, attr)
        if not attr.startswith("add_"):
            return method
        return lambda name, *args, **kwargs: method(self._prefix + name, *args, **kwargs)


def _main_policy_node(ctx: NodeContext, role: str) -> None:
    if ctx.node.model:
        raise GraphError(f"node {ctx.node.id!r}: the {role} role moves data between models and "
                         f"runs as a node of the main policy (remove `model: {ctx.node.model}`)")


def _other_model(ctx: NodeContext, key: str) -> str:
    name = ctx.node.options.get(key)
    if name not in ctx.model_engines:
        raise GraphError(f"node {ctx.node.id!r}: options.{key} must name one of the models "
                         f"{sorted(ctx.model_engines) or '(none configured)'}, got {name!r}")
    return name


@register_role("handoff", engines=(), side="follower")   # async: beside its inputs
def handoff(ctx: NodeContext, batch: Batch) -> Batch:
    """Prompts of model `to` made from the main policy's samples: `template` is formatted with
    {prompt} (the question) and {response} (the main policy's decoded answer), then encoded
    with `to`'s tokenizer and chat template (a multi-turn response whole, tool results
    included). Adds to/prompt, to/prompt_ids [N, P'] and to/prompt_mask [N, P'] (left-padded;
    a multi-turn `to` renders its prompt again, with its tools)."""
    _main_policy_node(ctx, "handoff")
    to = _other_model(ctx, "to")
    template = ctx.node.options.get("template", "{prompt}{response}")
    # A multi-turn answer is handed on whole, tool results included: the next agent reads the
    # episode as the reward does (score.episode_texts).
    texts = episode_texts(ctx.engines.tokenizer, batch)
    prompts = [template.format(prompt=question_text(p), response=r)
               for p, r in zip(batch["prompt"], texts, strict=True)]
    tokenizer = ctx.model_engines[to].tokenizer
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    width = agreed_width(ctx, max(len(e) for e in encoded))
    ids = torch.full((len(batch), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, e in enumerate(encoded):
        ids[i, width - len(e):] = torch.tensor(e)
        mask[i, width - len(e):] = 1
    prefix = prefix_of(to)
    batch[prefix + "prompt"] = [[{"role": "user", "content": p}] for p in prompts]
    batch[prefix + "prompt_ids"] = ids.to(batch["prompt_ids"].device)
    batch[prefix + "prompt_mask"] = mask.to(batch["prompt_mask"].device)
    return batch


def agreed_width(ctx: NodeContext, width: int) -> int:
    """The widest of the node's ranks' `width`s: prompts handed on from another policy's
    answers are as wide as the longest one (no dataset limit bounds them), and the ranks'
    batches are concatenated later (reshards, balancing), so every rank pads to one width."""
    widths = torch.zeros(ctx.world_size, dtype=torch.float64)
    widths[ctx.rank] = width
    return int(ctx.reduce_sum(widths).max())


def left_pad(ids: torch.Tensor, mask: torch.Tensor, width: int, pad_token_id: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts [N, P] -> [N, width] (width >= P), still left-padded."""
    extra = width - ids.shape[1]
    if extra <= 0:
        return ids, mask
    return (torch.nn.functional.pad(ids, (extra, 0), value=pad_token_id),
            torch.nn.functional.pad(mask, (extra, 0), value=0))


@register_role("mix_rewards", engines=(), side="follower")
def mix_rewards(ctx: NodeContext, batch: Batch) -> Batch:
    """The main policy's outcome reward mixed with model `from`'s reward on the same sample:

        r_i = (1 - w) * r_i^main + w * r_i^from          w = options.weight (default 0.5)

    so the main policy is also credited for what the other model made of its answer. Rewrites
    scores [N] and token_level_scores [N, R] (the mix sits on the last response token) and
    logs the mix as reward_mixed/*; reward/* keeps the main policy's own reward."""
    _main_policy_node(ctx, "mix_rewards")
    other = _other_model(ctx, "from")
    w = float(ctx.node.options.get("weight", 0.5))
    if not 0.0 <= w <= 1.0:
        raise GraphError(f"node {ctx.node.id!r}: options.weight must be in [0, 1], got {w}")
    mixed = (1 - w) * batch["scores"] + w * batch[prefix_of(other) + "scores"]
    mask = batch["response_mask"]
    token_scores = torch.zeros_like(mask)
    # the policy's last token: with multi-turn gaps not the mask's count
    token_scores[torch.arange(len(batch)), last_token_index(mask)] = mixed
    batch["scores"] = mixed
    batch["token_level_scores"] = token_scores * (mask.sum(-1, keepdim=True) > 0)
    ctx.metrics.add_distribution("reward_mixed", mixed)
    return batch
