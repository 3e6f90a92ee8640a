"""A draft model that drafts while the target verifies: the interface PEARL drives, and its backends.

A :class:`ConcurrentDraft` drafts a window of tokens per row from a sequence the caller lays out (the
committed tokens, then any unverified drafts), between :meth:`~ConcurrentDraft.submit` and
:meth:`~ConcurrentDraft.result`; the caller runs the target in between. The caller makes every decision:
the draft only drafts, rolls its cache back to the lengths it is told, and reports its own forward count
and time.

Backends:

- :class:`InlineDraft` drafts inside ``submit`` (no overlap). It runs the same code as the worker, so the
  process backend's outputs are checked against it; tests use it for speed.
- :class:`ProcessDraft` drafts in a worker process pinned to a core of its own with one intra-op thread. On a
  CPU this is the backend that overlaps: Python threads share one interpreter lock and torch's intra-op
  thread count is global to a process (``bench/studies/pearl_overlap.py`` measures both). Token ids and the draft's
  proposal distributions travel through shared memory, control through a pipe. The worker starts once per
  backend object and stops with :meth:`ProcessDraft.close`, when the object is collected, when the parent
  exits (it is a daemon), dies (the worker watches its parent's pid) or closes the pipe; a worker that does not
  answer in time is stopped.
- A GPU backend would run the draft on a second CUDA stream: ``submit`` enqueues the window there and
  returns, ``result`` waits on an event. Only the two classes above exist today.
"""
from __future__ import annotations

import copy
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import wait

import torch

from specdec.drafters.base import Budget, DecodeState
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.model import ModelRunner
from specdec.tree import SparseProbs
from specdec.verify import SamplingConfig


WINDOW_TIMEOUT = 600.0  # seconds a window may take before the worker is declared hung


class DraftWorkerError(RuntimeError):
    """The draft worker process died or failed; the generation cannot go on with it."""


@dataclass
class DraftWindow:
    """What one :meth:`ConcurrentDraft.submit` drafted.

    tokens: ``[B, G] int64`` the drafted tokens of each row, -1 past the row's depth; q: ``[B, G, k]``
    the proposals they were drawn from (None when greedy); seconds: the draft's wall time for the window;
    forwards: draft forward passes it ran.
    """

    tokens: torch.Tensor
    q: SparseProbs | None
    seconds: float
    forwards: int


class ConcurrentDraft:
    """The interface: ``begin`` per generation, then ``submit``/``result`` pairs (with ``keep_rows`` between two
    pairs when finished rows leave the batch), ``close`` at the end of use.

    ``submit(lens, depth, keep)`` drafts ``depth[b]`` tokens for row ``b`` from ``seq[b, :lens[b]]`` (the
    :attr:`seq` buffer, which the caller fills first and leaves alone until ``result()``), after rolling the
    draft's cache back to ``keep[b]`` positions (host ints; ``keep[b] < lens[b]`` for every row, drafting or
    not: every row's unseen tokens are fed, at least its last). ``result()`` returns the :class:`DraftWindow`.
    ``remote``: whether the draft's forwards run in another process (a benchmark's hooks cannot count them).
    """

    remote: bool = False

    seq: torch.Tensor  # [B, capacity] int64: the caller's tokens, read by the draft

    def begin(self, batch_size: int, capacity: int, depth: int, sampling: SamplingConfig,
              proposal_topk: int = 64) -> None:
        """A new generation: ``batch_size`` rows of up to ``capacity`` tokens, windows of up to ``depth``,
        drafted greedily or sampled from the ``proposal_topk`` most likely tokens under ``sampling``."""
        raise NotImplementedError

    def submit(self, lens: list[int], depth: list[int], keep: list[int]) -> None:
        raise NotImplementedError

    def result(self) -> DraftWindow:
        raise NotImplementedError

    def keep_rows(self, rows: list[int]) -> None:
        """Finished rows left the batch: keep rows ``rows`` (ascending batch indices) only, in that order, in the
        draft's cache and in :attr:`seq` (no window in flight)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the backend holds (a worker process)."""


