"""rollout-proxy: N vLLM replicas behind one server for TRL's AsyncGRPOTrainer."""

__version__ = "0.1.0"
