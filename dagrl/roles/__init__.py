"""The roles a graph node can run (rollout, reward, log-probs, advantage, update, ...) and
the registry user roles join (`dagrl.register_role`, docs/extending.md)."""
