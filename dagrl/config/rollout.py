"""The `rollout` section: how responses are generated, and the settings of the backends that
take their own (`rollout.vllm`, `rollout.server`; `rollout.multi_turn` in config/multi_turn.py).
Which backend a name means, and what it refuses, is the rollout layer's (dagrl/rollout/)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dagrl.config.loader import require
from dagrl.config.multi_turn import MultiTurnConfig


@dataclass
class VLLMConfig:
    """`rollout.backend=vllm` only (dagrl/rollout/vllm.py)."""
    # Share of the GPU's memory vLLM may take (weights + KV cache); the trainer uses the rest.
    # On the CPU vLLM reads it as the share of the NUMA node's memory, which must be free when
    # the engine starts.
    gpu_memory_utilization: float = 0.5
    # On the CPU: GiB of KV cache.
    cpu_kv_cache_gb: float = 1.0
    # Reuse the KV of shared prompt prefixes (a GRPO group's samples share their prompt); the
    # cache is reset after every weight sync.
    enable_prefix_caching: bool = True
    # Longest sequence vLLM plans for; 0: data.max_prompt_length + rollout.max_new_tokens.
    max_model_len: int = 0
    # vLLM's own tensor parallelism: each engine sharded over this many consecutive workers
    # (a rollout replica, every rank of it holding the replica's prompts); trainer.n_workers
    # must be a multiple of it. 1: an engine per worker.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        require(self.tensor_parallel_size > 0, "tensor_parallel_size must be > 0")
        require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization must be in (0, 1]")
        require(self.cpu_kv_cache_gb > 0, "cpu_kv_cache_gb must be > 0")
        require(self.max_model_len >= 0, "max_model_len must be >= 0 (0: derived)")


@dataclass
class ServerConfig:
    """`rollout.backend=server` only (dagrl/rollout/server.py): OpenAI-compatible servers."""
    # Base URLs, e.g. [http://127.0.0.1:8000]; a request goes to the server holding the
    # context it extends (an episode's earlier turn, its group's prompt), else the least loaded.
    urls: list[str] = field(default_factory=list)
    # The served model name; empty: the first one the server lists at /v1/models.
    model: str = ""
    timeout_s: float = 60.0
    # Retries of a transient failure (connection refused/reset, timeout, HTTP 429/5xx).
    max_retries: int = 3
    # Requests in flight at once (over all servers).
    max_concurrency: int = 16
    # false: after each update the servers generate with the trained weights. The first rank
    # writes them to `weights_dir` and has each server load them through vLLM's
    # `/collective_rpc` (start `vllm serve` with VLLM_SERVER_DEV_MODE=1 and
    # --worker-extension-cls dagrl.rollout.vllm.WeightSyncExtension; dagrl/rollout/server.py).
    # true: the servers keep the weights they started with (evaluation, off-policy training).
    frozen_policy: bool = False
    # Where the trained weights are written for the servers to read (a directory they see at
    # the same path: on one host, memory-backed /dev/shm). Empty: /dev/shm, else the temp dir.
    weights_dir: str = ""

    def __post_init__(self) -> None:
        require(all(u.startswith(("http://", "https://")) for u in self.urls),
               "urls must be http:// or https:// base URLs")
        require(self.timeout_s > 0, "timeout_s must be > 0")
        require(self.max_retries >= 0, "max_retries must be >= 0")
        require(self.max_concurrency > 0, "max_concurrency must be > 0")


@dataclass
class RolloutConfig:
    n: int = 8                      # samples per prompt (the GRPO group size)
    temperature: float = 1.0        # 0 means greedy
    top_k: int = 0                  # 0 disables
    top_p: float = 1.0              # 1 disables
    max_new_tokens: int = 6
    min_new_tokens: int = 0         # EOS is masked out until this many tokens are generated
    # Token ids that end a response besides the tokenizer's EOS (e.g. an end-of-turn token);
    # they are masked out until min_new_tokens, like EOS.
    stop_token_ids: list[int] = field(default_factory=list)
    # Validation: samples per prompt (n > 1 adds pass@n and maj@n) and their temperature.
    val_n: int = 1
    val_temperature: float = 0.0
    # The generation backend (dagrl/rollout/): `native`, dagrl's decoder for Llama / Qwen2
    # models; `hf`, the model's own HF forward (any causal LM); `auto`, native when it supports
    # the model, else hf; `vllm`, vLLM's engine in the worker process (needs the vllm extra).
    # `server`, OpenAI-compatible HTTP servers you run (rollout.server.*). Any name registered
    # in dagrl.rollout.registry.ROLLOUT_BACKENDS: that layer, above this one, checks the name
    # and the backend's own refusals when the config is loaded and when the graph is planned.
    backend: str = "auto"
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    # Agent rollouts: tools, environments, several turns (dagrl/config/multi_turn.py).
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    # trainer.mode=async only (docs/async.md). A batch is trained on at most this many updates
    # after the policy version that generated its oldest token (0: on-policy, the two sides
    # alternate).
    max_staleness: int = 1
    # Partial rollout: generate in chunks of partial_chunk_tokens; between chunks new weights
    # are loaded and the generation continues with them (each token records its version).
    partial: bool = False
    partial_chunk_tokens: int = 16

    def __post_init__(self) -> None:
        require(self.n > 0, "n must be > 0")
        require(bool(self.backend), "backend must name a rollout backend (auto, native, hf, ...)")
        require(self.max_staleness >= 0, "max_staleness must be >= 0 (0: on-policy)")
        require(self.partial_chunk_tokens > 0, "partial_chunk_tokens must be > 0")
        require(self.val_n > 0, "val_n must be > 0")
        require(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be token ids >= 0")
        require(self.val_temperature >= 0, "val_temperature must be >= 0")
        require(self.temperature >= 0, "temperature must be >= 0")
        require(self.top_k >= 0, "top_k must be >= 0 (0 disables it)")
        require(0 < self.top_p <= 1, "top_p must be in (0, 1]")
        require(self.max_new_tokens > 0, "max_new_tokens must be > 0")
        require(0 <= self.min_new_tokens <= self.max_new_tokens,
               "min_new_tokens must be in [0, max_new_tokens]")
        require(not self.multi_turn.enable or self.min_new_tokens == 0,
               "min_new_tokens must be 0 with multi_turn.enable (a turn ends where the policy "
               "stops it)")
