"""Tensor and sequence parallelism on gloo processes: the sharded model computes what one process
computes (log-probs, entropy, Σπ², values and every gradient), holds about half the parameter
and optimizer memory per rank (TP=2) or less activation memory for a 4k-token sequence (SP=2),
and its weights gather into the rollout layout with one collective per bucket per mesh
dimension."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dagrl.config.loader import ConfigError
from tests.dist_helpers import run_distributed


def _inputs(padded: bool):
    """4 rows; `padded`: left-padded prompts and short responses (the masked path), else every
    row whole (the causal path without a mask). 11 columns: odd, so SP pads the sequence.
    Rows 2 and 3 have one prompt (a group, for model.share_prompts)."""
    g = torch.Generator().manual_seed(0)
    batch, p, r = 4, 6, 5
    prompt_ids = torch.randint(4, 48, (batch, p), generator=g)
    prompt_ids[3] = prompt_ids[2]
    responses = torch.randint(4, 48, (batch, r), generator=g)
    prompt_mask = torch.ones(batch, p, dtype=torch.long)
    response_mask = torch.ones(batch, r)
    if padded:
        prompt_mask[0, :2] = 0
        prompt_mask[1, :1] = 0
        response_mask[2, 3:] = 0
        response_mask[3, 1:] = 0
    return prompt_ids, prompt_mask, responses, response_mask


def _full(t: torch.Tensor) -> np.ndarray:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().numpy().copy()


def _passes(rank, world, model_dir, tp, sp, share=False):
    """Log-probs (+ entropy, Σπ²) and values with their gradients, in every input layout
    (`share`: the shared-prompt one too; sequence parallelism refuses it)."""
    from dagrl.engines.critic import load_value_model
    from dagrl.engines.forward import response_logprobs, response_values
    from dagrl.engines.mesh import build_train_mesh, parallelize_model
    from dagrl.engines.models import load_model

    mesh = build_train_mesh(world, tp, sp, "cpu")
    out = {}
    for padded in (True, False):
        for pack, shared in ((False, False), (True, False), (False, True))[:3 if share else 2]:
            model = parallelize_model(load_model(model_dir), mesh)
            res = response_logprobs(model, *_inputs(padded), temperature=0.7, with_entropy=True,
                                    chunk_tokens=4, pack=pack, with_sum_pi_squared=True,
                                    share_prompts=shared)
            loss = (1.3 * res.logprobs + 0.1 * res.entropy + res.sum_pi_squared).sum()
            # The engines' scaling: FSDP averages over dp x sp ranks (train_engine.py).
            (loss * max(mesh.fsdp_size, 1)).backward()
            key = f"padded={padded},pack={pack},shared={shared}"
            out[key] = {"logprobs": _full(res.logprobs), "entropy": _full(res.entropy),
                        "sum_sq": _full(res.sum_pi_squared),
                        **{n: _full(p.grad) for n, p in model.named_parameters()}}
            torch.manual_seed(0)   # the value head is new: the same draw on every process
            critic = parallelize_model(load_value_model(model_dir, "float32", torch.device("cpu")),
                                       mesh)
            values = response_values(critic, *_inputs(padded), pack=pack, share_prompts=shared)
            (values.square().sum() * max(mesh.fsdp_size, 1)).backward()
            out["values " + key] = {"values": _full(values), **{
                n: _full(p.grad) for n, p in critic.named_parameters()}}
    return out


def _assert_match(reference: dict, per_rank: list[dict]) -> None:
    """Every rank's tensors equal one process's, to 1e-5 of each tensor's largest entry."""
    for rank_out in per_rank:
        assert rank_out.keys() == reference.keys()
        for case, tensors in reference.items():
            for name, want in tensors.items():
                got = rank_out[case][name]
                assert got.shape == want.shape, (case, name)
                scale = max(float(np.abs(want).max()), 1.0)
                assert np.abs(got - want).max() <= 1e-5 * scale, (case, name)


# SP's 2-process parity: -m slow here and in test_model_parallel_runs.py, -m composition.
@pytest.mark.parametrize("tp,sp", [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow)],
                         ids=["tp2", "sp2"])
