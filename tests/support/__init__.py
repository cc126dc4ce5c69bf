"""Shared test helpers (tiny models, oracles)."""
