"""Tiers below the CPU tier: disk (and later remote), reading into and writing out of
the pinned host pool. See docs/tiers.md."""
