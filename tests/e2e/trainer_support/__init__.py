"""Test-only support for the trainer's end-to-end test: a torch-backed fake vLLM replica and process
helpers. The CPU patches TRL needs live in ``scripts/cpu_trainer.py`` (shared with ``make demo``).
Nothing here is imported by ``trainer/``."""
