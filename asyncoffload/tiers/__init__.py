"""Tiers below the CPU tier: disk and remote (Redis / Valkey), reading into and writing out
of the pinned host pool. Their settings: :mod:`asyncoffload.tiers.settings` (what they
share), :mod:`asyncoffload.tiers.specs` (a list of them). See docs/tiers.md."""
