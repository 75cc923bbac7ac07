"""Helpers that mix host integers or Python lists with the batch's tensors must compute on the
batch's device. A GPU run once failed on its first step because they made host tensors beside
the batch's CUDA tensors; here a `meta` tensor stands in for the accelerator's (no GPU needed):
an op that mixes a host tensor of several elements with a meta tensor raises, as with CUDA."""

from __future__ import annotations

import numpy as np
import torch

from dagrl.roles.advantage import group_index
from dagrl.rollout.sampling import mix_seed

META = torch.device("meta")


def test_a_host_tensor_beside_a_meta_tensor_raises():
    # The premise: without the fixes these calls raise like `cuda:0 and cpu` did.
    try:
        _ = torch.arange(4, device=META) ^ torch.arange(4)
    except RuntimeError:
        return
    raise AssertionError("meta and host tensors mixed without an error: the test proves nothing")


def test_mix_seed_follows_the_tensor_parts_device():
    seeds = mix_seed(7, 3, torch.arange(4, device=META), torch.arange(4))
    assert seeds.device == META
    host = mix_seed(7, 3, torch.arange(4), torch.arange(4))
    assert host.device.type == "cpu" and host.shape == (4,)


def test_group_index_is_made_on_the_batch_device():
    # (group_sums and groups_with_variance read a value with .item(), which meta tensors lack:
    # scripts/gpu_smoke.sh runs them on a GPU.)
    index = group_index(np.array(["a", "a", "b", "b"], dtype=object), META)
    assert index.device == META and index.shape == (4,)



def test_the_judge_hands_its_engine_inputs_on_the_engine_device(monkeypatch):
    # The judge tokenizes its prompts on the host; an in-process engine reads them on its
    # model's device (a GPU run's judge once failed in the embedding: `index is on cpu`).
    import dagrl.engines.judge as judge_module
    from dagrl.config.schema import JudgeConfig
    from dagrl.rollout.base import GenerationOutput

    seen: list[torch.device] = []

    class RecordingEngine:
        def generate(self, prompt_ids, prompt_mask, sample_seed, params, *, max_new_tokens,
                     min_new_tokens=0):
            seen.extend(t.device for t in (prompt_ids, prompt_mask, sample_seed))
            n = len(prompt_ids)
            return GenerationOutput(responses=torch.full((n, 1), 5),
                                    response_mask=torch.ones(n, 1), logprobs=torch.zeros(n, 1))

    class Tokenizer:
        pad_token_id = 0

        def batch_decode(self, rows, skip_special_tokens=True):
            return ["7" for _ in rows]

    monkeypatch.setattr(judge_module, "encode_prompt", lambda tok, text: [1, 2, 3][:len(text)])
    cfg = JudgeConfig(path="x", backend="hf", template="{prompt}{response}",
                      score_pattern=r"(\d)", score_scale=9.0, max_new_tokens=1)
    result = judge_module.Judge(cfg, RecordingEngine(), Tokenizer(), META).grade(
        ["a", "bb"], ["x", "y"], [None, None], torch.arange(2))
    assert len(seen) == 3 and all(d == META for d in seen), seen   # one micro-batch
    assert result.scores == [7 / 9, 7 / 9]
