"""The serving engine's thread: the continuous-batching `Server` stepped on a thread of its own,
fed by a queue of commands (submit, cancel, stop) that it applies between two decode steps, so that
requests join and leave the running batch as in `serving.py` while HTTP handlers wait on their own
event loop (inference/http_server.py).

    engine = Engine(Server(model, slots=8, max_len=512), max_queue=64); engine.start()
    engine.submit(Request("a", prompt_ids), sink)   # sink("token", (id, logprob, top)) ..., then sink("done", Result)
    engine.cancel("a"); engine.stop()
"""

from __future__ import annotations

import queue
import threading
import traceback
from collections.abc import Callable, Hashable
from typing import Any

from meshwork.engine.serving import Request, Result, Server

# ("token", (id, log p, [(alternative id, log p), ...])) ... then ("done", Result); called on the engine thread.
# The alternatives are the request's params.logprobs most likely tokens ([] when it asked for none).
Sink = Callable[[str, Any], None]


class QueueFull(Exception):
    pass


class Engine:
    """Runs `server` on a thread of its own: `submit` and `cancel` from any thread, `start`/`stop`."""

    def __init__(self, server: Server, *, max_queue: int = 64):
        self.server, self.max_queue = server, max_queue
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[Hashable, Sink] = {}
        self._lock = threading.Lock()
        self._queued: set[Hashable] = set()  # submitted, no token yet (what max_queue bounds)
        self._thread: threading.Thread | None = None
        self.cancelled = self.completed = 0
        self.failure: str | None = None
        server.on_events = self._deliver  # a prompt's first token goes out as its prefill ends

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():  # two threads stepping one Server would corrupt it
            raise RuntimeError("the engine is already running (create_app's lifespan starts it)")
        self._thread = threading.Thread(target=self._loop, name="meshwork-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancels whatever is left and joins the thread."""
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    def submit(self, request: Request, sink: Sink) -> None:
        """Queues `request`; its tokens and then its Result go to `sink`. QueueFull past max_queue."""
        with self._lock:
            if len(self._queued) >= self.max_queue:
                raise QueueFull(
                    f"{len(self._queued)} requests are waiting, the limit (--max-queue) is "
                    f"{self.max_queue}; retry later"
                )
            self._queued.add(request.id)
        self._commands.put(("submit", request, sink))

    def cancel(self, rid: Hashable) -> None:
        self._commands.put(("cancel", rid))

    def stats(self) -> dict:
        """The server's pool (`Server.stats`) and this engine's queue and request counts."""
        return {
            **self.server.stats(),
            "queued": len(self._queued),
            "completed": self.completed,
            "cancelled": self.cancelled,
        }

    # -- the thread -------------------------------------------------------------

    def _loop(self) -> None:
        s = self.server
        try:
            while True:
                try:
                    commands = [self._commands.get(block=not s.busy)]
                except queue.Empty:
                    commands = []
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                for command in commands:
                    if command[0] == "stop":  # what is left is cancelled, and its handler told so
                        for rid, sink in list(self._sinks.items()):
                            self._cancel(rid)
                            sink("done", Result(rid, [], "error", "the server is shutting down"))
                        return
                    if command[0] == "submit":
                        _, request, sink = command
                        self._sinks[request.id] = sink
                        s.submit(request)
                        self._finish_if_done(request.id)
                    else:
                        self._cancel(command[1])
                if s.busy:
                    self._deliver(s.step(), s.last_scores)
        except Exception as e:  # the engine is broken: every open request hears why, /health says so
            self.failure = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            for rid, sink in list(self._sinks.items()):
                sink("done", Result(rid, [], "error", f"the engine failed: {self.failure}"))
            self._sinks.clear()

    def _deliver(self, events: list, scores: list) -> None:
        """Sends (request id, token) events with their (log-probability, alternatives) to their sinks. A
        step may give a request several tokens (decode steps per dispatch), the last of which finished
        it: all of them go first, then the results."""
        for (rid, token), (logprob, top) in zip(events, scores, strict=True):
            sink = self._sinks.get(rid)
            if sink is not None:
                self._dequeue(rid)
                sink("token", (token, logprob, top))
        for rid in dict.fromkeys(rid for rid, _ in events):
            if rid in self._sinks:
                self._finish_if_done(rid)

    def _dequeue(self, rid: Hashable) -> None:
        with self._lock:
            self._queued.discard(rid)

    def _finish_if_done(self, rid: Hashable) -> None:
        result = self.server.take_result(rid)
        if result is not None:
            self._dequeue(rid)
            self.completed += 1
            self._sinks.pop(rid)("done", result)

    def _cancel(self, rid: Hashable) -> None:
        sink = self._sinks.pop(rid, None)
        self._dequeue(rid)
        # Released, not cancelled: the client is gone, so no "cancelled" Result is kept for it.
        if self.server.release(rid) is not None and sink is not None:
            self.cancelled += 1
