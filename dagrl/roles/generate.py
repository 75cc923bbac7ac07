"""Roles that generate: `rollout` (rollout.n samples per prompt) and `greedy_baseline` (ReMax).

Fields `rollout` adds, for a shard of N samples (the prompts repeated rollout.n times, so a
prompt's group stays on one rank) and response width R:
    responses [N, R], response_mask [N, R], rollout_logprobs [N, R], sample_seed [N]
With rollout.multi_turn (agents, dagrl/rollout/multi_turn.py) also:
    response_attention_mask [N, R]   every response token, tool and environment tokens included
                                     (response_mask, the loss mask, has gaps there)
    turn_scores [N, R]               (with an environment) its rewards at their turns' last token
and prompt_ids / prompt_mask are the prompts as rendered with the tools' schemas.
"""

from __future__ import annotations

import zlib

import torch

from dagrl.data.batch import RESPONSE_ATTENTION_MASK, Batch
from dagrl.data.vision import batch_images, row_images
from dagrl.roles.multi_model import agreed_width, left_pad
from dagrl.roles.registry import NodeContext, register_role
from dagrl.roles.score import decode_responses
from dagrl.rollout.sampling import SamplingParams, mix_seed


def index_within_group(uids) -> torch.Tensor:
    """For consecutive rows grouped by uid: each row's position in its group, [N]."""
    out, previous, k = [], None, 0
    for uid in uids:
        k = k + 1 if uid == previous else 0
        out.append(k)
        previous = uid
    return torch.tensor(out, dtype=torch.long)


@register_role("rollout", engines=("rollout", "actor"), side="rollout", fans_out=True,
               adds={"responses": "R int64", "response_mask": "R float32",
                     "rollout_logprobs": "R float32", "sample_seed": "int64"})
def rollout(ctx: NodeContext, batch: Batch) -> Batch:
    cfg = ctx.config.rollout
    batch = samples(ctx, batch, ctx.step)
    params = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)
    if ctx.engines.agent is not None:
        return _multi_turn(ctx, batch, params)
    engine = ctx.engines.rollout
    out = engine.generate(batch["prompt_ids"], batch["prompt_mask"], batch["sample_seed"],
                          params, max_new_tokens=cfg.max_new_tokens,
                          min_new_tokens=cfg.min_new_tokens, **image_argument(batch))
    batch["responses"] = out.responses
    batch["response_mask"] = out.response_mask
    batch["rollout_logprobs"] = out.logprobs
    if out.token_versions is not None:   # the async rollout side: who drew each token
        batch["token_versions"] = out.token_versions
    lengths = out.response_mask.sum(-1)
    ctx.metrics.add_distribution("response/length", lengths)
    stop = torch.tensor(engine.stop_token_ids, device=out.responses.device)
    ended = (torch.isin(out.responses, stop) & out.response_mask.bool()).any(-1).float()
    ctx.metrics.add_mean("response/clip_ratio", float((1 - ended).sum()), len(batch))
    ctx.metrics.add_mean("prompt/length_mean", float(batch["prompt_mask"].sum()), len(batch))
    ctx.metrics.add_sum("tokens/total", float(lengths.sum() + batch["prompt_mask"].sum()))
    return batch


def image_argument(batch: Batch) -> dict:
    """`generate`'s images for a batch of an image-text model's prompts (none for text: the
    backends that take no images never see the argument; rollout/base.py refuses them for an
    image-text model)."""
    images = batch_images(batch)
    return {} if images is None else {"images": images}


def samples(ctx: NodeContext, batch: Batch, step: int) -> Batch:
    """The node's samples of `batch` at `step`, with their seeds (`sample_seed` [N])."""
    if ctx.node.model:
        # Another policy (roles/multi_model.py) answers each of the main policy's samples once;
        # the samples of a group are consecutive rows, so a row's index within its group is
        # the same on any number of workers. The model's name salts its randomness.
        sample_index = index_within_group(batch["uid"]).to(batch["row_index"].device)
        salt = zlib.crc32(ctx.node.model.encode())
    else:
        n, n_prompts = ctx.config.rollout.n, len(batch)
        batch = batch.repeat_interleave(n)
        sample_index = torch.arange(n, device=batch["row_index"].device).repeat(n_prompts)
        salt = 0
    # Randomness keyed by (seed, step, dataset row, sample index): see rollout/sampling.py.
    batch["sample_seed"] = mix_seed(ctx.config.trainer.seed ^ salt, step, batch["row_index"],
                                    sample_index)
    return batch


def agent_rows(batch: Batch) -> list[dict]:
    """What an episode starts from: each sample's dataset row (with its encoded images, an
    image-text model's, under `images`)."""
    return [{"prompt": p, "data_source": d, "ground_truth": g, "extra_info": e, "images": i}
            for p, d, g, e, i in zip(batch["prompt"], batch["data_source"],
                                     batch["ground_truth"], batch["extra_info"],
                                     row_images(batch), strict=True)]


