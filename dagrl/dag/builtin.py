"""Built-in graphs, one function per algorithm, selected by `algorithm.name`.

A graph function receives the config because a node's presence can depend on it: GRPO only
computes reference log-probs when the KL loss is on.
"""

from __future__ import annotations

from dagrl.config.schema import Config
from dagrl.dag.spec import GraphSpec, NodeSpec
from dagrl.registry import Registry

BUILTIN_GRAPHS: Registry = Registry("built-in graph")


@BUILTIN_GRAPHS.register("grpo")
def grpo_graph(cfg: Config) -> GraphSpec:
    """GRPO (Shao et al. 2024, DeepSeekMath): n samples per prompt, group-normalised rewards as
    advantages, clipped policy loss with a KL-to-reference loss term; no critic."""
    use_ref = cfg.algorithm.kl_loss_coef > 0
    nodes = [
        NodeSpec("rollout", "rollout"),
        NodeSpec("reward", "reward", ("rollout",)),
        NodeSpec("old_logprob", "old_logprob", ("rollout",)),
        *([NodeSpec("ref_logprob", "ref_logprob", ("rollout",))] if use_ref else []),
        NodeSpec("advantage", "advantage", ("reward",)),
        NodeSpec("actor_update", "actor_update",
                 ("advantage", "old_logprob", *(("ref_logprob",) if use_ref else ()))),
    ]
    return GraphSpec("grpo", tuple(nodes))
