"""Bridges from specdec to serving engines (vLLM).

Each module imports its engine only where that engine calls it, never at import time."""
