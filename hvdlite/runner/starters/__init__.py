"""Starters: how a job's workers are started (see :mod:`.base` for the interface)."""
