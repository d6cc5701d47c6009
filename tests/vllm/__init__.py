"""End-to-end tests that run real vLLM (CPU build) in subprocesses: ``make test-vllm``."""
