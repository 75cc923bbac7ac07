"""`rollout.backend=server`: generation by OpenAI-compatible HTTP servers the user runs (vLLM's
`vllm serve`, SGLang), through their `/v1/completions` endpoint with token-id prompts.

- Requests: one per sample (its `sample_seed` as the request seed), at most
  `rollout.server.max_concurrency` in flight, routed over `rollout.server.urls` by
  `router.Router`: a context that extends one already sent (a multi-turn episode's next turn,
  a GRPO group's next sample) goes to that server, whose prefix cache holds it; any other to
  the server with the fewest requests in flight.
  A transient failure (connection refused or reset, a timeout, HTTP 429/5xx) is retried up to
  `max_retries` times with exponential backoff; anything else, or the last failure, is an
  error naming the URL.
- Token ids come back through `return_token_ids` (vLLM; SGLang's OpenAI server accepts the
  same field); log-probs are the server's (start `vllm serve` with
  `--logprobs-mode processed_logprobs` for log softmax(z / T)).
- Weights (`rollout.server.frozen_policy=false`): after each update the first rank writes the
  gathered weights, by checkpoint name, to one safetensors file in `rollout.server.weights_dir`
  (on one host memory-backed /dev/shm), and has every server load it through vLLM's
  `/collective_rpc` into dagrl's worker extension (`dagrl_load_weights_file`, the in-process
  engine's update: vllm.py), then reset its prefix cache; the file is removed and every rank
  waits (a barrier) until the servers hold the new version. The servers must be started with
  `VLLM_SERVER_DEV_MODE=1` (the RPC endpoint) and `--worker-extension-cls
  dagrl.rollout.vllm.WeightSyncExtension`, and read `weights_dir` at the same path (a server on
  another machine: a shared file system). On GPUs vLLM's NCCL weight transfer
  (`/init_weight_transfer_engine`, `/update_weights`) would stream the buckets instead of a
  file; it is not driven yet. `frozen_policy=true`: the servers keep their weights (evaluation,
  off-policy training); `update_weights` still consumes the gathered weights (every rank takes
  part in the all-gathers) and keeps `weights_version` at 0.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from dagrl.config.loader import ConfigError
from dagrl.config.model_rewards import JudgeConfig
from dagrl.config.schema import Config, ServerConfig
from dagrl.device import HOST
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
from dagrl.rollout.router import Router
from dagrl.rollout.sampling import SamplingParams

TRANSIENT_HTTP = {429, 500, 502, 503, 504}


class ServerError(RuntimeError):
    """A rollout server failed or could not be reached; the message names the URL."""


@dataclass(frozen=True)
class ServerSettings:
    urls: tuple[str, ...]
    model: str
    timeout_s: float
    max_retries: int
    max_concurrency: int
    frozen_policy: bool = True
    weights_dir: str = ""
    # Who pushes the weights: the first rank, the others waiting (False: every rank of a sync
    # run takes each version at once), or the rank that takes them, alone (True: the one
    # rollout rank of an async run, which takes each version at its own time).
    push_alone: bool = False

    @classmethod
    def from_config(cls, cfg: Config) -> ServerSettings:
        s = cfg.rollout.server
        return cls(tuple(u.rstrip("/") for u in s.urls), s.model, s.timeout_s, s.max_retries,
                   s.max_concurrency, s.frozen_policy, s.weights_dir, push_alone=cfg.is_async)


def _post(url: str, body: dict, timeout_s: float, max_retries: int) -> dict:
    """POST JSON, retrying transient failures with backoff 0.5, 1, 2, ... s."""
    data = json.dumps(body).encode()
    for attempt in range(max_retries + 1):
        request = urllib.request.Request(url, data=data,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:300]
            if err.code not in TRANSIENT_HTTP or attempt == max_retries:
                raise ServerError(f"rollout server {url}: HTTP {err.code}: {detail}") from err
        except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
            if attempt == max_retries:
                raise ServerError(f"rollout server {url} unreachable after {attempt + 1} "
                                  f"attempt(s) ({getattr(err, 'reason', err)}); check "
                                  "rollout.server.urls") from err
        time.sleep(0.5 * 2 ** attempt)
    raise AssertionError("unreachable")


@ROLLOUT_BACKENDS.register("server")
class ServerRollout(RolloutBackend):
    """The server backend (see the module docstring)."""

    # The server's kernels (and its frozen weights) make the log-probs: the trainer
    # recomputes pi_old.
    trainer_numerics = False
    # The weights and KV cache live in the server processes, outside this worker.
    owns_memory = True

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        super().check_config(cfg)
        server = cfg.rollout.server
        if not server.urls:
            raise ConfigError("rollout.backend=server needs rollout.server.urls")
        if cfg.is_async and server.frozen_policy:
            # Async rollout ranks generate with every new policy version the trainer sends.
            raise ConfigError("trainer.mode=async with rollout.server.frozen_policy=true: the "
                              "servers would never take the versions the trainer sends; set "
                              "frozen_policy=false, or trainer.mode=sync")

    @classmethod
    def from_config(cls, cfg: Config, build: RolloutBuild) -> RolloutEngine:
        return cls(ServerSettings.from_config(cfg), eos_token_id=build.eos_token_id,
                   pad_token_id=build.pad_token_id, stop_token_ids=build.stop_token_ids)

    @classmethod
    def for_judge(cls, judge: JudgeConfig, load_model: Callable[[], torch.nn.Module], *,
                  eos_token_id: int, pad_token_id: int) -> RolloutEngine:
        """Servers serving the judge model (judge.server_urls): nothing loads here. A judge is
        frozen, so a server (which takes no weights from dagrl) fits it as it is."""
        s = ServerConfig()   # judge.server_* names the servers; the rest keeps the defaults
        settings = ServerSettings(tuple(u.rstrip("/") for u in judge.server_urls),
                                  judge.server_model, s.timeout_s, s.max_retries,
                                  s.max_concurrency)
        return cls(settings, eos_token_id=eos_token_id, pad_token_id=pad_token_id)

    def __init__(self, settings: ServerSettings, *, eos_token_id: int, pad_token_id: int,
                 stop_token_ids: Sequence[int] = ()) -> None:
        self.settings = settings
        # The servers' weights are every rank's: a version one rank loads is the others' too.
        self.serves_every_rank = not settings.frozen_policy
        self.pad_token_id = pad_token_id
        self.stop_token_ids = stop_tokens(eos_token_id, stop_token_ids)
        self.weights_version = 0
        self.served_model = settings.model or self._served_model(settings.urls[0])
        self._pool = ThreadPoolExecutor(max_workers=settings.max_concurrency)
        self.router = Router(settings.urls)

    def _served_model(self, url: str) -> str:
        """The first model the server lists (its `--served-model-name`)."""
        try:
            with urllib.request.urlopen(f"{url}/v1/models",
                                        timeout=self.settings.timeout_s) as response:
                return json.loads(response.read())["data"][0]["id"]
        except (urllib.error.URLError, TimeoutError, ConnectionError, KeyError,
                IndexError, ValueError) as err:
            raise ServerError(f"rollout server {url}: cannot list its models at /v1/models "
                              f"({getattr(err, 'reason', err)}); check rollout.server.urls or "
                              "set rollout.server.model") from err

    def _request(self, url: str, prompt: list[int], seed: int, params: SamplingParams,
                 max_new_tokens: int, min_new_tokens: int) -> tuple[list[int], list[float]]:
        body = {"model": self.served_model, "prompt": prompt, "max_tokens": max_new_tokens,
                "min_tokens": min_new_tokens, "temperature": params.temperature,
                "top_p": params.top_p, "top_k": params.top_k or -1, "seed": seed,
                "stop_token_ids": self.stop_token_ids, "logprobs": 0,
                "return_token_ids": True, "skip_special_tokens": False}
        choice = _post(f"{url}/v1/completions", body, self.settings.timeout_s,
                       self.settings.max_retries)["choices"][0]
        ids = list(choice.get("token_ids") or [])
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
        if len(logprobs) != len(ids):
            raise ServerError(f"rollout server {url}: {len(ids)} token ids but {len(logprobs)} "
                              "log-probs in the reply (does it support return_token_ids?)")
        return ids, [float(x) for x in logprobs]

    def _routed(self, prompt: list[int], *args) -> tuple[list[int], list[float]]:
        with self.router.route(prompt) as url:
            return self._request(url, prompt, *args)

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 sample_seed: torch.Tensor, params: SamplingParams, *, max_new_tokens: int,
                 min_new_tokens: int = 0) -> GenerationOutput:
        """One request per row: prompts [B, P] left-padded."""
        futures = [self._pool.submit(self._routed, prompt, int(seed), params,
                                     max_new_tokens, min_new_tokens)
                   for prompt, seed in zip(unpadded_prompts(prompt_ids, prompt_mask),
                                           sample_seed.cpu().tolist(), strict=True)]
        results = [future.result() for future in futures]   # [(token ids, log-probs)] per row
        return padded_output([ids for ids, _ in results], [lps for _, lps in results],
                             max_new_tokens, self.pad_token_id, prompt_ids.device)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       version: int) -> None:
        """The servers load `named_tensors` (module docstring); a frozen policy only takes part
        in the gather and keeps the servers' weights (version 0)."""
        if self.settings.frozen_policy:
            for _ in named_tensors:
                pass
            return
        # A gathered tensor lives only until its consumer has taken it: copied as it comes.
        weights = {name: t.detach().to(HOST, copy=True).contiguous()
                   for name, t in named_tensors}
        distributed = dist.is_available() and dist.is_initialized() and \
            not self.settings.push_alone
        if not distributed or dist.get_rank() == 0:
            self._push(weights, version)
        if distributed:   # no rank generates before every server holds the new version
            dist.barrier()
        self.router.forget()   # the servers' prefix caches were reset
        self.weights_version = version

    def _push(self, weights: dict[str, torch.Tensor], version: int) -> None:
        from safetensors.torch import save_file

        folder = Path(self.settings.weights_dir or
                      ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()))
        path = folder / f"dagrl-weights-{os.getpid()}-v{version}.safetensors"
        partial = path.with_name(path.name + ".partial")
        try:
            save_file(weights, str(partial))
            partial.rename(path)   # a server never reads a half-written file
            for url in self.settings.urls:
                try:
                    _post(f"{url}/collective_rpc", {"method": "dagrl_load_weights_file",
                                                    "args": [str(path)]},
                          self.settings.timeout_s, self.settings.max_retries)
                except ServerError as err:
                    raise ServerError(
                        f"{err}; to take trained weights a server must be started with "
                        "VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls "
                        "dagrl.rollout.vllm.WeightSyncExtension, and read "
                        f"{folder} (rollout.server.weights_dir), or set "
                        "rollout.server.frozen_policy=true") from None
                # Cached prefixes hold keys and values computed with the old weights.
                if not _post(f"{url}/reset_prefix_cache", {}, self.settings.timeout_s,
                             self.settings.max_retries).get("success"):
                    raise ServerError(f"rollout server {url}: its prefix cache could not be "
                                      "reset after a weight update (requests still running)")
        finally:
            partial.unlink(missing_ok=True)
            path.unlink(missing_ok=True)
