"""Compiled decoding by default, without a wait the user sees.

``torch.compile`` makes every specdec method about 1.3x faster on a CPU, but compiling the decode
graphs takes minutes there (on one core of the EPYC, SmolLM2-135M bf16: 218 s with an empty cache,
68 s from inductor's warm on-disk cache, with inductor's Python wrapper; its C++ wrapper, the CPU default since,
about doubles the compile, see :func:`specdec.compile_passes.compile_options`). Compile modes:

- ``on``: compile now; the constructor returns when every runner is warm (the old ``--compile``).
- ``auto`` (default): decode eagerly at once while a background thread builds compiled runners over
  the same models and warms them; the decoder switches to them between generations, once ready.
  Inductor's cache lives under ``$SPECDEC_CACHE/inductor`` (unless ``TORCHINDUCTOR_CACHE_DIR`` is set),
  so a later process compiles from it, once per model, dtype and machine.
- ``off``: eager only.
- ``saved``: the graphs an earlier process compiled and saved (:mod:`specdec.precompile`), loaded in seconds;
  forwards they do not cover run eagerly, and nothing compiles (``specdec generate``'s default).

The default comes from ``$SPECDEC_COMPILE`` (``auto`` if unset). The compiled and eager paths give
the same tokens in fp32 (the identity tests run both); in bf16 they may round differently.
"""
from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

from specdec import settings

MODES = ("auto", "on", "off", "saved")


def compile_mode(value: bool | str | None) -> str:
    """``value`` as one of :data:`MODES` (``True``/``False`` are ``on``/``off``; ``None``: ``$SPECDEC_COMPILE``)."""
    if value is None:
        value = settings.get("SPECDEC_COMPILE", "auto")
    if isinstance(value, bool):
        return "on" if value else "off"
    if value not in MODES:
        raise ValueError(f"compile must be one of {', '.join(MODES)} (or a bool), got {value!r}")
    return value


def use_persistent_cache(cache: Path) -> None:
    """Point inductor's on-disk cache at ``cache`` unless the user chose one (before any compile)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache))


def _warm_up(runner) -> None:
    runner.warm_up()


class BackgroundCompile:
    """Builds and warms compiled runners in a daemon thread.

    ``make()`` returns the runners to warm (it runs in the thread, so their construction is not waited
    for either); ``warm_up(runner)`` warms one (default: ``runner.warm_up()``). :meth:`result` returns
    them once every warm-up has finished, else None. A runner whose warm-up fails is reported as a
    warning that names its model and the error, and runs eagerly (``runner.use_eager()``) while the
    others stay compiled; a failure of ``make()`` is reported likewise and leaves the caller on its eager
    runners (None). Each failure is reported once, in the caller's thread.
    """

    def __init__(self, make, warm_up=_warm_up):
        self._make, self._warm = make, warm_up
        self._runners = None
        self._error: BaseException | None = None
        self._failed: list[tuple[object, BaseException]] = []
        self._thread = threading.Thread(target=self._run, name="specdec-compile", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            runners = self._make()
            for runner in runners:
                try:
                    self._warm(runner)
                except Exception as exc:  # noqa: BLE001  (reported to the caller's thread; the rest compile on)
                    runner.use_eager()
                    self._failed.append((runner, exc))
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
        """The warmed runners (those whose compile failed run eagerly), or None while compiling or after
        ``make()`` failed. Failures are warned about once."""
        if self._thread.is_alive():
            return None
        for runner, exc in self._failed:
            from specdec.model import model_label

            warnings.warn(f"{exc}; {model_label(runner.model)} decodes eagerly", RuntimeWarning, stacklevel=3)
        self._failed = []
        if self._error is not None:
            warnings.warn(f"compiling the decode graphs failed; decoding stays eager ({self._error!r})",
                          RuntimeWarning, stacklevel=3)
            self._error, self._runners = None, None
            self._make = None
        return self._runners
