"""dagrl: multi-controller RL post-training for language models.

An RL algorithm is a DAG of roles (rollout, reward, log-probs, advantage, update); every worker
runs the same plan on its own shard of the data. See docs/architecture.md.
"""

from typing import Any

from dagrl.roles.registry import register_role

__version__ = "0.1.0"
__all__ = ["RunResult", "register_role", "train", "__version__"]


def __getattr__(name: str) -> Any:
    # On first use, so that `import dagrl` stays light. `dagrl.train` is the module
    # dagrl/train.py, callable as the Python API's function (dagrl/api.py).
    if name == "train":
        import dagrl.train

        return dagrl.train
    if name == "RunResult":
        from dagrl.api import RunResult

        return RunResult
    raise AttributeError(f"module 'dagrl' has no attribute {name!r}")
