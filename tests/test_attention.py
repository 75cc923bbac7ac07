"""The grouped matmul-softmax attention (`dagrl_grouped`) against transformers' SDPA path, and
the host-memory setting that keeps freed pages for reuse."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dagrl.engines import attention
from dagrl.engines.attention import NAME, grouped_attention, resolve_attn_implementation
from dagrl.engines.forward import response_logprobs
from dagrl.engines.models import load_model


def _left_padded(batch: int, length: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for b in range(batch):
        mask[b, : b % 4] = 0          # 0-3 padding columns on the left
    return ids, mask


@pytest.mark.parametrize("family", ["tiny-qwen2", "tiny-llama"])
def test_grouped_attention_matches_sdpa_forward_and_backward(tmp_path, family):
    from dagrl.engines.models import write_tiny_model

    path = str(write_tiny_model(tmp_path / family, family, hidden_size=64, layers=2, seed=1))
    models = {impl: load_model(path, attn_implementation=impl) for impl in ("sdpa", NAME)}
    assert models[NAME].config._attn_implementation == NAME
    ids, mask = _left_padded(6, 12, 48)
    responses, rmask = ids[:, :5].flip(1), torch.ones(6, 5)
    rmask[0, 3:] = 0
    out, grads = {}, {}
    for impl, model in models.items():
        lp = response_logprobs(model, ids, mask, responses, rmask).logprobs
        lp.sum().backward()
        out[impl] = lp.detach()
        grads[impl] = model.model.layers[0].self_attn.q_proj.weight.grad
    # Same values at every real position (padding query rows differ: neither is ever read).
    torch.testing.assert_close(out[NAME], out["sdpa"], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(grads[NAME], grads["sdpa"], atol=2e-5, rtol=1e-4)


def test_grouped_attention_hands_long_inputs_to_sdpa(monkeypatch):
    calls = []

    def fake_sdpa(module, query, key, value, mask, **kwargs):
        calls.append(query.shape)
        return query.transpose(1, 2), None

    monkeypatch.setattr(attention, "sdpa_attention_forward", fake_sdpa)
    q, kv = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    grouped_attention(None, q, kv, kv, None)
    assert calls == []                                   # 256 scores: the grouped math
    monkeypatch.setattr(attention, "MAX_SCORES", 255)
    grouped_attention(None, q, kv, kv, None)
    assert calls == [q.shape]


def test_grouped_attention_heads_share_kv_in_order():
    """Query head h reads KV head h // (nh / nkv), as repeat_kv lays them out."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 5, 8), torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    got, _ = grouped_attention(None, q, k, v, None, scaling=0.3)
    def rep(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(2, dim=1)

    want = torch.softmax(q @ rep(k).transpose(-1, -2) * 0.3, -1) @ rep(v)
    torch.testing.assert_close(got, want.transpose(1, 2))


def test_resolve_attn_implementation():
    assert resolve_attn_implementation("auto", "cpu") == NAME
    assert resolve_attn_implementation("auto", torch.device("meta")) == "sdpa"
    assert resolve_attn_implementation("eager", "cpu") == "eager"
    with pytest.raises(ValueError, match="model.attn_implementation"):
        resolve_attn_implementation("flash", "cpu")


_STEPS = """
import resource, sys, torch
from dagrl.runtime.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
faults = []
for _ in range(6):                     # six "steps": 8 activations of 5 MiB, then all freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    acts = [torch.ones(5 * 2**20 // 4) for _ in range(8)]
    del acts
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[3:]))                 # the last three steps
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_keep_freed_memory_reuses_pages():
    """In a fresh process (as a worker starts), steps that allocate and free the same
    activations: by default glibc hands the freed heap back and every step faults its 40 MiB
    (~10k pages) in again; with the setting the pages stay and later steps fault none."""
    def faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _STEPS, mode], check=True,
                             capture_output=True, text=True).stdout
        return int(out.split()[-1])

    default, kept = faults("default"), faults("keep")
    assert default > 20000, f"default glibc faulted only {default} pages: nothing to test"
    assert kept < 1000, f"{kept} page faults in three steps with freed memory kept"