def test_parallel_model_matches_one_process(tiny_model_dir, tp, sp):
    # tiny-qwen2: 2 query heads sharing 1 KV head, so TP=2 replicates the KV head and SP=2
    # repeats it; the vocabulary (48) splits over the TP ranks.
    # The shared-prompt layout under TP against the padded one on one process too.
    share = sp == 1
    reference = _passes(0, 1, str(tiny_model_dir), 1, 1, share)
    _assert_match(reference, run_distributed(_passes, 2, str(tiny_model_dir), tp, sp, share))
    if share:
        for padded in (True, False):
            for kind in ("", "values "):
                plain = reference[f"{kind}padded={padded},pack=False,shared=False"]
                shared = reference[f"{kind}padded={padded},pack=False,shared=True"]
                _assert_match({"case": plain}, [{"case": shared}])


@pytest.mark.slow
def test_tensor_and_sequence_parallel_together_match_one_process(tmp_path):
    from dagrl.engines.models import write_tiny_model

    # 4 ranks, tp=2 x sp=2: 4 query heads -> 2 per tp rank -> 1 per sp rank; 2 KV heads -> 1
    # per tp rank, repeated for the 2 sp ranks.
    model_dir = str(write_tiny_model(tmp_path / "heads4", hidden_size=64, layers=2, heads=4,
                                     kv_heads=2))
    _assert_match(_passes(0, 1, model_dir, 1, 1), run_distributed(_passes, 4, model_dir, 2, 2))


