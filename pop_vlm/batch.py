"""Continuous batching: many requests decode together, one batched step per token, while each prefill runs alone.

Each request keeps running its own generation loop (`generate.py`) in its own thread — sampling, stop strings,
log-probabilities, several choices, time limits all stay where they are. What the scheduler changes is who runs
the model: the prefill (and the vision encoder) takes a turn on the device between two decode steps, and each
decode step is handed to the scheduler's thread, which gathers the steps of every running sequence and runs them
as one batched step on a `SlotCache`. A sequence joins the batch at its first decode step and leaves when its
choice ends, so requests enter and leave a running batch freely.

Requests whose decode runs different layers (`static` mode, by its k) decode in their own group; full and POP
requests decode through all layers and share one. The admission limits (`Admission`) bound the requests in
flight, the tokens they may hold and the queue; beyond the queue a request is refused at once.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .families.base import FamilyAdapter, Prompt
from .slots import SlotCache


class QueueFull(RuntimeError):
    """More requests are waiting than the queue holds."""


class WaitedTooLong(RuntimeError):
    """A request waited longer than its timeout for a place in the batch."""


class DeviceTurns:
    """A first-come-first-served lock on the device: a prefill that arrives while a decode step runs goes next,
    before the following step (a plain lock lets the step loop take it again and starve prefills)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._tickets = itertools.count()
        self._serving = 0

    @contextmanager
    def turn(self):
        with self._cond:
            ticket = next(self._tickets)
            while ticket != self._serving:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._serving += 1
                self._cond.notify_all()


class Admission:
    """How many requests may run at once (`max_running`), how many prompt + answer tokens they may hold together
    (`max_tokens`, None: no limit) and how many may wait (`max_queue`, beyond which a request is refused)."""

    def __init__(self, max_running: int = 16, max_queue: int = 64, max_tokens: int | None = None):
        if max_running < 1 or max_queue < 0:
            raise ValueError("max_running must be >= 1 and max_queue >= 0")
        self.max_running, self.max_queue, self.max_tokens = max_running, max_queue, max_tokens
        self._cond = threading.Condition()
        self.running = 0
        self.waiting = 0
        self.tokens = 0

    def _fits(self, tokens: int) -> bool:
        if self.running >= self.max_running:
            return False
        return self.max_tokens is None or self.running == 0 or self.tokens + tokens <= self.max_tokens

    @contextmanager
    def admitted(self, tokens: int = 0, timeout_s: float | None = None):
        """Hold a place for one request; raises `QueueFull` at once, or `WaitedTooLong` after `timeout_s`."""
        with self._cond:
            if not self._fits(tokens):
                if self.waiting >= self.max_queue:
                    raise QueueFull(f"the server is busy ({self.running} running, {self.waiting} waiting); retry shortly")
                self.waiting += 1
                try:
                    if not self._cond.wait_for(lambda: self._fits(tokens), timeout=timeout_s):
                        raise WaitedTooLong(f"no place in the batch within {timeout_s:.0f} s; retry shortly")
                finally:
                    self.waiting -= 1
            self.running += 1
            self.tokens += tokens
        try:
            yield
        finally:
            with self._cond:
                self.running -= 1
                self.tokens -= tokens
                self._cond.notify_all()


@dataclass
class BatchStats:
    """The scheduler's counters."""

    steps: int = 0
    rows_stepped: int = 0
    max_rows_in_step: int = 0
    joined: int = 0
    left: int = 0
    failed_rows: int = 0

    @property
    def mean_rows_per_step(self) -> float:
        return self.rows_stepped / self.steps if self.steps else 0.0


@dataclass
class _Pending:
    token: int
    positions: torch.Tensor
    done: threading.Event = field(default_factory=threading.Event)
    logits: torch.Tensor | None = None
    error: BaseException | None = None


