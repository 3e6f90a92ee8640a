"""What ``/proc/cpuinfo`` says of the first CPU (its first ``vendor_id``, ``model name`` and ``flags`` lines), for
choices that depend on the CPU kind and for the bench's record of it. No torch import: the vLLM bench's summary
reads it too."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def cpu_fields() -> dict[str, str]:
    """``{field: value}`` of the first processor's ``vendor_id``, ``model name`` and ``flags`` (empty where
    ``/proc/cpuinfo`` is unreadable: not Linux)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
                if all(k in fields for k in ("vendor_id", "model name", "flags")):
                    break
    except OSError:
        pass
    return {k: fields[k] for k in ("vendor_id", "model name", "flags") if k in fields}


def cpu_is_intel() -> bool:
    """Whether the CPU is Intel's (``GenuineIntel``)."""
    return cpu_fields().get("vendor_id") == "GenuineIntel"
