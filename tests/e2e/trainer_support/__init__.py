"""Test-only support for the trainer's end-to-end test: a torch-backed fake vLLM replica, the CPU
patches TRL needs, and process helpers. Nothing here is imported by ``trainer/``."""
