"""`model.share_prompts`: each distinct prompt of a micro-batch is computed once and its samples'
responses follow it in one row under a tree mask (engines/shared_prompts.py). The numbers, and
the gradients, are those of the padded layout."""

from __future__ import annotations

import pytest
import torch

from dagrl.config.loader import ConfigError
from dagrl.engines.forward import batch_logprobs, response_logprobs, response_values
from dagrl.engines.layout import EngineLayout
from dagrl.engines.models import load_model, write_tiny_model
from dagrl.engines.shared_prompts import shared_prompt_inputs
from dagrl.train import load_cli_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("shared") / "tiny", "tiny-qwen2",
                                hidden_size=64, layers=2, seed=3))


def _groups(seed: int = 0):
    """Two GRPO groups of 3 samples (prompts of 6 and 9 real tokens, left-padded to 9) and one
    sample alone, rows interleaved; right-padded responses of 0-7 tokens; in rows 0 and 4 the
    response columns 2-3 are tool tokens (read, not scored): -> prompt_ids, prompt_mask,
    responses, response_mask (scored), attention (read)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, 40, (3, 9), generator=g)
    pads = [3, 0, 5]
    which = [0, 1, 0, 1, 2, 0, 1]                      # the prompt of each row
    prompt_ids = prompts[which]
    prompt_mask = torch.ones(7, 9, dtype=torch.long)
    for b, p in enumerate(which):
        prompt_mask[b, :pads[p]] = 0
        prompt_ids[b, :pads[p]] = 0
    responses = torch.randint(4, 40, (7, 7), generator=g)
    attention = torch.zeros(7, 7, dtype=torch.long)
    for b, length in enumerate([7, 2, 0, 4, 5, 1, 6]):
        attention[b, :length] = 1
    scored = attention.clone()
    scored[0, 2:4] = 0
    scored[4, 2:4] = 0
    return prompt_ids, prompt_mask, responses, scored, attention


def test_each_distinct_prompt_is_one_row_and_every_response_reads_only_its_prompt_and_itself():
    prompt_ids, prompt_mask, responses, scored, attention = _groups()
    shared = shared_prompt_inputs(prompt_ids, prompt_mask, responses, scored, attention)
    # Rows: prompt 0 (6 tokens) + responses 7, 0, 1; prompt 1 (9) + 2, 4, 6; prompt 2 (4) + 5.
    assert shared.input_ids.shape == (3, 21)
    assert torch.equal(shared.input_ids[0, :6], prompt_ids[0, 3:])
    assert torch.equal(shared.input_ids[0, 6:13], responses[0])
    assert torch.equal(shared.input_ids[0, 13:14], responses[5, :1])
    assert shared.position_ids[0, 13] == 6 and shared.position_ids[1, 9 + 2] == 9
    allowed = shared.allowed
    # Row 0: response of sample 5 (column 13) reads the prompt and itself, not sample 0's.
    assert allowed[0, 13, :6].all() and allowed[0, 13, 13]
    assert not allowed[0, 13, 6:13].any()
    assert not allowed[0, 5, 6:].any()                              # prompts stay causal
    assert allowed[0, 12, :13].all() and not allowed[0, 12, 13:].any()
    # Predictors: the first response token of every sample by the prompt's last column.
    # Scored tokens in row-major order: sample 0 has 5, 1 has 2, 2 none, 3 has 4, 4 has 3.
    first = [int(shared.predicting[i]) for i in (0, 14, 5)]        # samples 0, 5 and 1
    assert first == [5, 5, 21 + 8]                                  # sample 1: row 1, column 8
    assert len(shared.predicting) == int(scored.sum())


@pytest.mark.parametrize("attn", ["dagrl_grouped", "sdpa", "eager"])
def test_shared_prompts_equal_padded_in_log_probs_entropy_and_gradients(model_dir, attn):
    batch = _groups()
    weights = torch.randn(7, 7, generator=torch.Generator().manual_seed(1))
    results = {}
    for share in (False, True):
        model = load_model(model_dir, attn_implementation=attn)
        out = response_logprobs(model, *batch[:4], attention_mask=batch[4], temperature=0.7,
                                with_entropy=True, chunk_tokens=5, share_prompts=share)
        ((out.logprobs * weights).sum() + 0.3 * out.entropy.sum()).backward()
        results[share] = out, {n: p.grad for n, p in model.named_parameters()}
    (padded, padded_grads), (shared, shared_grads) = results[False], results[True]
    torch.testing.assert_close(shared.logprobs, padded.logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared.entropy, padded.entropy, atol=1e-5, rtol=1e-5)
    scored = batch[3].bool()
    assert (shared.logprobs[scored] < 0).all() and shared.logprobs[~scored].abs().sum() == 0
    for name, grad in shared_grads.items():
        torch.testing.assert_close(grad, padded_grads[name], atol=1e-5, rtol=1e-5, msg=name)


def _real_columns(shared) -> torch.Tensor:
    """[G, T] bool: the prompt and response columns of the rows (not the padding)."""
    real = torch.zeros(shared.input_ids.shape, dtype=torch.bool)
    for g, length in enumerate(shared.prompt_lengths):
        real[g, :length] = True
    for g, start, n in shared.spans:
        real[g, start:start + n] = True
    return real


@pytest.mark.parametrize("overhead", [4096, 0], ids=["one-response-block", "by-length"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cascade_attention_is_the_tree_masked_attention(dtype, overhead, monkeypatch):
    # The prompt and response blocks give what softmax over the tree-masked rows gives, at
    # every real column, and the same gradients to Q, K and V (grouped query heads: 4 over 2).
    import dagrl.engines.shared_prompts as shared_prompts
    from dagrl.engines.attention import grouped_attention

    monkeypatch.setattr(shared_prompts, "BLOCK_OVERHEAD_SCORES", overhead)
    shared = shared_prompt_inputs(*_groups())
    blocks = shared.attention_blocks(dtype)
    rows, width = shared.input_ids.shape
    # Rows of 21 columns (3 x 441 scores); prompts padded to 9; responses of 7, 6, 5, 4, 2, 1
    # tokens in one block, or in blocks where no response is padded by more than 0 scores.
    shapes = [tuple(b.mask.shape) for b in blocks.responses]
    assert shapes == {4096: [(6, 1, 7, 16)],
                      0: [(1, 1, 7, 16), (1, 1, 6, 15), (1, 1, 5, 14), (1, 1, 4, 13),
                          (1, 1, 2, 11), (1, 1, 1, 10)]}[overhead]
    g = torch.Generator().manual_seed(2)
    qkv = [torch.randn(rows, h, width, 8, generator=g, dtype=dtype, requires_grad=True)
           for h in (4, 2, 2)]
    real = _real_columns(shared)
    outs, grads = [], []
    for use_blocks in (False, True):
        out, _ = grouped_attention(None, *qkv, shared.attention_mask("dagrl_grouped", dtype),
                                   scaling=0.3, attention_blocks=blocks if use_blocks else None)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=dtype)
        (out[real] * weights[real]).sum().backward()
        outs.append(out[real])
        grads.append([t.grad.clone() for t in qkv])
        for t in qkv:
            t.grad = None
    assert (outs[1] != 0).all()
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_blocks_are_skipped_when_they_would_hold_more_scores_than_the_rows():
    # Two samples with their own prompts of 20 and 1 tokens, responses of 1 and 20: rows of 21
    # (2 x 441 scores); blocks padded to prompts of 20 and responses of 20 hold 2400.
    prompt_ids = torch.arange(1, 41).view(2, 20)
    prompt_mask = torch.ones(2, 20, dtype=torch.long)
    prompt_mask[1, :19] = 0
    attention = torch.zeros(2, 20, dtype=torch.long)
    attention[0, :1] = attention[1, :] = 1
    shared = shared_prompt_inputs(prompt_ids, prompt_mask, torch.ones(2, 20, dtype=torch.long),
                                  attention, attention)
    assert shared.input_ids.shape == (2, 21) and shared.attention_blocks(torch.float32) is None


def test_the_grouped_kernel_runs_shared_rows_as_blocks(model_dir, monkeypatch):
    import dagrl.engines.attention as attention

    calls = []
    cascade = attention._cascade

    def counted(module, query, *args):
        calls.append(query.shape[0])
        return cascade(module, query, *args)

    monkeypatch.setattr(attention, "_cascade", counted)
    with torch.no_grad():
        response_logprobs(load_model(model_dir, attn_implementation="dagrl_grouped"),
                          *_groups()[:4], attention_mask=_groups()[4], share_prompts=True)
    assert calls == [3, 3]                                     # both layers, the 3 rows


def test_a_response_does_not_see_its_neighbours(model_dir):
    # Changing one sample's response leaves its group's other samples' log-probs unchanged.
    model = load_model(model_dir)
    prompt_ids, prompt_mask, responses, scored, attention = _groups()
    changed = responses.clone()
    changed[0] = (changed[0] + 1) % 40
    with torch.no_grad():
        before = response_logprobs(model, prompt_ids, prompt_mask, responses, scored,
                                   attention_mask=attention, share_prompts=True).logprobs
        after = response_logprobs(model, prompt_ids, prompt_mask, changed, scored,
                                  attention_mask=attention, share_prompts=True).logprobs
    torch.testing.assert_close(after[1:], before[1:], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(after[0], before[0])


def test_shared_prompt_values_and_batched_log_probs_equal_padded(model_dir):
    from dagrl.data.batch import Batch
    from dagrl.engines.critic import load_value_model

    prompt_ids, prompt_mask, responses, scored, attention = _groups()
    critic = load_value_model(model_dir, "float32", torch.device("cpu"))
    with torch.no_grad():
        padded = response_values(critic, prompt_ids, prompt_mask, responses, scored,
                                 attention_mask=attention)
        shared = response_values(critic, prompt_ids, prompt_mask, responses, scored,
                                 attention_mask=attention, share_prompts=True)
    torch.testing.assert_close(shared, padded, atol=1e-5, rtol=1e-5)
    assert shared[0].abs().sum() > 0

    model = load_model(model_dir)
    batch = Batch(tensors={"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
                           "responses": responses, "response_mask": scored,
                           "response_attention_mask": attention}, batch_size=7)
    plain = batch_logprobs(model, batch, micro_batch_size=7, temperature=1.0)
    for micro in (1, 3, 7):          # groups cut across micro-batches still score the same
        cut = batch_logprobs(model, batch, micro_batch_size=micro, temperature=1.0,
                             share_prompts=True)
        torch.testing.assert_close(cut, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("budget", [15, 30, 40, 1000])
def test_a_token_budget_counts_each_prompt_once_and_keeps_groups_whole(model_dir, budget):
    from dagrl.data.batch import Batch
    from dagrl.engines.micro_batches import micro_batches

    prompt_ids, prompt_mask, responses, scored, attention = _groups()
    batch = Batch(tensors={"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
                           "responses": responses, "response_mask": scored,
                           "response_attention_mask": attention}, batch_size=7)
    # Groups: prompt 0 (6 tokens) rows 0, 2, 5 reading 7 + 0 + 1 -> 14 shared tokens; prompt 1
    # (9) rows 1, 3, 6 reading 2 + 4 + 6 -> 21; prompt 2 (4) row 4 reading 5 -> 9.
    parts = micro_batches(batch, micro_batch_size=2, max_tokens=budget, share_prompts=True)
    cut = [sorted(idx.tolist()) for idx, _ in parts]
    assert cut == {1000: [[0, 1, 2, 3, 4, 5, 6]],
                   # 21 + 14 real tokens fit 40, but as two rows padded to 21 they are 42
                   40: [[1, 3, 6], [0, 2, 4, 5]],
                   30: [[1, 3, 6], [0, 2, 4, 5]],            # largest first, then 14 + 9
                   15: [[1, 3], [6], [0, 2, 5], [4]]}[budget]  # prompt 1's group over 15: cut
    for idx, _ in parts:       # one row per prompt, padded to the longest: within the budget
        rows: dict[tuple[int, ...], int] = {}
        for b in idx.tolist():
            prompt = tuple(prompt_ids[b][prompt_mask[b].bool()].tolist())
            rows[prompt] = rows.get(prompt, len(prompt)) + int(attention[b].sum())
        assert len(rows) * max(rows.values()) <= budget
    plain = batch_logprobs(load_model(model_dir), batch, micro_batch_size=7,
                           temperature=1.0)
    shared = batch_logprobs(load_model(model_dir), batch, micro_batch_size=2, temperature=1.0,
                            max_tokens=budget, share_prompts=True)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)


def test_share_prompts_is_refused_with_image_models_and_sequence_parallelism():
    images = load_cli_config(["model.path=builtin:tiny-qwen2.5-vl", "model.share_prompts=true"])
    with pytest.raises(ConfigError, match="model.share_prompts=true: builtin:tiny-qwen2.5-vl is "
                                          "an image-text model"):
        EngineLayout.of(images, 1)
    sp = load_cli_config(["model.share_prompts=true", "actor.sequence_parallel_size=2",
                          "trainer.n_workers=2"])
    with pytest.raises(ConfigError, match="model.share_prompts=true with sequence parallelism"):
        EngineLayout.of(sp, 2)
    assert EngineLayout.of(load_cli_config(["model.share_prompts=true"]), 1).share_prompts


@pytest.mark.parametrize("extra", [[], ["actor.lora.rank=4", "actor.lr=1e-3"]],
                         ids=["full", "lora"])
def test_grpo_steps_are_the_same_with_shared_prompts(tmp_path, monkeypatch, extra):
    # Two GRPO steps with a KL loss (so the reference pass runs too), groups of 4: the update's
    # loss, entropy and gradient norm, the KL and the next step's rewards agree with the padded
    # layout's, and the shared run's passes did run one row per group; under LoRA too (the
    # reference is the actor with its adapters off).
    import dagrl.engines.forward as forward
    from dagrl.runtime.run_dir import prepare_run
    from dagrl.runtime.worker import Worker

    rows_per_pass = []

    def counted(prompt_ids, *args):
        shared = shared_prompt_inputs(prompt_ids, *args)
        rows_per_pass.append((len(prompt_ids), len(shared.input_ids)))
        return shared

    monkeypatch.setattr(forward, "shared_prompt_inputs", counted)

    def run(share: bool) -> list[dict]:
        cfg = load_cli_config([f"trainer.run_dir={tmp_path / str(share)}", "trainer.total_steps=2",
                               "rollout.backend=native", "rollout.n=4",
                               "algorithm.kl_loss_coef=0.01", "trainer.torch_threads=1",
                               f"model.share_prompts={str(share).lower()}",
                               "logging.progress_bar=false", "logging.console_every=1000",
                               *extra])
        return Worker(prepare_run(cfg)).train()

    padded, shared = run(False), run(True)
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/kl",
                "reward/mean"):
        assert [m[key] for m in shared] == pytest.approx([m[key] for m in padded],
                                                         rel=1e-4, abs=1e-6), key
    assert padded[0]["actor/kl"] == 0 and padded[1]["actor/kl"] > 0
    # Reference and update passes of 2 steps; 4 samples of one prompt per row.
    assert len(rows_per_pass) >= 4
    assert all(samples == 4 * rows for samples, rows in rows_per_pass), rows_per_pass