class _DraftCore:
    """The drafting itself, shared by every backend: a :class:`DraftModelDrafter` over a cache of its own."""

    def __init__(self, model):
        self.runner = ModelRunner(model)
        self.drafter: DraftModelDrafter | None = None

    def begin(self, batch_size: int, capacity: int, depth: int, sampling: SamplingConfig, proposal_topk: int) -> None:
        self.drafter = DraftModelDrafter(self.runner, sampling, proposal_topk)  # seeded from the sampling config
        self.runner.reset(batch_size, capacity + depth + 1)

    def keep_rows(self, rows: list[int]) -> None:
        self.runner.drop_pending()  # the last window's nodes, if any were left pending
        self.drafter.keep_rows(rows)

    @torch.inference_mode()
    def window(self, seq: torch.Tensor, lens: list[int], depth: list[int], keep: list[int]):
        """``(tokens [B,G], q [B,G,k] or None, forwards)`` on the host for :meth:`ConcurrentDraft.submit`'s
        arguments (``seq`` on the host; the draft may run on another device)."""
        d = self.drafter
        d.rollback(keep)
        calls = d.draft_calls
        dev = self.runner.device
        state = DecodeState(seq.to(dev), torch.tensor(lens, device=dev), list(lens))
        tree = d.propose(state, Budget(list(depth)))
        tokens = torch.where(tree.valid, tree.tokens, -1)[:, 1:].cpu()
        q = None if tree.draft_probs is None else SparseProbs(tree.draft_probs.ids[:, 1:].cpu(),
                                                              tree.draft_probs.probs[:, 1:].float().cpu())
        return tokens, q, d.draft_calls - calls


class InlineDraft(ConcurrentDraft):
    """Drafts in this process, inside :meth:`submit` (no overlap)."""

    def __init__(self, model):
        self.core = _DraftCore(model)
        self._window: DraftWindow | None = None

    def begin(self, batch_size: int, capacity: int, depth: int, sampling: SamplingConfig,
              proposal_topk: int = 64) -> None:
        self.seq = torch.zeros(batch_size, capacity, dtype=torch.int64)
        self._depth = depth
        self.core.begin(batch_size, capacity, depth, sampling, proposal_topk)

    def submit(self, lens: list[int], depth: list[int], keep: list[int]) -> None:
        if max(depth, default=0) > self._depth:
            raise ValueError(f"depth {max(depth)} exceeds the {self._depth} begin() allowed")
        t0 = time.perf_counter()
        tokens, q, forwards = self.core.window(self.seq, lens, depth, keep)
        self._window = DraftWindow(tokens, q, time.perf_counter() - t0, forwards)

    def result(self) -> DraftWindow:
        window, self._window = self._window, None
        if window is None:
            raise RuntimeError("result() without a submit()")
        return window

    def keep_rows(self, rows: list[int]) -> None:
        self.seq = self.seq[rows]
        self.core.keep_rows(rows)


