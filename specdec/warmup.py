"""Compiled decoding by default, without a wait the user sees.

``torch.compile`` makes every specdec method about 1.3x faster on a CPU, but compiling the decode
graphs takes minutes there (on one core of the EPYC, SmolLM2-135M bf16: 218 s with an empty cache,
68 s from inductor's warm on-disk cache). Compile modes:

- ``on``: compile now; the constructor returns when every runner is warm (the old ``--compile``).
- ``auto`` (default): decode eagerly at once while a background thread builds compiled runners over
  the same models and warms them; the decoder switches to them between generations, once ready.
  Inductor's cache lives under ``$SPECDEC_CACHE/inductor`` (unless ``TORCHINDUCTOR_CACHE_DIR`` is set),
  so a later process compiles from it, once per model, dtype and machine.
- ``off``: eager only.

The default comes from ``$SPECDEC_COMPILE`` (``auto`` if unset). The compiled and eager paths give
the same tokens in fp32 (the identity tests run both); in bf16 they may round differently.
"""
from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

MODES = ("auto", "on", "off")


def compile_mode(value: bool | str | None) -> str:
    """``value`` as one of :data:`MODES` (``True``/``False`` are ``on``/``off``; ``None``: ``$SPECDEC_COMPILE``)."""
    if value is None:
        value = os.environ.get("SPECDEC_COMPILE", "auto")
    if isinstance(value, bool):
        return "on" if value else "off"
    if value not in MODES:
        raise ValueError(f"compile must be one of {', '.join(MODES)} (or a bool), got {value!r}")
    return value


def use_persistent_cache(cache: Path) -> None:
    """Point inductor's on-disk cache at ``cache`` unless the user chose one (before any compile)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache))


class BackgroundCompile:
    """Builds and warms compiled runners in a daemon thread.

    ``make()`` returns the runners to warm (it runs in the thread, so their construction is not waited
    for either); :meth:`result` returns them once every ``warm_up`` has finished, else None. A failure
    is reported once as a warning and leaves the caller on its eager runners.
    """

    def __init__(self, make):
        self._make = make
        self._runners = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="specdec-compile", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            runners = self._make()
            for runner in runners:
                runner.warm_up()
            self._runners = runners
        except BaseException as exc:  # noqa: BLE001  (reported to the caller's thread)
            self._error = exc

    @property
    def done(self) -> bool:
        """Compiling has finished (well or not)."""
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until compiling has finished (or ``timeout`` seconds); True when compiled runners are ready."""
        self._thread.join(timeout)
        return self.result() is not None

    def result(self):
        """The warmed runners, or None while compiling (or after a failure, warned about once)."""
        if self._thread.is_alive():
            return None
        if self._error is not None:
            warnings.warn(f"compiling the decode graphs failed; decoding stays eager ({self._error!r})", stacklevel=3)
            self._error, self._runners = None, None
            self._make = None
        return self._runners
