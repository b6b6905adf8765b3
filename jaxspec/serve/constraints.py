"""Compiling constraints in worker processes that a time limit can stop.

A regex or JSON schema can take long to turn into an automaton (a schema with many optional
properties, a regex with large counted repetitions). A thread cannot be stopped, so a server that
gave up on one would keep a core busy compiling it; here each compile runs in one of a few
long-lived processes (spawned, so they share no JAX state with the server), and a compile past its
time limit ends its process, which is replaced at once in the background (so the next request's
limit does not pay for a process start). Results come back pickled and go
into the same cache as every other compile (``jaxspec.structured.compile_constraint``).
"""

from __future__ import annotations

import multiprocessing
import queue
import threading
import time

from jaxspec.structured import Automaton, build_automaton

READY_SECONDS = 120.0  # a worker's start (spawn + imports) gets this long


def _serve(conn, token_bytes, first_bytes, vocab_size: int) -> None:  # in the worker process
    conn.send(("ready", None))
    while True:
        job = conn.recv()
        if job is None:
            return
        try:
            conn.send(("ok", build_automaton(token_bytes, first_bytes, vocab_size, *job)))
        except ValueError as e:
            conn.send(("error", str(e)))
        except Exception as e:  # noqa: BLE001  a pathological pattern (RecursionError, ...): the request's fault
            conn.send(("error", f"the constraint could not be compiled ({type(e).__name__}: {e})"))


class _Worker:
    def __init__(self, context, args):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, *args), daemon=True,
                                       name="jaxspec-constraint-compiler")
        self.process.start()
        child.close()
        if not self.conn.poll(READY_SECONDS) or self.conn.recv()[0] != "ready":
            self.stop()
            raise RuntimeError("a constraint compiler process did not start")

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def stop(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()


class ConstraintCompiler:
    """``processes`` worker processes compiling constraints over one tokenizer's vocabulary.
    ``compile`` blocks its calling thread (call it from a thread pool) and raises ``TimeoutError``
    past its limit (the worker that ran it is ended), ``ValueError`` for a constraint that cannot
    be compiled."""

    def __init__(self, tokenizer, vocab_size: int, processes: int = 2):
        self._context = multiprocessing.get_context("spawn")
        self._args = (tuple(tokenizer.token_bytes), tokenizer.first_token_bytes, vocab_size)
        self._idle: queue.Queue = queue.Queue()
        for _ in range(processes):
            self._idle.put(None)  # a slot: its process starts on first use (or ``start``)
        self._lock = threading.Lock()
        self._workers: set[_Worker] = set()
        self._threads: set[threading.Thread] = set()  # starts under way in the background
        self._closed = False

    def start(self) -> None:
        """Starts every slot's process now (so the first requests' limits count compiling only).
        Every slot goes back, a failed start's empty (``compile`` starts it on use); after ``close``,
        nothing starts."""
        slots = [self._idle.get() for _ in range(self._idle.qsize())]
        try:
            while slots and not self._closed:
                if slots[-1] is None or not slots[-1].alive:
                    slots[-1] = self._spawn()
                self._idle.put(slots.pop())
        finally:
            for w in slots:
                self._idle.put(w)

    def start_soon(self) -> None:
        """``start`` in a background thread, which ``close`` waits for (a start that fails leaves
        its slots empty, and ``compile`` starts them on use)."""
        self._in_background(self._start_quietly, "jaxspec-constraint-start")

    def _start_quietly(self) -> None:
        try:
            self.start()
        except RuntimeError:  # a failed or closed start: the slots came back
            pass

    def _in_background(self, target, name: str) -> None:
        t = threading.Thread(target=target, daemon=True, name=name)
        with self._lock:
            self._threads = {x for x in self._threads if x.is_alive()} | {t}
        t.start()

    def _spawn(self) -> _Worker:
        w = _Worker(self._context, self._args)
        with self._lock:
            if not self._closed:
                self._workers.add(w)
                return w
        w.stop()  # closed while it started: it would outlive the server
        raise RuntimeError("the constraint compiler is closed")

    def _refill(self) -> None:
        """Puts a freshly started worker in a retired one's slot (an empty slot if it fails to start,
        or after ``close``)."""
        try:
            w = self._spawn()
        except Exception:  # noqa: BLE001  whatever stopped the start, the slot comes back
            w = None
        self._idle.put(w)

    def _retire(self, w: _Worker) -> None:
        w.stop()
        with self._lock:
            self._workers.discard(w)

    def compile(self, kind: str, text: str, timeout: float) -> Automaton:
        deadline = time.monotonic() + timeout
        try:
            w = self._idle.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no constraint compiler was free within {timeout:g} s") from None
        retired = False
        try:
            if w is None or not w.alive:
                w = self._spawn()
            w.conn.send((kind, text))
            if not w.conn.poll(max(0.0, deadline - time.monotonic())):
                self._retire(w)
                w, retired = None, True
                raise TimeoutError(f"compiling the constraint took longer than {timeout:g} s")
            status, value = w.conn.recv()
        except TimeoutError:
            raise
        except (EOFError, OSError):  # the process died under it
            if w is not None:
                self._retire(w)
            w, retired = None, True
            raise RuntimeError("the constraint compiler process died") from None
        finally:
            if retired:  # its replacement starts now, not inside the next request's limit
                self._in_background(self._refill, "jaxspec-constraint-refill")
            else:
                self._idle.put(w)  # the worker, or an empty slot (a failed start: the next use tries again)
        if status == "error":
            raise ValueError(value)
        return value

    def pids(self) -> list[int]:
        with self._lock:
            return [w.process.pid for w in self._workers if w.alive]

    def close(self) -> None:
        """Stops every worker; returns once the starts under way in the background have ended too
        (each stops the process it was starting: none outlives the server)."""
        with self._lock:
            self._closed = True  # a start under way stops its process and starts no more
            workers, self._workers = list(self._workers), set()
            threads = list(self._threads)
        for w in workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
            w.stop()
        for t in threads:
            if t is not threading.current_thread():
                t.join(READY_SECONDS + 10)