def _exit_with_parent(parent: int) -> None:
    """End this process once ``parent`` is gone (it was killed, or exited without closing the pipe): a daemon
    thread polls the parent pid. (``PR_SET_PDEATHSIG`` would fire when the parent's spawning *thread* ends,
    which kills the worker of a decoder used from a thread pool.)"""
    def watch():
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def _worker_main(conn, model, core: int | None, parent: int) -> None:
    """The worker process: answer the parent's commands until it says close or goes away."""
    _exit_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it closes us
    try:
        if core is not None:
            os.sched_setaffinity(0, {core})
        torch.set_num_threads(1)
        draft = _DraftCore(model)
    except Exception:
        conn.send(("error", -1, traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    bufs = None
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        kind = msg[0]
        if kind == "close":
            return
        seqno = msg[1]
        try:
            if kind == "begin":
                _, _, bufs, batch, capacity, depth, sampling, proposal_topk = msg
                draft.begin(batch, capacity, depth, sampling, proposal_topk)
                conn.send(("ok", seqno))
            elif kind == "draft":  # the batch is the buffers' first len(lens) rows (finished rows left)
                _, _, lens, depth, keep = msg
                b = len(lens)
                seq, out_tokens, out_ids, out_probs = (buf[:b] for buf in bufs)
                t0 = time.perf_counter()
                tokens, q, forwards = draft.window(seq, lens, depth, keep)
                g = tokens.shape[1]
                out_tokens[:, :g] = tokens
                if q is not None:
                    k = min(q.k, out_ids.shape[2])
                    out_ids[:, :g, :k], out_probs[:, :g, :k] = q.ids[..., :k], q.probs[..., :k]
                    out_ids[:, :g, k:], out_probs[:, :g, k:] = -1, 0.0
                conn.send(("window", seqno, g, time.perf_counter() - t0, forwards))
            elif kind == "keep":
                draft.keep_rows(msg[2])
                conn.send(("ok", seqno))
            else:
                raise ValueError(f"unknown command {kind!r}")
        except FloatingPointError as exc:  # bad logits: the caller's documented error, not a worker failure
            conn.send(("error", seqno, f"FloatingPointError: {exc}"))
        except Exception:
            conn.send(("error", seqno, traceback.format_exc()))


def _without_hooks(model):
    """A shallow copy of ``model`` (the same parameters and submodules) without its own hooks: a hook pickled with
    the model (a benchmark's call counter) would drag what it refers to into the worker. Hooks on submodules
    travel (and run in the worker)."""
    clone = copy.copy(model)
    for name, value in vars(model).items():
        if name.endswith("hooks") and isinstance(value, dict):
            setattr(clone, name, type(value)())
    return clone


@contextmanager
def _main_hidden():
    """Start a spawned process without it re-running the caller's script: a spawned child imports the parent's
    ``__main__`` file (which, without an ``if __name__ == "__main__"`` guard, would start decoding again). The
    worker needs only specdec and the model it is sent, so the script is hidden while the child is started."""
    main = sys.modules.get("__main__")
    saved = {k: getattr(main, k) for k in ("__file__", "__spec__") if main is not None and hasattr(main, k)}
    try:
        for k in saved:
            setattr(main, k, None)
        yield
    finally:
        for k, v in saved.items():
            setattr(main, k, v)


def _stop(proc, conn) -> None:
    """Close the worker: ask, then terminate, then kill; always reap it (no zombie)."""
    try:
        conn.send(("close",))
    except (OSError, ValueError):
        pass
    proc.join(5)
    if proc.is_alive():
        proc.terminate()
        proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()
    conn.close()


class ProcessDraft(ConcurrentDraft):
    """Drafts in a worker process pinned to ``core`` (default: the last core this process may use, and this
    process stays off it while a generation runs; None: not pinned) with one intra-op thread.

    ``model`` is sent to the worker once (its weights through shared memory). The worker is spawned (a fresh
    interpreter: forking a process that has run torch's thread pools can deadlock), which takes seconds.
    ``timeout``: seconds to wait for the worker to start.
    """

    remote = True

    def __init__(self, model, core: int | None = -1, timeout: float = 300.0):
        import torch.multiprocessing as tmp  # registers the reductions that send tensors as shared memory

        if mp.current_process().daemon:
            raise DraftWorkerError("a daemonic process (a multiprocessing pool worker) cannot start the draft worker "
                                   "process: use backend=inline there")
        cores = sorted(os.sched_getaffinity(0))
        self.core = cores[-1] if core == -1 and len(cores) > 1 else None if core == -1 else core
        ctx = tmp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker_main, args=(child, _without_hooks(model), self.core, os.getpid()),
                                 daemon=True, name="specdec-draft-worker")
        with _main_hidden():
            self._proc.start()
        child.close()
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._conn)
        self._seqno = 0
        reply = self._receive(timeout, expect="ready")
        self.pid = reply[1]
        self._bufs = None
        self._pending = None

    @property
    def alive(self) -> bool:
        return self._proc.is_alive()

    def _receive(self, timeout: float | None, expect: str, seqno: int | None = None):
        """The next reply of kind ``expect`` (for request ``seqno``): replies to requests an interrupted
        caller abandoned are skipped; the worker's death or error raises :class:`DraftWorkerError`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait([self._conn, self._proc.sentinel], left)
            if not ready:
                self._finalizer()  # a hung worker is stopped: the decoder's next call starts a new one
                raise DraftWorkerError(f"the draft worker (pid {self._proc.pid}) did not answer within {timeout} s; "
                                       "it was stopped")
            if self._conn in ready:
                try:
                    reply = self._conn.recv()
                except (EOFError, OSError):
                    reply = None
                if reply is not None:
                    if reply[0] == "error" and reply[1] in (-1, seqno):
                        if reply[2].startswith("FloatingPointError: "):
                            raise FloatingPointError(reply[2][len("FloatingPointError: "):])
                        raise DraftWorkerError(f"the draft worker failed:\n{reply[2]}")
                    if reply[0] == expect and (seqno is None or reply[1] == seqno):
                        return reply
                    continue
            self._proc.join(1)  # reap it: no zombie
            self._finalizer()
            raise DraftWorkerError(f"the draft worker (pid {self._proc.pid}) died with exit code "
                                   f"{self._proc.exitcode}; start a new one (the decoder does on its next call)")

    def _send(self, *msg) -> int:
        if not self._proc.is_alive():
            self._finalizer()
            raise DraftWorkerError(f"the draft worker (pid {self._proc.pid}) is not running (exit code "
                                   f"{self._proc.exitcode})")
        self._seqno += 1
        try:
            self._conn.send((msg[0], self._seqno) + msg[1:])
        except (OSError, ValueError) as exc:  # it died between the check and the send
            self._finalizer()
            raise DraftWorkerError(f"the draft worker (pid {self._proc.pid}) is not running: {exc}") from None
        return self._seqno

    def begin(self, batch_size: int, capacity: int, depth: int, sampling: SamplingConfig,
              proposal_topk: int = 64) -> None:
        self.greedy = sampling.greedy
        k = 1 if sampling.greedy else proposal_topk
        shape = (batch_size, capacity, depth, k)
        if self._bufs is None or self._bufs[0] != shape:
            bufs = (torch.zeros(batch_size, capacity, dtype=torch.int64).share_memory_(),
                    torch.full((batch_size, depth), -1, dtype=torch.int64).share_memory_(),
                    torch.full((batch_size, depth, k), -1, dtype=torch.int64).share_memory_(),
                    torch.zeros(batch_size, depth, k).share_memory_())
            self._bufs = (shape, bufs)
        self.seq = self._bufs[1][0]
        self._rows = batch_size  # the batch: the buffers' first rows
        # An abandoned window (an interrupted call) finishes first: wait as long as a window may take.
        self._receive(WINDOW_TIMEOUT, "ok", self._send("begin", self._bufs[1], batch_size, capacity, depth,
                                                    sampling, proposal_topk))
        self._pending = None

    def submit(self, lens: list[int], depth: list[int], keep: list[int]) -> None:
        if self._pending is not None:
            raise RuntimeError("submit() while a window is in flight: call result() first (the worker reads seq)")
        if max(depth, default=0) > self._bufs[0][2]:
            raise ValueError(f"depth {max(depth)} exceeds the {self._bufs[0][2]} begin() allowed")
        self._pending = self._send("draft", list(lens), list(depth), list(keep))

    def result(self) -> DraftWindow:
        if self._pending is None:
            raise RuntimeError("result() without a submit()")
        seqno, self._pending = self._pending, None
        _, _, g, seconds, forwards = self._receive(WINDOW_TIMEOUT, "window", seqno)
        _, out_tokens, out_ids, out_probs = (buf[: self._rows] for buf in self._bufs[1])
        tokens = out_tokens[:, :g].clone()
        q = None if self.greedy else SparseProbs(out_ids[:, :g].clone(), out_probs[:, :g].clone())
        return DraftWindow(tokens, q, seconds, forwards)

    def keep_rows(self, rows: list[int]) -> None:
        if self._pending is not None:
            raise RuntimeError("keep_rows() while a window is in flight: call result() first")
        seq = self._bufs[1][0]
        seq[: len(rows)] = seq[rows]  # the shared buffer keeps its size; the batch is its first rows
        self.seq, self._rows = seq[: len(rows)], len(rows)
        self._receive(WINDOW_TIMEOUT, "ok", self._send("keep", list(rows)))

    def close(self) -> None:
        self._finalizer()
