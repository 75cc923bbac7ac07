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