def _param_and_optimizer_bytes(rank, world, model_dir, tp):
    from dagrl.engines.forward import response_logprobs
    from dagrl.engines.mesh import build_train_mesh, parallelize_model
    from dagrl.engines.models import load_model

    model = parallelize_model(load_model(model_dir), build_train_mesh(world, tp, 1, "cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    response_logprobs(model, *_inputs(True)).logprobs.sum().backward()
    optimizer.step()   # AdamW's state exists after the first step

    def local(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = sum(local(p) for p in model.parameters())
    state = sum(local(v) for s in optimizer.state.values() for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0)
    return params, state


@pytest.fixture(scope="module")
def kv2_model_dir(tmp_path_factory):
    """tiny-qwen2 with 2 KV heads: tensor parallelism splits every linear."""
    from dagrl.engines.models import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "kv2", hidden_size=64,
                            layers=2, heads=2, kv_heads=2)


@pytest.mark.parametrize("kv_heads", [2, pytest.param(1, marks=pytest.mark.slow)])
def test_tensor_parallel_halves_parameter_and_optimizer_memory(tiny_model_dir, kv2_model_dir,
                                                               kv_heads):
    from dagrl.config.presets import load_run_config
    from dagrl.engines.memory_estimate import ModelShape, estimate_memory
    from dagrl.engines.models import load_model

    model_dir = str(kv2_model_dir if kv_heads == 2 else tiny_model_dir)
    whole_params, whole_state = _param_and_optimizer_bytes(0, 1, model_dir, 1)
    per_rank = run_distributed(_param_and_optimizer_bytes, 2, model_dir, 2)
    whole = whole_params + whole_state
    for params, state in per_rank:
        ratio = (params + state) / whole
        # Only the norms stay whole on each rank (and, with one KV head, k/v_proj).
        assert 0.5 < ratio < (0.51 if kv_heads == 2 else 0.56), ratio
        assert state == 2 * params               # exp_avg and exp_avg_sq of every parameter
    # dagrl plan --memory predicts exactly these bytes.
    cfg = load_run_config(None, ["trainer.n_workers=2", "actor.tensor_parallel_size=2"])
    lines = {line.name: line.bytes for line in
             estimate_memory(cfg, ModelShape.of(load_model(model_dir).config))}
    assert lines["actor weights"] == per_rank[0][0]
    assert lines["AdamW state"] == per_rank[0][1]


def _activation_bytes(rank, world, model_dir, tokens):
    """Bytes of the tensors autograd saves for backward in one forward of a `tokens`-long
    sequence (parameters excluded: every rank holds them whole here, no FSDP)."""
    from dagrl.engines.forward import response_logprobs
    from dagrl.engines.mesh import build_train_mesh
    from dagrl.engines.models import load_model
    from dagrl.engines.ulysses import ulysses_parallelize

    # SDPA on both sides: one kernel, so the difference is the sequence split alone.
    model = load_model(model_dir, attn_implementation="sdpa")
    if world > 1:
        ulysses_parallelize(model, build_train_mesh(world, 1, world, "cpu").sp_mesh)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 48, (1, tokens), generator=g)
    half = tokens // 2
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = response_logprobs(model, ids[:, :half], torch.ones(1, half, dtype=torch.long),
                                ids[:, half:], torch.ones(1, tokens - half), chunk_tokens=512)
    out.logprobs.sum().backward()
    return sum(saved.values())


def test_sequence_parallel_4k_tokens_use_less_activation_memory(tiny_model_dir):
    one = _activation_bytes(0, 1, str(tiny_model_dir), 4096)
    per_rank = run_distributed(_activation_bytes, 2, str(tiny_model_dir), 4096)
    for got in per_rank:
        assert got < 0.6 * one, (got, one)


class _Mesh:
    """The two things shard_sequence asks of its sp mesh."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def get_local_rank(self):
        return self._rank


def test_padded_and_packed_rows_reach_attention_as_sequences_not_a_mask():
    """No [T, T] mask for long padded or packed rows (64 MiB in float32 at 4k tokens, per row):
    the model gets each sequence's columns; attention runs causally on each (the numerics are
    checked against one process above)."""
    from dagrl.engines.forward import _global_layout
    from dagrl.engines.ulysses import SEGMENTS_KWARG, shard_sequence

    t = 4096
    prompt_mask, response_mask = torch.ones(2, t // 2, dtype=torch.long), torch.ones(2, t // 2)
    prompt_mask[0, :100] = 0                      # row 0: 100 padding columns on the left
    response_mask[1, -300:] = 0                   # row 1: 300 on the right
    ids = torch.randint(4, 48, (2, t // 2))
    for pack, want in ((False, [[(100, t)], [(0, t - 300)]]),
                       (True, [[(0, t - 100), (t - 100, 2 * t - 400)]])):
        layout = _global_layout(ids, prompt_mask, ids, response_mask, response_mask, pack)
        for rank in (0, 1):
            shard = shard_sequence(_Mesh(2, rank), *layout)
            assert shard.segments == want, (pack, rank)
            kwargs = shard.model_kwargs()
            assert kwargs["attention_mask"] is None and kwargs[SEGMENTS_KWARG] == want
            assert all(v.numel() <= layout[0].numel() for v in kwargs.values()
                       if isinstance(v, torch.Tensor))
    ones = torch.ones(2, t // 2)
    whole = _global_layout(ids, torch.ones_like(prompt_mask), ids, ones, ones, False)
    assert SEGMENTS_KWARG not in shard_sequence(_Mesh(2, 0), *whole).model_kwargs()
    # a sequence with a hole in its attention (no layout makes one today) is refused, not
    # attended across
    input_ids, positions, valid, wanted = whole
    valid = valid.clone()
    valid[0, 10:20] = False
    with pytest.raises(ValueError, match=r"row 0 has a sequence with gaps .* \(columns 0..4095\)"):
        shard_sequence(_Mesh(2, 0), input_ids, positions, valid, wanted)


def test_config_and_model_checks_name_the_key():
    from dagrl.config.presets import load_run_config
    from dagrl.engines.models import tiny_model_config
    from dagrl.engines.tensor_parallel import check_tensor_parallel
    from dagrl.engines.ulysses import check_sequence_parallel

    with pytest.raises(ConfigError, match="actor.tensor_parallel_size.*trainer.n_workers"):
        load_run_config(None, ["trainer.n_workers=2", "actor.tensor_parallel_size=3"])
    with pytest.raises(ConfigError, match="actor.sequence_parallel_size must be > 0"):
        load_run_config(None, ["actor.sequence_parallel_size=0"])
    # LoRA composes with tensor parallelism (tests/test_lora_tp.py): accepted
    load_run_config(None, ["trainer.n_workers=2", "actor.tensor_parallel_size=2",
                           "actor.lora.rank=4"])
    config = tiny_model_config("tiny-qwen2", 48, 64, 2)        # 2 heads, 1 KV head
    check_tensor_parallel(config, 2)                           # KV head replicated
    with pytest.raises(ValueError, match=r"actor.tensor_parallel_size=4 must divide the "
                                         r"model's num_attention_heads \(2\)"):
        check_tensor_parallel(config, 4)
    with pytest.raises(ValueError, match=r"actor.sequence_parallel_size=4 must divide"):
        check_sequence_parallel(config, 4)
    with pytest.raises(ValueError, match="vocab_size"):
        check_tensor_parallel(tiny_model_config("tiny-qwen2", 47, 64, 2), 2)


def test_plan_refuses_a_mesh_the_model_cannot_split_and_a_rollout_tp_the_workers_cannot(
        capsys, tmp_path):
    from dagrl.cli import main
    from dagrl.config.presets import load_run_config
    from dagrl.runtime.input_checks import check_inputs

    # a run is refused with the other input checks, before its directory is written
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"actor.tensor_parallel_size=4 must divide"):
        check_inputs(load_run_config(None, ["trainer.n_workers=4", f"trainer.run_dir={run_dir}",
                                            "actor.tensor_parallel_size=4"]))
    assert not run_dir.exists()

    # the pre-flight reads the model's config (2 heads) before anything loads
    assert main(["plan", "trainer.n_workers=4", "actor.tensor_parallel_size=4"]) == 2
    assert ("actor.tensor_parallel_size=4 must divide the model's num_attention_heads (2)"
            in capsys.readouterr().err)
    assert main(["plan", "--memory", "trainer.n_workers=4", "actor.tensor_parallel_size=2",
                 "actor.sequence_parallel_size=2"]) == 2
    assert "actor.sequence_parallel_size=2 must divide" in capsys.readouterr().err
    # rollout tensor parallelism: an engine per tp workers
    assert main(["plan", "trainer.n_workers=3", "data.train_batch_size=24",
                 "actor.mini_batch_size=24", "rollout.backend=vllm",
                 "rollout.vllm.tensor_parallel_size=2"]) == 2
    assert ("rollout.vllm.tensor_parallel_size=2: each engine is sharded over 2 dagrl workers "
            "(vLLM joins their process group), so trainer.n_workers (3) must be a multiple of 2"
            in capsys.readouterr().err)
    assert main(["plan", "trainer.n_workers=2", "rollout.backend=vllm", "trainer.mode=async",
                 "rollout.vllm.tensor_parallel_size=2"]) == 2
    assert ("rollout.vllm.tensor_parallel_size=2 with trainer.mode=async: an async rollout "
            "rank takes each new weight version" in capsys.readouterr().err)


def test_the_builtin_model_with_four_heads_splits_over_tp_and_sp(tmp_path):
    """model.tiny_heads: the built-in model's query heads (half as many KV heads). Its default
    2 split over tp or sp, not both; 4 split over tp 2 x sp 2."""
    from transformers import AutoConfig

    from dagrl.config.loader import ConfigError, load_config
    from dagrl.config.schema import Config
    from dagrl.engines.models import resolve_builtin_model
    from dagrl.runtime.preflight import check_model_parallel

    both = ["trainer.n_workers=4", "actor.tensor_parallel_size=2",
            "actor.sequence_parallel_size=2", "data.train_batch_size=8", "actor.mini_batch_size=8"]
    with pytest.raises(ConfigError, match=r"actor.sequence_parallel_size=2 must divide the "
                                          r"model's num_attention_heads \(2\) / "
                                          r"tensor_parallel_size \(2\) \(builtin:tiny-qwen2\)"):
        check_model_parallel(load_config(Config, None, both))
    check_model_parallel(load_config(Config, None, [*both, "model.tiny_heads=4"]))
    path = resolve_builtin_model("builtin:tiny-qwen2", tmp_path, hidden_size=128, layers=2,
                                 seed=0, heads=4)
    config = AutoConfig.from_pretrained(path)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert path.endswith("tiny-qwen2-h128-l2-a4-s0")   # the default's name keeps no -a2
    with pytest.raises(ConfigError, match=r"tiny_heads \(3\) must be even and divide "
                                          r"tiny_hidden_size \(64\)"):
        load_config(Config, None, ["model.tiny_heads=3"])
