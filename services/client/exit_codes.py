"""Exit statuses the `meshserve` command shares across its verbs."""

from __future__ import annotations

# Stopped by Ctrl-C before finishing: 128 + SIGINT, what a shell reports for a command it interrupted.
INTERRUPTED = 130
