"""A rollout engine that records which policy version produced each token, and can pause a
generation to load new weights and continue with them (partial rollout, trainer.mode=async).

Without partial rollout a request runs to its end with the weights it started with, and new
weights are loaded between requests. With it, a request is generated in chunks of
`chunk_tokens`; after each chunk `between_chunks()` may load new weights (the async loop's
weight receiver), and the unfinished responses continue from where they stopped: the prompt and
the tokens so far are the next chunk's prompt (a fresh prefill, under the new weights — the old
weights' KV cache would mix two policies in one forward). A token's log-prob is the one of the
weights that drew it, and `token_versions` says which version that was.

Randomness: the first chunk uses the samples' own seeds, so its tokens are the unchunked
generation's; chunk c > 0 draws with mix_seed(sample_seed, tokens so far), distinct from every
other chunk's draws and the same on any worker (a chunked sample does not reproduce the
unchunked one: the weights changed under it anyway).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from dagrl.data.vision import ImageInputs
from dagrl.rollout.base import GenerationOutput, RolloutEngine
from dagrl.rollout.sampling import SamplingParams, mix_seed


class VersionedRollout:
    """Wraps `engine`; `last_token_versions` [B, R] int64 holds the versions of the last
    `generate` call's tokens (-1 where masked)."""

    def __init__(self, engine: RolloutEngine, *, chunk_tokens: int = 0,
                 between_chunks: Callable[[], object] | None = None) -> None:
        """`chunk_tokens` > 0 with `between_chunks`: partial rollout."""
        self.engine = engine
        self.chunk_tokens = chunk_tokens if between_chunks is not None else 0
        self.between_chunks = between_chunks
        self.last_token_versions: torch.Tensor | None = None
        self.chunks = 0   # generate calls made on the engine, over the engine's life

    @property
    def stop_token_ids(self) -> list[int]:
        return self.engine.stop_token_ids

    @property
    def weights_version(self) -> int:
        return self.engine.weights_version

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       version: int) -> None:
        self.engine.update_weights(named_tensors, version)

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 sample_seed: torch.Tensor, params: SamplingParams, *, max_new_tokens: int,
                 min_new_tokens: int = 0, images: ImageInputs | None = None) -> GenerationOutput:
        """`images`: the rows' images (an image-text model; not with partial rollout, which
        rollout/base.py refuses for one)."""
        if images is not None and self.chunk_tokens:
            raise ValueError("partial rollout does not carry images (rollout/base.py refuses "
                             "rollout.partial for an image-text model)")
        if not self.chunk_tokens or self.chunk_tokens >= max_new_tokens:
            out = self.engine.generate(prompt_ids, prompt_mask, sample_seed, params,
                                       max_new_tokens=max_new_tokens,
                                       min_new_tokens=min_new_tokens,
                                       **({"images": images} if images is not None else {}))
            self.chunks += 1
            self.last_token_versions = torch.where(
                out.response_mask.bool(), self.engine.weights_version, -1).long()
            return GenerationOutput(out.responses, out.response_mask, out.logprobs,
                                    self.last_token_versions)
        return self._generate_in_chunks(prompt_ids, prompt_mask, sample_seed, params,
                                        max_new_tokens, min_new_tokens)

    def _generate_in_chunks(self, prompt_ids, prompt_mask, sample_seed, params,
                            max_new_tokens: int, min_new_tokens: int) -> GenerationOutput:
        b, device = len(prompt_ids), prompt_ids.device
        pad = _pad_id(self.engine)
        responses = torch.full((b, max_new_tokens), pad, dtype=torch.long, device=device)
        mask = torch.zeros(b, max_new_tokens, device=device)
        logprobs = torch.zeros(b, max_new_tokens, device=device)
        versions = torch.full((b, max_new_tokens), -1, dtype=torch.long, device=device)
        active = torch.arange(b, device=device)   # rows still generating; all have `done` tokens
        done = 0
        while len(active) and done < max_new_tokens:
            if done:   # a pause: new weights may come in before the rest is generated
                self.between_chunks()
            width = min(self.chunk_tokens, max_new_tokens - done)
            # The next chunk's prompt: the left-padded prompt, then the tokens so far [A, P+done].
            ids = torch.cat([prompt_ids[active], responses[active, :done]], dim=1)
            ctx_mask = torch.cat([prompt_mask[active],
                                  torch.ones(len(active), done, dtype=prompt_mask.dtype,
                                             device=device)], dim=1)
            seeds = sample_seed[active] if not done else mix_seed(sample_seed[active], done)
            out = self.engine.generate(ids, ctx_mask, seeds, params, max_new_tokens=width,
                                       min_new_tokens=max(0, min(width, min_new_tokens - done)))
            self.chunks += 1
            cols = slice(done, done + width)
            responses[active, cols] = out.responses[:, :width]
            mask[active, cols] = out.response_mask[:, :width]
            logprobs[active, cols] = out.logprobs[:, :width]
            versions[active, cols] = torch.where(out.response_mask[:, :width].bool(),
                                                 self.engine.weights_version, -1).long()
            # A row continues only if it filled the chunk without drawing a stop token.
            full = out.response_mask[:, :width].sum(-1) == width
            stop = torch.tensor(self.stop_token_ids, device=device)
            stopped = torch.isin(out.responses[:, :width], stop).any(-1)
            active = active[full & ~stopped]
            done += width
        self.last_token_versions = versions
        return GenerationOutput(responses, mask, logprobs, versions)


def _pad_id(engine) -> int:
    pad = getattr(engine, "pad_token_id", None)
    return int(pad) if pad is not None else int(engine.stop_token_ids[0])
