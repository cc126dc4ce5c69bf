"""The error a worker stops with at startup when the user must change something; its text names the fix."""

from __future__ import annotations


class StartupError(RuntimeError):
    """Startup cannot go on; str(error) says what to change (printed without a traceback)."""
