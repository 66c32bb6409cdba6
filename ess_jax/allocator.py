"""Host-side page bookkeeping: page pools with free lists, and FIFO admission of requests into batch rows.

Plain Python / NumPy, never traced. The engine ships what this module decides to the device as int32
tables (``Admission.page_table``) once per step.

Pages. The KV pools are cut into ``num_pages`` pages of ``page_size`` tokens. Page 0 is the *null
page*: never handed out, it absorbs the writes of masked / padding tokens and pads page tables, so a
device-side scatter never needs a bounds check. Pages ``1 .. num_pages - 1`` are allocatable.

Data shards. On a mesh of ``D`` data shards every shard has its own pool (``PageAllocator``, its own null
page, page ids local to the shard: the devices of shard ``d`` hold its pages and nothing else) and its own
``max_batch / D`` batch rows: rows ``d * R .. (d + 1) * R - 1`` read only shard ``d``'s pages.

Admission. A request reserves ``pages_for(prompt_len + max_new_tokens)`` pages of one shard when it is
admitted, so a running request never runs out mid-decode, and holds one batch row of that shard
until it finishes. Waiting requests are admitted in strict FIFO order, each to the least-loaded shard that
has a free row and its pages (the most free pages; then the fewest rows in use; then the lowest shard).
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Hashable, NamedTuple

import numpy as np

NULL_PAGE = 0


class OutOfPages(RuntimeError):
    """``PageAllocator.allocate`` was asked for more pages than are free."""


class PageAllocator:
    """A pool of ``num_pages`` pages of ``page_size`` tokens; page 0 is the reserved null page.

    Free pages live on a LIFO stack, so pages freed last are reused first and page tables of
    long-running engines are fragmented (not contiguous), as the paged kernels must expect.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"{num_pages=} must be >= 2 (page 0 is the reserved null page)")
        if page_size < 1:
            raise ValueError(f"{page_size=} must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: list[int] = list(range(num_pages - 1, NULL_PAGE, -1))  # stack: pops 1, 2, 3, ... first
        self._allocated = np.zeros(num_pages, bool)  # bool[num_pages]

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Allocatable pages: all but the null page."""
        return self.num_pages - 1

    def pages_for(self, tokens: int) -> int:
        """Pages that hold ``tokens`` tokens (ceil division)."""
        return -(-tokens // self.page_size)

    def allocate(self, n: int) -> np.ndarray:
        """Take ``n`` free pages: ``i32[n]``. Raises ``OutOfPages`` (taking nothing) when fewer are free."""
        if n < 0:
            raise ValueError(f"{n=} must be >= 0")
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} of {self.capacity} are free")
        pages = np.array([self._free.pop() for _ in range(n)], np.int32)
        self._allocated[pages] = True
        return pages

    def free(self, pages: np.ndarray) -> None:
        """Return allocated pages to the pool. Raises ``ValueError`` (freeing nothing) on the null page,
        an out-of-range page, a page listed twice or a page that is not allocated (a double free)."""
        pages = np.asarray(pages, np.int64).reshape(-1)
        bad = pages[(pages <= NULL_PAGE) | (pages >= self.num_pages)]
        if bad.size:
            raise ValueError(f"cannot free pages {bad.tolist()}: allocatable pages are 1..{self.num_pages - 1}")
        unique, counts = np.unique(pages, return_counts=True)
        if (counts > 1).any():
            raise ValueError(f"pages {unique[counts > 1].tolist()} are listed more than once")
        if not self._allocated[pages].all():
            raise ValueError(f"pages {pages[~self._allocated[pages]].tolist()} are not allocated (double free?)")
        self._allocated[pages] = False
        self._free.extend(reversed(pages.tolist()))


class Admitted(NamedTuple):
    """A running request: its batch row and its reserved pages ``i32[pages_for(prompt + max_new)]`` (ids in
    the pool of the row's data shard)."""

    request_id: Hashable
    row: int
    pages: np.ndarray


class _Waiting(NamedTuple):
    request_id: Hashable
    pages: int


class Admission:
    """A FIFO queue of requests waiting for pages and batch rows, and the requests running.

    Strict FIFO: ``admit`` stops at the first waiting request that does not fit, even when a smaller
    one behind it would. A large request is therefore never starved by a stream of small ones, at the
    price of idle pages while it waits for running requests to finish. Requests that could never fit
    are refused by ``submit``, so the head of the queue always fits once enough requests finish.
    """

    def __init__(self, allocators: list[PageAllocator], *, max_batch: int, max_position_embeddings: int):
        """``allocators``: one pool per data shard (equal sizes); ``max_batch`` rows, divided evenly over them."""
        if max_batch < 1:
            raise ValueError(f"{max_batch=} must be >= 1")
        if not allocators or max_batch % len(allocators):
            raise ValueError(f"{max_batch=} batch rows do not divide over {len(allocators)} data shards")
        if len({(a.num_pages, a.page_size) for a in allocators}) != 1:
            raise ValueError("every data shard's pool must have the same pages")
        self.allocators = list(allocators)
        self.rows_per_shard = max_batch // len(allocators)
        self.max_batch = max_batch
        self.max_position_embeddings = max_position_embeddings
        self._queue: deque[_Waiting] = deque()
        self._waiting_ids: set[Hashable] = set()
        self._running: dict[Hashable, Admitted] = {}
        # per shard a heap of its free rows: the lowest free row is taken first
        r = self.rows_per_shard
        self._free_rows: list[list[int]] = [list(range(d * r, (d + 1) * r)) for d in range(len(allocators))]

    @property
    def waiting(self) -> tuple[Hashable, ...]:
        """Ids of the waiting requests, head first."""
        return tuple(w.request_id for w in self._queue)

    @property
    def running(self) -> dict[Hashable, Admitted]:
        """The running requests by id (a copy)."""
        return dict(self._running)

    @property
    def num_free_pages(self) -> int:
        return sum(a.num_free for a in self.allocators)

    @property
    def num_free_rows(self) -> int:
        return sum(map(len, self._free_rows))

    def free_rows(self, shard: int) -> list[int]:
        """Data shard ``shard``'s free batch rows (a copy)."""
        return sorted(self._free_rows[shard])

    def shard_of(self, row: int) -> int:
        """The data shard of batch row ``row``."""
        return row // self.rows_per_shard

    def submit(self, request_id: Hashable, prompt_len: int, max_new_tokens: int) -> None:
        """Queue a request. Raises ``ValueError`` when it could never run (``check``) or was already queued."""
        if request_id in self._running or request_id in self._waiting_ids:
            raise ValueError(f"request {request_id!r} was already submitted")
        self._queue.append(_Waiting(request_id, self.check(request_id, prompt_len, max_new_tokens)))
        self._waiting_ids.add(request_id)

    def check(self, request_id: Hashable, prompt_len: int, max_new_tokens: int) -> int:
        """The pages a request reserves; raises ``ValueError`` when it could never run: an empty prompt,
        ``max_new_tokens < 0``, more positions than the model has, or more pages than the whole pool.
        Reads only the pool's fixed size, so any thread may call it. ``request_id`` None: a request not
        yet queued (its messages say "the request")."""
        who = "the request" if request_id is None else f"request {request_id!r}"
        if prompt_len < 1:
            raise ValueError(f"{who} has an empty prompt ({prompt_len=})")
        if max_new_tokens < 0:
            raise ValueError(f"{who}: {max_new_tokens=} must be >= 0")
        tokens = prompt_len + max_new_tokens
        if tokens > self.max_position_embeddings:
            raise ValueError(
                f"{who}: prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {tokens} "
                f"exceeds the {self.max_position_embeddings} tokens a request may have (max_position_embeddings, or "
                "the engine's --max-seq-len); shorten the prompt or ask for fewer new tokens")
        pool = self.allocators[0]
        pages = pool.pages_for(tokens)
        if pages > pool.capacity:
            size, where = pool.page_size, " of each data shard" if len(self.allocators) > 1 else ""
            raise ValueError(
                f"{who} needs {pages} pages ({tokens} tokens at page size {size}) but the pool{where} has "
                f"{pool.capacity} allocatable pages ({pool.capacity * size} tokens); raise "
                f"--num-pages{' (per data shard)' if where else ''} to at least {pages + 1} (page 0 is reserved) "
                "or --page-size")
        return pages

    def cancel(self, request_id: Hashable) -> None:
        """Drop a waiting request from the queue."""
        if request_id not in self._waiting_ids:
            raise KeyError(f"request {request_id!r} is not waiting")
        self._waiting_ids.remove(request_id)
        self._queue = deque(w for w in self._queue if w.request_id != request_id)

    def _shard_for(self, pages: int) -> int | None:
        """The least-loaded shard with a free row and ``pages`` free pages (None: no shard has them)."""
        fits = [d for d, a in enumerate(self.allocators) if self._free_rows[d] and pages <= a.num_free]
        return min(fits, key=lambda d: (-self.allocators[d].num_free, -len(self._free_rows[d]), d), default=None)

    def admit(self, max_new: int) -> list[Admitted]:
        """Admit up to ``max_new`` requests from the head of the queue while pages and batch rows allow;
        each goes to the least-loaded shard that fits it and gets that shard's lowest free batch row and
        its pages, reserved in full."""
        if max_new < 0:
            raise ValueError(f"{max_new=} must be >= 0")
        admitted = []
        while len(admitted) < max_new and self._queue:
            shard = self._shard_for(self._queue[0].pages)
            if shard is None:
                break
            request_id, pages = self._queue.popleft()
            self._waiting_ids.remove(request_id)
            entry = Admitted(request_id, heapq.heappop(self._free_rows[shard]), self.allocators[shard].allocate(pages))
            self._running[request_id] = entry
            admitted.append(entry)
        return admitted

    def finish(self, request_id: Hashable) -> None:
        """Release a running request's pages and batch row."""
        if request_id not in self._running:
            raise KeyError(f"request {request_id!r} is not running")
        entry = self._running.pop(request_id)
        shard = self.shard_of(entry.row)
        self.allocators[shard].free(entry.pages)
        heapq.heappush(self._free_rows[shard], entry.row)

    def page_table(self, pages_per_row: int) -> np.ndarray:
        """The per-step page table ``i32[max_batch, pages_per_row]``: row ``row`` lists the pages of the
        request in that batch row in token order (ids in its shard's pool); free rows and unused columns hold
        the null page."""
        table = np.full((self.max_batch, pages_per_row), NULL_PAGE, np.int32)
        for entry in self._running.values():
            if entry.pages.size > pages_per_row:
                raise ValueError(f"request {entry.request_id!r} holds {entry.pages.size} pages > {pages_per_row=}")
            table[entry.row, : entry.pages.size] = entry.pages
        return table
