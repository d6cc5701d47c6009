"""Adapters from the engine to the serving ecosystem.

- :mod:`asyncoffload.integrations.kv_events`: vLLM-compatible KV events over ZMQ
  (``pip install 'asyncoffload[events]'``).
- :mod:`asyncoffload.integrations.prometheus`: Prometheus metrics
  (``pip install 'asyncoffload[prometheus]'``).

Each imports its third-party dependency only when imported itself.
"""
