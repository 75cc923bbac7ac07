"""The grouped matmul-softmax attention (`dagrl_grouped`) against transformers' SDPA path, and
the host-memory setting that keeps freed pages for reuse."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
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


def _textbook(q, k, v, mask, scale):
    """softmax(Q K^T * scale + mask) V through autograd, KV heads repeated (nh / nkv)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), -1)
    return (probs.to(v.dtype) @ v).transpose(1, 2)


def _inputs(length: int = 7, dtype: torch.dtype = torch.float32):
    """q [2, 6, T, 16], k/v [2, 3, T, 16] and an additive causal mask with left padding: batch
    row 1's first two query rows see nothing (all masked), as a padded row's do."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(True)
               for shape in ((2, 6, length, 16), (2, 3, length, 16), (2, 3, length, 16)))
    allowed = torch.ones(length, length, dtype=torch.bool).tril().repeat(2, 1, 1, 1)
    allowed[1, :, :, :2] = False
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return q, k, v, mask


@pytest.mark.parametrize("precision", ["float32", "autocast", "float64"])
def test_grouped_attention_gradients_match_autograd(precision):
    """The recomputing backward gives autograd's gradients of the textbook ops: float32,
    bfloat16 autocast with float32 inputs (a mixed-precision update), and float64 (the
    golden-curve runs; its mask's minimum is -inf in float32, so the softmax stays float64)."""
    autocast = precision == "autocast"
    dtype = torch.float64 if precision == "float64" else torch.float32
    results = {}
    weights = torch.randn(2, 7, 6, 16, generator=torch.Generator().manual_seed(9), dtype=dtype)
    for name in ("textbook", "grouped"):
        q, k, v, mask = _inputs(dtype=dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = (_textbook(q, k, v, mask, 0.25) if name == "textbook" else
                   grouped_attention(None, q, k, v, mask, scaling=0.25)[0])
        (out.to(dtype) * weights)[:, 2:].sum().backward()    # padded query rows unread
        results[name] = out.to(dtype), q.grad, k.grad, v.grad
    tol = dict(atol=3e-2, rtol=3e-2) if autocast else dict(atol=1e-5, rtol=1e-5)
    (want, *want_grads), (got, *got_grads) = results["textbook"], results["grouped"]
    torch.testing.assert_close(got[:, 2:], want[:, 2:], **tol)
    assert torch.isfinite(got).all()
    for name, a, b in zip("qkv", got_grads, want_grads, strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, **tol, msg=name)


def test_grouped_attention_keeps_no_scores_for_backward():
    """Only Q, K, V and the mask are saved: nothing of [T, S] per head."""
    q, k, v, mask = _inputs(length=80)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t,
                                                  lambda t: t):
        grouped_attention(None, q, k, v, mask)
    scores = 2 * 6 * 80 * 80                     # batch x heads x T x S
    # Q is a fifth of that, the mask a sixth (one for all heads).
    assert saved and all(s.numel() <= scores // 5 for s in saved), saved
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t,
                                                  lambda t: t):
        _textbook(q, k, v, mask, 0.25)
    assert any(s.numel() >= scores for s in saved)      # the check can fail


def test_resolve_attn_implementation():
    assert resolve_attn_implementation("auto", "cpu") == NAME
    assert resolve_attn_implementation("auto", torch.device("meta")) == "sdpa"
    assert resolve_attn_implementation("eager", "cpu") == "eager"
    with pytest.raises(ValueError, match="model.attn_implementation"):
        resolve_attn_implementation("flash", "cpu")


_STEPS = """
import ctypes, ctypes.util, json, resource, sys, torch
from dagrl.engines.host_memory import keep_freed_memory

class MallInfo2(ctypes.Structure):   # glibc >= 2.33, <malloc.h>
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] in ("keep", "keep+map"):
    assert keep_freed_memory()
if sys.argv[1] == "keep+map":          # trainer.trim_host_memory's large-block setting
    from dagrl.engines.host_memory import map_large_blocks
    assert map_large_blocks()
MiB, out = 2**20, {"faults": []}
for step in range(6):                  # six "steps": 8 activations of 5 MiB, then all freed
    before = (libc.mallinfo2().hblkhd, resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
    acts = [torch.ones(5 * MiB // 4) for _ in range(8)]
    if step == 0:                      # bytes glibc served with their own mmap
        out["mapped_mib"] = (libc.mallinfo2().hblkhd - before[0]) / MiB
    del acts
    out["faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before[1])
out["free_kept_mib"] = libc.mallinfo2().fordblks / MiB   # freed bytes still in the heap
from dagrl.engines.host_memory import release_freed_memory
from dagrl.observe.memory import host_rss_bytes
rss = host_rss_bytes()
release_freed_memory()                 # trainer.trim_host_memory, between two nodes
out["released_mib"] = (rss - host_rss_bytes()) / MiB
print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_keep_freed_memory_reuses_pages():
    """In a fresh process (as a worker starts), steps that allocate and free the same
    activations. glibc's default serves the first step's 5 MiB blocks with their own mmaps
    (returned, and faulted in again, page by page); with the setting they come from the heap
    and stay there once freed, so the next steps reuse the same pages.

    The allocator's own accounting (mallinfo2) is checked, because it does not depend on the
    kernel; page faults are counted too, but some sandboxes' kernels report none at all."""
    if not hasattr(ctypes.CDLL(ctypes.util.find_library("c") or None), "mallinfo2"):
        pytest.skip("glibc older than 2.33: no mallinfo2")

    def run(mode: str) -> dict:
        out = subprocess.run([sys.executable, "-c", _STEPS, mode], check=True,
                             capture_output=True, text=True).stdout
        return json.loads(out.splitlines()[-1])

    default, kept = run("default"), run("keep")
    if default["mapped_mib"] < 40:     # glibc maps blocks over 128 KiB in a fresh process
        pytest.skip(f"malloc here is not glibc's default (a preloaded allocator or MALLOC_* "
                    f"settings): {default}")
    assert kept["mapped_mib"] < 5, f"blocks under 32 MiB still mmapped with the setting: {kept}"
    assert kept["free_kept_mib"] >= 40, f"freed activations handed back to the OS: {kept}"
    assert sum(kept["faults"][3:]) < 1000, f"later steps faulted their pages in again: {kept}"
    # ... until released between nodes: the kept 40 MiB go back to the OS.
    assert kept["released_mib"] >= 30, f"malloc_trim returned too little: {kept}"
    # trainer.trim_host_memory: large blocks get their own mappings again, kept or not, and go
    # back to the OS when freed: nothing of them stays in the heap to fragment it.
    mapped = run("keep+map")
    assert mapped["mapped_mib"] >= 40, f"5 MiB blocks not mapped on their own: {mapped}"
    assert mapped["free_kept_mib"] < 5, f"freed large blocks kept in the heap: {mapped}"
