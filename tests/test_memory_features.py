"""Each memory feature leaves the numbers unchanged: the chunked log-prob/entropy head against
the full [B, T, V] logits computation, and activation checkpointing against keeping the
activations (values and gradients)."""

from __future__ import annotations

import pytest
import torch

from dagrl.algorithms.utils import entropy_from_logits, logprobs_from_logits
from dagrl.data.positions import position_ids_from_mask
from dagrl.engines.forward import response_logprobs
from dagrl.engines.models import load_model, write_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("mem") / "tiny", "tiny-qwen2",
                                hidden_size=64, layers=2, seed=3))


def _batch(seed: int = 0):
    """Left-padded prompts [6, 9] and right-padded responses [6, 7] of varied lengths (one
    empty, none reaching the last column but one)."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(4, 40, (6, 9), generator=g)
    prompt_mask = torch.ones(6, 9, dtype=torch.long)
    responses = torch.randint(4, 40, (6, 7), generator=g)
    response_mask = torch.zeros(6, 7, dtype=torch.long)
    for b, (pad, length) in enumerate([(0, 7), (3, 2), (1, 0), (5, 4), (2, 5), (0, 1)]):
        prompt_mask[b, :pad] = 0
        response_mask[b, :length] = 1
    return prompt_ids, prompt_mask, responses, response_mask


def _full_logits_reference(model, prompt_ids, prompt_mask, responses, response_mask, temperature):
    """The textbook computation: the model's whole [B, T, V] logits, log-softmax, gather."""
    input_ids = torch.cat([prompt_ids, responses], 1)
    attention = torch.cat([prompt_mask, response_mask], 1)
    logits = model(input_ids=input_ids, attention_mask=attention,
                   position_ids=position_ids_from_mask(attention)).logits.float() / temperature
    z = logits[:, prompt_ids.shape[1] - 1:-1]                  # position i predicts token i+1
    mask = response_mask.float()
    return logprobs_from_logits(z, responses) * mask, entropy_from_logits(z) * mask


@pytest.mark.parametrize("chunk_tokens", [0, 5, 1024])
def test_chunked_head_equals_the_full_logits_in_values_and_gradients(model_dir, chunk_tokens):
    model = load_model(model_dir)
    batch = _batch()
    weights = torch.randn(6, 7, generator=torch.Generator().manual_seed(1))

    def grads(loss):
        model.zero_grad(set_to_none=True)
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    ref_lp, ref_ent = _full_logits_reference(model, *batch, temperature=0.7)
    ref_grads = grads((ref_lp * weights).sum() + 0.3 * ref_ent.sum())
    out = response_logprobs(model, *batch, temperature=0.7, with_entropy=True,
                            chunk_tokens=chunk_tokens)
    ours_grads = grads((out.logprobs * weights).sum() + 0.3 * out.entropy.sum())

    torch.testing.assert_close(out.logprobs, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.entropy, ref_ent, atol=1e-5, rtol=1e-5)
    assert out.logprobs[2].abs().sum() == 0 and (out.logprobs[0] < 0).all()
    assert ours_grads.keys() == ref_grads.keys()
    for name, g in ours_grads.items():
        torch.testing.assert_close(g, ref_grads[name], atol=1e-5, rtol=1e-5, msg=name)


def test_chunked_head_leaves_the_model_as_it_was(model_dir):
    model = load_model(model_dir)
    names = [n for n, _ in model.named_parameters()]
    with torch.no_grad():
        response_logprobs(model, *_batch(), chunk_tokens=4)
    assert [n for n, _ in model.named_parameters()] == names
    assert "forward" not in vars(model.get_output_embeddings())   # the head's own forward back
    ids = torch.tensor([[5, 6, 7]])
    assert model(input_ids=ids).logits.shape == (1, 3, model.config.vocab_size)


def test_activation_checkpointing_recomputes_layers_and_leaves_gradients_unchanged(model_dir):
    from dagrl.engines.sharding import checkpoint_activations

    results = {}
    for checkpointed in (False, True):
        model = load_model(model_dir)
        if checkpointed:
            checkpoint_activations(model)
        model.train()
        saved = []   # bytes autograd keeps for backward during the forward

        def pack(t, saved=saved):
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = response_logprobs(model, *_batch(), with_entropy=True, chunk_tokens=0)
        (out.logprobs.sum() + 0.1 * out.entropy.sum()).backward()
        results[checkpointed] = (sum(saved), out.logprobs.detach(),
                                 {n: p.grad for n, p in model.named_parameters()})
    plain, ckpt = results[False], results[True]
    assert ckpt[0] < plain[0] / 3, (ckpt[0], plain[0])   # the layers' intermediates are not kept
    torch.testing.assert_close(ckpt[1], plain[1], atol=0, rtol=0)
    for name, g in ckpt[2].items():
        torch.testing.assert_close(g, plain[2][name], atol=1e-6, rtol=1e-5, msg=name)


