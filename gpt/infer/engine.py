"""What the batch engines share: a `Request` (a prompt, its settings and where its pieces go), the waiting queue
and the rows in use (`Engine`), and `BatchWorker`, which runs an engine on a thread.

    worker = BatchWorker(BatchEngine(model, tokenizer, max_rows=32), max_waiting=64).start()
    worker.submit([Request(ids, SampleConfig(max_new_tokens=50, seed=1), emit=queue.put)])   # QueueFull: 429

The engines: `gpt.infer.batching.BatchEngine` (decoder-only models, one token per row a step) and
`gpt.infer.seq2seq_engine.Seq2seqEngine` (encoder-decoder checkpoints, a translation per request).

Footguns
- `emit` is called on the engine's thread: hand the pieces to the caller's thread (the server uses a queue).
- A step that raises fails every request it had taken (in rows, or just off the queue); a fault of one
  request's own is the engine's to answer to that request alone (`Engine._reject`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gpt.errors import UserError
from gpt.infer.constrain import Matchers
from gpt.infer.sampling import SampleConfig
from gpt.infer.stream import Piece
from gpt.model.transformer import GPT


class QueueFull(UserError, RuntimeError):
    """Too many requests waiting already: try again later (the server answers 429)."""


@dataclass(eq=False)  # compared and hashed by identity
class Request:
    """One prompt's decoding: `ids` (the prompt, at least one id), settings, and where pieces go.

    `emit` is called (on the engine's thread) with each `Piece` as it is made, every sample ending
    with one whose `finish` is set; or with an exception if decoding failed. `cancel()` (from any
    thread) makes the engine drop the request at its next step and free its rows.

    Scoring (`gpt.infer.logprobs` says what the numbers are): with `logprobs=N` each piece carries its
    token's log-probability and the N most likely tokens'; with `echo` too, the first piece of each sample
    also carries every prompt token's, read off the prompt's prefill (the one batched forward that
    admits it: a prompt is never scored token by token). `generate=False` only scores: the row is
    prefilled, answered with one piece (no ids, finish "length") and freed in the same step.
    """

    ids: list[int]
    config: SampleConfig
    emit: Callable[[Piece | Exception], None]
    cancelled: bool = False
    adapter: int = 0  # the LoRA adapter its rows decode with (gpt serve --lora; 0: the base)
    logprobs: int | None = None
    echo: bool = False
    generate: bool = True
    matchers: Matchers | None = field(default=None, repr=False)  # with a grammar: its samples' (the engine's)

    def cancel(self) -> None:
        self.cancelled = True


class Engine:
    """What both engines share: the model, the waiting queue and the rows in use."""

    def __init__(self, model: GPT, tokenizer, max_rows: int):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.block_size = model.config.block_size
        self.max_rows = max_rows
        self.rows: list = []  # the batch's rows (BatchEngine: row i of the caches is rows[i])
        self.waiting: deque[Request] = deque()
        self.taken: list[Request] = []  # taken off the queue at this step and not yet in rows or answered
        self.steps = 0
        self._queue_lock = threading.Lock()  # submit (any thread) vs. admit (the engine's thread)

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.waiting)

    def pending(self) -> int:
        """Requests waiting for rows (cancelled ones do not count)."""
        with self._queue_lock:
            return sum(not r.cancelled for r in self.waiting)

    def submit(self, request: Request) -> None:
        """Queue a request; it joins the batch at a step where it has rows (first come, first served)."""
        if request.config.num_samples > self.max_rows:
            raise ValueError(f"{request.config.num_samples} samples do not fit a batch of {self.max_rows} rows")
        with self._queue_lock:
            self.waiting.append(request)

    def in_flight(self) -> list[Request]:
        """The requests a failed step would leave without an answer: those in rows and those taken."""
        return list(dict.fromkeys([row.request for row in self.rows] + self.taken))

    def _admit(self) -> list[Request]:
        """Take the waiting requests that fit the free rows (first come, first served) into `taken`."""
        free = self.max_rows - len(self.rows)
        with self._queue_lock:
            while self.waiting and (self.waiting[0].cancelled or self.waiting[0].config.num_samples <= free):
                request = self.waiting.popleft()
                if not request.cancelled:
                    self.taken.append(request)
                    free -= request.config.num_samples
        return list(self.taken)

    def _reject(self, request: Request, error: Exception) -> None:
        """Answer one request with `error` (a fault of its own, e.g. its seed): the others go on."""
        if request in self.taken:
            self.taken.remove(request)
        request.cancel()
        request.emit(error)


class BatchWorker:
    """Runs an engine on a daemon thread: `submit` from any thread, at most `max_waiting` waiting.

    The thread sleeps while there is nothing to do. An exception inside a step (a bug, or running
    out of memory) is handed to every request the step had taken (in rows, or just taken off the
    queue), and the engine goes on with new ones; a fault of one request's own is the engines' to
    answer to that request alone.
    """

    def __init__(self, engine: Engine, max_waiting: int = 64):
        self.engine = engine
        self.max_waiting = max_waiting
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="gpt-batch", daemon=True)

    def start(self) -> BatchWorker:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()

    def submit(self, requests: list[Request]) -> None:
        """Queue requests together, or none of them: QueueFull when they would pass max_waiting."""
        with self._wake:
            waiting = self.engine.pending()
            if waiting + len(requests) > self.max_waiting:
                raise QueueFull(f"{waiting} requests are waiting already (at most {self.max_waiting}): try again later")
            for request in requests:
                self.engine.submit(request)
            self._wake.notify()

    @property
    def load(self) -> dict:
        with self._wake:
            return {
                "rows": len(self.engine.rows),
                "max_rows": self.engine.max_rows,
                "waiting": self.engine.pending(),
                "max_waiting": self.max_waiting,
            }

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self.engine.busy and not self._stopping:
                    self._wake.wait()
                if self._stopping:
                    return
            try:
                self.engine.step()  # submit only appends to the waiting queue: no lock needed here
            except Exception as e:
                self._fail(e)

    def _fail(self, error: Exception) -> None:
        requests = self.engine.in_flight()
        self.engine.rows.clear()
        self.engine.taken.clear()
        for request in requests:
            request.cancel()
            request.emit(error)
