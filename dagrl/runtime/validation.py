"""Validation: generate on the test split with the current weights and score with the training
reward manager, every worker on its own share of the rows.

Metrics, per data source (reduced over all workers as exact global means):
    val/<data_source>/score      mean score over all prompts and samples
    val/<data_source>/pass@n     (rollout.val_n > 1) fraction of prompts with at least one
                                 sample scored >= 1 (the built-in scorers give 1 for a correct
                                 answer)
    val/<data_source>/maj@n      (rollout.val_n > 1) the score of the most frequent response
                                 text among a prompt's samples (ties: the first seen)

With logging.val_generations = N > 0, rank 0 keeps its first N samples (prompt, response, ground
truth, score, and a prompt's images as thumbnails) in `samples` after each run, for
RUN_DIR/val_generations.jsonl, which the run report shows.
"""

from __future__ import annotations

import sys
import time
from collections import Counter

import numpy as np
import torch
from tqdm import tqdm

from dagrl.config.schema import Config
from dagrl.data.dataset import PromptLoader
from dagrl.data.images import thumbnail_png
from dagrl.data.parquet import ParquetPrompts
from dagrl.data.vision import ImageEncoder, row_images
from dagrl.engines.bundle import Engines
from dagrl.observe.metrics import StepMetrics
from dagrl.roles.generate import agent_rows, image_argument
from dagrl.roles.score import decode_responses
from dagrl.rollout.sampling import SamplingParams, mix_seed

# The "step" part of validation's sampling keys. Training steps start at 1, so validation
# draws never coincide with a training step's; they are the same at every validation, so
# scores at different steps differ by the weights alone (common random numbers).
VAL_SEED_STEP = 0


class Validator:
    """Rows r, r + W, r + 2W, ... of `data.val_files` belong to rank r. Under rollout tensor
    parallelism (an engine over `ranks_per_engine` consecutive ranks) they belong to replica r,
    whose ranks all generate them together and whose first rank counts them."""

    def __init__(self, cfg: Config, source: ParquetPrompts, engines: Engines, rank: int,
                 world_size: int, device: torch.device, *, ranks_per_engine: int = 1) -> None:
        if engines.rollout is None or engines.reward_manager is None:
            raise ValueError("validation needs the rollout engine and the reward manager")
        d = cfg.data
        shard, shards = rank // ranks_per_engine, world_size // ranks_per_engine
        # Only its tokenization is used (`batch_of_rows`); the batch settings do not matter.
        self.loader = PromptLoader(source, engines.tokenizer, batch_size=shards, rank=shard,
                                   world_size=shards, shuffle=False, tail="pad",
                                   max_prompt_length=d.max_prompt_length,
                                   truncation=d.truncation,
                                   images=ImageEncoder.of_model(cfg.model.path,
                                                                engines.tokenizer))
        self.rows = np.arange(len(source))[shard::shards]
        self.counts = rank % ranks_per_engine == 0
        self.cfg, self.engines, self.device = cfg, engines, device
        self.keep = cfg.logging.val_generations if rank == 0 else 0
        # Rank 0's share on a bar of its own: a validation of a real model takes minutes, and the
        # training bar stands still meanwhile.
        self.shows_bar = rank == 0 and cfg.logging.progress_bar
        self.samples: list[dict] = []     # the last run's first `keep` samples

    def run(self) -> StepMetrics:
        """This rank's validation statistics (reduce them over all ranks)."""
        n = self.cfg.rollout.val_n
        metrics = StepMetrics()
        self.samples = []
        start = time.perf_counter()
        chunk = self.cfg.data.val_batch_size
        bar = tqdm(total=len(self.rows), desc="validate", unit="prompt", leave=False,
                   dynamic_ncols=True, file=sys.stderr) if self.shows_bar else None
        for i in range(0, len(self.rows), chunk):
            self._score_rows(self.rows[i:i + chunk], n, metrics)
            if bar is not None:
                bar.update(len(self.rows[i:i + chunk]))
        if bar is not None:
            bar.close()
        metrics.add_max("timing/validation_s", time.perf_counter() - start)
        metrics.add_sum("val/samples", len(self.rows) * n)
        # A replica's other ranks computed the same numbers: they count once.
        return metrics if self.counts else StepMetrics()

    def _score_rows(self, rows: np.ndarray, n: int, metrics: StepMetrics) -> None:
        r = self.cfg.rollout
        batch = self.loader.batch_of_rows(rows).repeat_interleave(n).to(self.device)
        sample_index = torch.arange(n).repeat(len(rows))
        seeds = mix_seed(self.cfg.trainer.seed, VAL_SEED_STEP, batch["row_index"].cpu(),
                         sample_index)
        params = SamplingParams(r.val_temperature, r.top_k, r.top_p)
        agent = self.engines.agent
        env_scores = None
        if agent is not None:   # multi-turn: the final answers, or the environment's rewards
            out = agent.generate(agent_rows(batch), seeds.to(self.device), params, self.device)
            texts = decode_responses(self.engines.tokenizer, out.responses, out.attention_mask)
            if agent.env_factory is not None:
                env_scores = out.turn_scores.sum(-1).tolist()
            metrics.add_mean("val/multi_turn/turns_mean", float(out.turns.sum()), len(texts))
            metrics.add_mean("val/tools/calls_mean", float(out.tool_calls.sum()), len(texts))
        else:
            out = self.engines.rollout.generate(
                batch["prompt_ids"], batch["prompt_mask"], seeds.to(self.device), params,
                max_new_tokens=r.max_new_tokens, min_new_tokens=r.min_new_tokens,
                **image_argument(batch))
            texts = decode_responses(self.engines.tokenizer, out.responses, out.response_mask)
        if env_scores is None:
            result = self.engines.reward_manager.score(
                texts, batch["data_source"], batch["ground_truth"], batch["extra_info"],
                sample_ids=[f"val/{uid}/{i % n}" for i, uid in enumerate(batch["uid"])])
            metrics.add_sum("val/reward_errors", result.n_errors + result.n_timeouts)
        scores = torch.tensor(result.scores if env_scores is None else env_scores,
                              dtype=torch.float64).view(len(rows), n)
        self._keep_samples(batch, texts, scores.flatten().tolist())
        sources = batch["data_source"][::n]
        for p, source in enumerate(sources):
            prefix = f"val/{source}"
            metrics.add_mean(f"{prefix}/score", float(scores[p].sum()), n)
            if n > 1:
                metrics.add_mean(f"{prefix}/pass@{n}", float((scores[p] >= 1.0).any()), 1)
                answers = [t.strip() for t in texts[p * n:(p + 1) * n]]
                majority = Counter(answers).most_common(1)[0][0]
                metrics.add_mean(f"{prefix}/maj@{n}", float(scores[p, answers.index(majority)]), 1)

    def _keep_samples(self, batch, texts: list[str], scores: list[float]) -> None:
        """The first `keep` samples of this run, as text (for logging.val_generations)."""
        take = min(self.keep - len(self.samples), len(texts))
        if take <= 0:
            return
        prompts = decode_responses(self.engines.tokenizer, batch["prompt_ids"][:take],
                                   batch["prompt_mask"][:take])
        images = row_images(batch)
        for i in range(take):
            sample = {"data_source": batch["data_source"][i], "prompt": prompts[i],
                      "response": texts[i], "ground_truth": batch["ground_truth"][i],
                      "score": scores[i]}
            if images[i] is not None:   # the picture beside its answer (thumbnails, base64 PNG)
                sample["images"] = [thumbnail_png(p) for p in images[i].pictures]
            self.samples.append(sample)