def test_gradients_are_freed_after_each_optimizer_step(tmp_path):
    # Between updates (rollout, reference pass) no model-sized gradient buffer stays alive.
    from dagrl.config.loader import load_config
    from dagrl.config.schema import Config
    from dagrl.runtime.run_dir import prepare_run
    from dagrl.runtime.worker import Worker

    cfg = load_config(Config, None, [f"trainer.run_dir={tmp_path / 'run'}",
                                     "trainer.total_steps=2",
                                     "actor.mini_batch_size=16", "trainer.torch_threads=1",
                                     "logging.progress_bar=false", "logging.console_every=1000"])
    worker = Worker(prepare_run(cfg))
    history = worker.train()
    assert [m["actor/optimizer_steps"] for m in history] == [2.0, 2.0]   # 2 mini-batches a step
    assert worker.engines.actor.version == 4
    assert all(p.grad is None for p in worker.engines.actor.model.parameters())


def test_one_worker_native_rollout_reads_the_actor_weights_without_a_copy(tmp_path):
    # The decoder generates with the trained parameters themselves: no second model, nothing
    # to sync, and its log-probs still equal the actor's after every update.
    from dagrl.config.loader import load_config
    from dagrl.config.schema import Config
    from dagrl.runtime.run_dir import prepare_run
    from dagrl.runtime.worker import Worker

    cfg = load_config(Config, None, [f"trainer.run_dir={tmp_path / 'run'}",
                                     "trainer.total_steps=3", "rollout.backend=native",
                                     "actor.skip_on_policy_old_logprob=false",
                                     "trainer.torch_threads=1", "logging.progress_bar=false",
                                     "logging.console_every=1000"])
    worker = Worker(prepare_run(cfg))
    history = worker.train()
    engines = worker.engines
    assert engines.rollout.model is engines.actor.model
    assert all(p.requires_grad for p in engines.actor.model.parameters())   # still trainable
    assert engines.rollout.weights_version == engines.actor.version == 3
    assert all(m["timing/weight_sync_s"] == 0.0 for m in history)
    assert all(m["actor/rollout_logprob_gap"] < 1e-5 for m in history)
    assert history[-1]["reward/mean"] != history[0]["reward/mean"]   # it did train


@pytest.mark.parametrize("attn", ["dagrl_grouped", "sdpa", "eager"])
def test_packed_sequences_equal_padded_in_values_and_gradients(model_dir, attn):
    results = {}
    weights = torch.randn(6, 7, generator=torch.Generator().manual_seed(1))
    for pack in (False, True):
        model = load_model(model_dir, attn_implementation=attn)
        out = response_logprobs(model, *_batch(), temperature=0.7, with_entropy=True,
                                chunk_tokens=5, pack=pack)
        ((out.logprobs * weights).sum() + 0.3 * out.entropy.sum()).backward()
        results[pack] = out, {n: p.grad for n, p in model.named_parameters()}
    (padded, padded_grads), (packed, packed_grads) = results[False], results[True]
    torch.testing.assert_close(packed.logprobs, padded.logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed.entropy, padded.entropy, atol=1e-5, rtol=1e-5)
    assert (packed.logprobs[0] < 0).all() and packed.logprobs[2].abs().sum() == 0
    for name, g in packed_grads.items():
        torch.testing.assert_close(g, padded_grads[name], atol=1e-5, rtol=1e-5, msg=name)


def test_packed_rows_do_not_attend_across_sequences(model_dir):
    # The same sample's log-probs alone and packed behind another sample are the same: the
    # block-causal mask keeps attention inside each sequence.
    model = load_model(model_dir)
    batch = _batch()
    with torch.no_grad():
        both = response_logprobs(model, *[t[3:5] for t in batch], pack=True).logprobs
        alone = response_logprobs(model, *[t[4:5] for t in batch], pack=True).logprobs
    torch.testing.assert_close(both[1:], alone, atol=1e-6, rtol=1e-6)


def test_packed_values_equal_padded(model_dir):
    from dagrl.engines.critic import load_value_model
    from dagrl.engines.forward import response_values

    model = load_value_model(model_dir, "float32", torch.device("cpu"))
    with torch.no_grad():
        padded = response_values(model, *_batch())
        packed = response_values(model, *_batch(), pack=True)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)
    assert packed[2].abs().sum() == 0 and packed[0].abs().sum() > 0