class BatchRow:
    """One sequence in the batch: `step(token, index)` returns its next logits (1, vocab); `close()` leaves the
    batch and returns the sequence's cache."""

    def __init__(self, scheduler: "BatchScheduler", group: tuple[int, ...], slot: int, prompt: Prompt):
        self.scheduler, self.group, self.slot, self.prompt = scheduler, group, slot, prompt
        self.closed = False

    def step(self, token: int, index: int) -> torch.Tensor:
        positions = self.scheduler.adapter.decode_positions(self.prompt, index)
        pending = _Pending(int(token), positions)
        self.scheduler._submit(self, pending)
        if not pending.done.wait(self.scheduler.step_timeout_s):
            raise TimeoutError("the batched decode step did not come back in time")
        if pending.error is not None:
            raise RuntimeError(f"decode step failed: {pending.error}") from pending.error
        return pending.logits

    def close(self):
        if self.closed:
            return None
        self.closed = True
        return self.scheduler._leave(self)


class BatchScheduler:
    """Runs the decode steps of every open `BatchRow` of a model as batched steps, in a thread of its own.

    `turns` is the device's first-come-first-served lock (share one between the schedulers of models on the same
    device); `max_batch_size` the rows of each group; `max_tokens` (None: no limit) the prompt + answer tokens the
    open rows may hold together — a row that does not fit waits until others leave. A step waits for the rows that are still busy elsewhere
    (streaming their last token) at most `gather_fraction` of the previous step's time before it runs without them.
    """

    def __init__(self, adapter: FamilyAdapter, max_batch_size: int = 16, turns: DeviceTurns | None = None,
                 max_tokens: int | None = None, gather_fraction: float = 0.5, step_timeout_s: float = 600.0):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.adapter, self.max_batch_size, self.max_tokens = adapter, max_batch_size, max_tokens
        self._tokens: dict[BatchRow, int] = {}  # each open row's prompt + answer tokens
        self.turns = turns or DeviceTurns()
        self.gather_fraction, self.step_timeout_s = gather_fraction, step_timeout_s
        self.stats = BatchStats()
        self._groups: dict[tuple[int, ...], SlotCache] = {}
        self._open: dict[tuple[int, ...], set[BatchRow]] = {}
        self._pending: dict[BatchRow, _Pending] = {}
        self._order: deque[tuple[int, ...]] = deque()
        self._cond = threading.Condition()
        self._last_step_s = 0.0
        self._thread: threading.Thread | None = None
        self._stopped = False

    # ---- what a request's generation loop calls ----------------------------------------------------------------
    def device_turn(self):
        """Hold the device for work outside the batched steps (a prefill, the vision encoder)."""
        return self.turns.turn()

    def open_row(self, prompt: Prompt, cache, layer_ids, tokens: int = 0) -> BatchRow:
        """Move a prefilled sequence into the batch of the group that decodes through `layer_ids`, once it has a
        free row and its `tokens` (prompt + answer) fit."""
        group = tuple(layer_ids)
        while True:
            with self._cond:
                if self._stopped:
                    raise RuntimeError("the batch scheduler is closed")
                self._cond.wait_for(lambda: self._has_room(group, tokens))
                self._ensure_thread()
            with self.turns.turn(), torch.inference_mode():  # the slot buffers must not change under a running step
                with self._cond:
                    if not self._has_room(group, tokens):  # another request took the room while this one waited
                        continue
                    slot = self._slots(group).join(cache)
                    row = BatchRow(self, group, slot, prompt)
                    self._open.setdefault(group, set()).add(row)
                    self._tokens[row] = tokens
                    self.stats.joined += 1
                    return row

    @property
    def rows(self) -> int:
        """Sequences in the batch now (all groups)."""
        with self._cond:
            return sum(len(rows) for rows in self._open.values())

    def close(self) -> None:
        """Take no new rows; the step thread ends once the open rows have left."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    # ---- inside -------------------------------------------------------------------------------------------------
    def _has_room(self, group, tokens: int) -> bool:
        """A free row in the group, and room for `tokens` more (always, when no row is open)."""
        if self._slots(group).free_slot() is None:
            return False
        held = sum(self._tokens.values())
        return self.max_tokens is None or not self._tokens or held + tokens <= self.max_tokens

    def _slots(self, group) -> SlotCache:
        if group not in self._groups:
            self._groups[group] = SlotCache(self.adapter, self.max_batch_size)
        return self._groups[group]

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="pop-vlm-batch", daemon=True)
            self._thread.start()

    def _submit(self, row: BatchRow, pending: _Pending) -> None:
        with self._cond:
            self._pending[row] = pending
            if row.group not in self._order:
                self._order.append(row.group)
            self._cond.notify_all()

    def _leave(self, row: BatchRow):
        with self.turns.turn(), torch.inference_mode():
            with self._cond:
                self._open[row.group].discard(row)
                self._pending.pop(row, None)
                self._tokens.pop(row, None)
                self.stats.left += 1
                cache = self._groups[row.group].leave(row.slot)
                self._cond.notify_all()  # a slot is free; and a step may now have all its rows
        return cache

    def _ready_group(self):
        """The next group with waiting steps, once all its open rows are waiting or the gathering time is over."""
        while not (self._stopped and not any(self._open.values())):
            if not self._order:
                self._cond.wait()
                continue
            group = self._order[0]
            deadline = time.monotonic() + self.gather_fraction * self._last_step_s
            while True:
                waiting = [r for r in self._open.get(group, ()) if r in self._pending]
                left = deadline - time.monotonic()
                if len(waiting) == len(self._open.get(group, ())) or left <= 0:
                    break
                self._cond.wait(left)
            self._order.popleft()
            taken = {row: self._pending.pop(row) for row in list(self._pending) if row.group == group}
            if taken:
                return group, taken
        return None, None

    def _loop(self) -> None:
        while True:
            with self._cond:
                group, taken = self._ready_group()
                if group is None:
                    for pending in self._pending.values():
                        pending.error = RuntimeError("the batch scheduler stopped")
                        pending.done.set()
                    return
            try:
                self._run_step(group, taken)
            except BaseException as err:  # never leave a row waiting for a step that will not come
                for pending in taken.values():
                    pending.error = pending.error or err
                    pending.done.set()
                raise

    def _run_step(self, group, taken: dict[BatchRow, _Pending]) -> None:
        start = time.perf_counter()
        try:
            with self.turns.turn(), torch.inference_mode():
                logits = self._groups[group].step({r.slot: p.token for r, p in taken.items()},
                                                  {r.slot: p.positions for r, p in taken.items()}, group)
            # each row its own copy: a view would keep the whole batch's logits alive as long as any row keeps its own
            results = {row: (logits[row.slot: row.slot + 1].clone(), None) for row in taken}
        except Exception as err:  # noqa: BLE001 - find the row that fails; the others still get their step
            results = self._rows_alone(group, taken) if len(taken) > 1 else {row: (None, err) for row in taken}
        self._last_step_s = time.perf_counter() - start
        with self._cond:
            self.stats.steps += 1
            self.stats.rows_stepped += len(taken)
            self.stats.max_rows_in_step = max(self.stats.max_rows_in_step, len(taken))
        for row, (row_logits, error) in results.items():
            pending = taken[row]
            pending.logits, pending.error = row_logits, error
            if error is not None:
                with self._cond:
                    self.stats.failed_rows += 1
            pending.done.set()

    def _rows_alone(self, group, taken):
        """After a failed batched step: each row's step alone, so that only the failing rows get the error.
        (A dummy row's write lands past its length, so running a row twice at one position is harmless.)"""
        results = {}
        for row, pending in taken.items():
            try:
                with self.turns.turn(), torch.inference_mode():
                    logits = self._groups[group].step({row.slot: pending.token}, {row.slot: pending.positions}, group)
                results[row] = (logits[row.slot: row.slot + 1].clone(), None)
            except Exception as err:  # noqa: BLE001
                results[row] = (None, err)
        return results
