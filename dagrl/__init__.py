"""dagrl: multi-controller RL post-training for language models.

An RL algorithm is a DAG of roles (rollout, reward, log-probs, advantage, update); every worker
runs the same plan on its own shard of the data. See docs/architecture.md.
"""

from dagrl.roles.registry import register_role

__version__ = "0.1.0"
__all__ = ["register_role", "__version__"]