def _as_batch(prompt_ids, prompt_mask, responses, response_mask):
    from dagrl.data.batch import Batch

    return Batch(tensors={"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
                          "responses": responses, "response_mask": response_mask},
                 batch_size=len(prompt_ids))


@pytest.mark.parametrize("budget", [1, 20, 25, 1000])
def test_token_budget_micro_batches_cover_every_sample_once_within_the_budget(budget):
    from dagrl.engines.micro_batches import micro_batches, sample_tokens

    batch = _as_batch(*_batch())
    tokens = sample_tokens(batch)
    assert tokens.tolist() == [9 + 7, 6 + 2, 8 + 0, 4 + 4, 7 + 5, 9 + 1]   # prompt + response
    parts = micro_batches(batch, micro_batch_size=2, max_tokens=budget)
    seen = torch.cat([idx for idx, _ in parts]).tolist()
    assert sorted(seen) == list(range(6))
    for idx, mb in parts:
        assert len(mb) == 1 or int(tokens[idx].sum()) <= budget
        assert torch.equal(mb["responses"], batch["responses"][idx])
    assert len(parts) == {1: 6, 20: 4, 25: 3, 1000: 1}[budget]


def test_batch_logprobs_is_the_same_however_the_batch_is_cut(model_dir):
    from dagrl.engines.forward import batch_logprobs

    model = load_model(model_dir)
    batch = _as_batch(*_batch())
    plain = batch_logprobs(model, batch, micro_batch_size=6, temperature=1.0)
    for max_tokens, pack in ((20, False), (20, True), (25, True)):
        cut = batch_logprobs(model, batch, micro_batch_size=2, temperature=1.0,
                             max_tokens=max_tokens, pack=pack)
        torch.testing.assert_close(cut, plain, atol=1e-5, rtol=1e-5)


def _gapped(batch):
    """A multi-turn layout of `_batch()`: in rows 0 and 4 the response columns 2-3 are tool
    tokens (read, not trained on): loss mask with a gap, attention mask without."""
    prompt_ids, prompt_mask, responses, attention = batch
    loss = attention.clone()
    loss[0, 2:4] = 0
    loss[4, 2:4] = 0
    return prompt_ids, prompt_mask, responses, loss, attention


@pytest.mark.parametrize("pack", [False, True])
def test_gapped_masks_attend_to_tool_tokens_and_score_only_policy_tokens(model_dir, pack):
    # The log-probs of a multi-turn response are those of the full sequence (tool tokens in
    # the context) at the policy's tokens, and 0 at the tool tokens.
    from dagrl.engines.critic import load_value_model
    from dagrl.engines.forward import response_values

    model = load_model(model_dir)
    prompt_ids, prompt_mask, responses, loss, attention = _gapped(_batch())
    with torch.no_grad():
        ref, _ = _full_logits_reference(model, prompt_ids, prompt_mask, responses, attention, 1.0)
        out = response_logprobs(model, prompt_ids, prompt_mask, responses, loss,
                                attention_mask=attention, chunk_tokens=5, pack=pack).logprobs
        unread = response_logprobs(model, prompt_ids, prompt_mask, responses, loss,
                                   pack=pack).logprobs
    torch.testing.assert_close(out, ref * loss, atol=1e-5, rtol=1e-5)
    assert out[0, 2:4].abs().sum() == 0 and (out[0, 4:] < 0).all()
    # Without the attention mask the tool tokens would drop out of the context.
    assert not torch.allclose(unread[0, 4:], out[0, 4:], atol=1e-4)

    critic = load_value_model(model_dir, "float32", torch.device("cpu"))
    with torch.no_grad():
        values = response_values(critic, prompt_ids, prompt_mask, responses, loss,
                                 attention_mask=attention, pack=pack)
        full = response_values(critic, prompt_ids, prompt_mask, responses, attention)
    torch.testing.assert_close(values, full * loss, atol=1e-5, rtol=1e-5)


def test_token_counts_include_tool_tokens():
    from dagrl.data.buffer import sample_tokens as balance_tokens
    from dagrl.engines.micro_batches import sample_tokens

    prompt_ids, prompt_mask, responses, loss, attention = _gapped(_batch())
    batch = _as_batch(prompt_ids, prompt_mask, responses, loss)
    batch["response_attention_mask"] = attention
    expected = [9 + 7, 6 + 2, 8 + 0, 4 + 4, 7 + 5, 9 + 1]
    assert sample_tokens(batch).tolist() == expected
    assert balance_tokens(batch).tolist() == expected
