"""rollout-train: the published AsyncGRPO + LoRA recipe, driven through the rollout proxy (HTTP)."""