def _multi_turn(ctx: NodeContext, batch: Batch, params: SamplingParams) -> Batch:
    agent, m = ctx.engines.agent, ctx.metrics
    look_ahead = None
    if ctx.next_prompts is not None and not ctx.node.model:
        def look_ahead():   # the next step's samples, while this batch waits on its tools
            prompts = ctx.next_prompts()
            if prompts is None:
                return None
            ahead = samples(ctx, prompts, ctx.step + 1)
            return agent_rows(ahead), ahead["sample_seed"]
    out = agent.generate(agent_rows(batch), batch["sample_seed"], params,
                         batch["prompt_ids"].device, look_ahead=look_ahead)
    batch["prompt_ids"], batch["prompt_mask"] = out.prompt_ids, out.prompt_mask
    if agent.prompt_width is None:   # handed on from another policy: as wide as the ranks' widest
        batch["prompt_ids"], batch["prompt_mask"] = left_pad(
            out.prompt_ids, out.prompt_mask, agreed_width(ctx, out.prompt_ids.shape[1]),
            agent.pad_token_id)
    batch["responses"] = out.responses
    batch["response_mask"] = out.response_mask
    batch[RESPONSE_ATTENTION_MASK] = out.attention_mask
    batch["rollout_logprobs"] = out.logprobs
    if agent.env_factory is not None:
        batch["turn_scores"] = out.turn_scores
    if out.token_versions is not None:   # the async rollout side: who drew each policy token
        batch["token_versions"] = out.token_versions
    n = len(batch)
    lengths = out.response_mask.sum(-1)
    observed = out.attention_mask.sum(-1) - lengths
    m.add_distribution("response/length", lengths)
    m.add_mean("response/clip_ratio",
               float((out.attention_mask.sum(-1) >= out.responses.shape[1]).sum()), n)
    m.add_mean("prompt/length_mean", float(out.prompt_mask.sum()), n)
    m.add_sum("tokens/total", float(out.attention_mask.sum() + out.prompt_mask.sum()))
    m.add_mean("multi_turn/turns_mean", float(out.turns.sum()), n)
    if look_ahead is not None or out.started_ahead:
        m.add_mean("multi_turn/started_ahead", float(out.started_ahead), 1.0)
    m.add_max("multi_turn/turns_max", float(out.turns.max()) if n else 0.0)
    m.add_mean("multi_turn/observation_tokens_mean", float(observed.sum()), n)
    m.add_mean("tools/calls_mean", float(out.tool_calls.sum()), n)
    m.add_sum("tools/calls", float(out.tool_calls.sum()))
    m.add_sum("tools/errors", float(out.tool_errors.sum()))
    m.add_sum("tools/format_errors", float(out.format_errors.sum()))
    for name, count in out.calls_by_tool.items():
        m.add_sum(f"tools/calls/{name}", count)
    if out.first_error:
        ctx.engines.log_once("tool_error", f"rollout: a tool call failed: {out.first_error} "
                             "(counted from here on: tool_err on the step line, tools/errors "
                             "in the metrics)")
    return batch


@register_role("greedy_baseline", engines=("rollout", "reward"), side="rollout",
               adds={"baseline_scores": "float32"})
def greedy_baseline(ctx: NodeContext, batch: Batch) -> Batch:
    """ReMax: the reward of the greedy response to each prompt, the baseline of its samples.
    Adds baseline_scores [prompts]; the rollout node repeats it with the prompt."""
    cfg = ctx.config.rollout
    seeds = torch.zeros(len(batch), dtype=torch.long)
    greedy = SamplingParams(temperature=0.0)
    sample_ids = [f"{u}/greedy" for u in batch["uid"]]
    if ctx.engines.agent is not None:
        out = ctx.engines.agent.generate(agent_rows(batch), seeds, greedy,
                                         batch["prompt_ids"].device)
        if ctx.engines.agent.env_factory is not None:
            scores = out.turn_scores.sum(-1).tolist()
        else:
            texts = decode_responses(ctx.engines.tokenizer, out.responses, out.attention_mask)
            scores = ctx.engines.reward_manager.score(
                texts, batch["data_source"], batch["ground_truth"], batch["extra_info"],
                sample_ids=sample_ids).scores
    else:
        out = ctx.engines.rollout.generate(
            batch["prompt_ids"], batch["prompt_mask"], seeds, greedy,
            max_new_tokens=cfg.max_new_tokens, min_new_tokens=cfg.min_new_tokens,
            **image_argument(batch))
        texts = decode_responses(ctx.engines.tokenizer, out.responses, out.response_mask)
        scores = ctx.engines.reward_manager.score(texts, batch["data_source"],
                                                  batch["ground_truth"], batch["extra_info"],
                                                  sample_ids=sample_ids).scores
    batch["baseline_scores"] = torch.tensor(scores, dtype=torch.float32)
    ctx.metrics.add_distribution("reward/greedy_baseline", batch["baseline_scores"])
    return batch
