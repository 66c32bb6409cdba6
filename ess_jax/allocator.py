"""Host-side page bookkeeping: page pools with free lists, and FIFO admission of requests into batch rows.

Plain Python / NumPy, never traced. The engine ships what this module decides to the device as int32
tables (``Admission.page_table``) once per step.

Pages. The KV pools are cut into ``num_pages`` pages of ``page_size`` tokens. Page 0 is the *null
page*: never handed out, it absorbs the writes of masked / padding tokens and pads page tables, so a
device-side scatter never needs a bounds check. Pages ``1 .. num_pages - 1`` are allocatable.

Data shards. On a mesh of ``D`` data shards every shard has its own pool (``PageAllocator``, its own null
page, page ids local to the shard: the devices of shard ``d`` hold its pages and nothing else) and its own
``max_batch / D`` batch rows: rows ``d * R .. (d + 1) * R - 1`` read only shard ``d``'s pages.

Prefix cache. A full page of prompt tokens is named by a key chained over the prompt (``page_keys``: the
previous page's key, the page's token ids and any tokens past it that its rows depend on; the first page's
parent is a salt naming everything else that changes the page's bytes: model, cache formats). Once written,
such a page may be *shared*: every request whose prompt starts with the same pages reads them (read only; its
partial last page, and every page it writes, are its own). Pages are reference-counted; a page no request holds
any more stays cached under its key, evictable least-recently-used: ``allocate`` takes free pages first, then
the least recently released cached ones (a request's pages are released in reverse token order, vLLM's, so a prefix
loses its last pages first and its first ones stay usable). A cached page counts as free (``num_free``), so admission
counts a shared page once: a request that shares pages another running request holds costs only its own pages.

Row states. Where a request's cache also has state per batch row (DeepSeek-V4's sliding window and compressor
rings), a cached prefix is usable only up to a page whose key carries a snapshot of that state at the page's end
(``keep_state``): ``match`` stops at the deepest such page. A pool keeps at most ``states`` snapshots, least
recently used out first; a snapshot goes with its page when the page is evicted.

Admission. A request reserves ``pages_for(prompt_len + max_new_tokens)`` pages of one shard when it is
admitted (its leading cached pages shared, the rest taken), so a running request never runs out mid-decode,
and holds one batch row of that shard until it finishes. Waiting requests are admitted in strict FIFO order,
each to the shard holding the longest cached prefix of its prompt that has a free row and its pages, the
least-loaded among equals (the most free pages; then the fewest rows in use; then the lowest shard).
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict, deque
from typing import Any, Hashable, NamedTuple, Sequence

import numpy as np

NULL_PAGE = 0


class OutOfPages(RuntimeError):
    """``PageAllocator.allocate`` was asked for more pages than are free."""


def page_keys(token_ids: Sequence[int], page_size: int, salt: bytes, lookahead: int = 0) -> list[bytes]:
    """The keys of the full pages of ``token_ids`` that ``lookahead`` more tokens follow: page ``i``'s key hashes
    page ``i - 1``'s key (``salt`` for the first), the page's token ids and the ``lookahead`` after them, so a key
    names the whole prefix up to its page's end and the tokens past it that the page's bytes depend on."""
    keys, parent = [], hashlib.blake2b(salt, digest_size=16).digest()
    tokens = np.asarray(token_ids, np.int64)
    for i in range((len(tokens) - lookahead) // page_size):
        page = tokens[i * page_size:(i + 1) * page_size + lookahead]
        parent = hashlib.blake2b(parent + page.tobytes(), digest_size=16).digest()
        keys.append(parent)
    return keys


class PageAllocator:
    """A pool of ``num_pages`` pages of ``page_size`` tokens; page 0 is the reserved null page.

    Free pages live on a LIFO stack, so pages freed last are reused first and page tables of
    long-running engines are fragmented (not contiguous), as the paged kernels must expect. Each handed-out
    page has a reference count (``share`` adds one, ``free`` drops one); a page cached under a key
    (``cache``) that no request holds stays cached and evictable, least recently released first. ``states``: the
    row-state snapshots kept (``keep_state``; a prefix is shared only up to one); None: a prefix's pages are all of
    its cache, shared to any page.
    """

    def __init__(self, num_pages: int, page_size: int, states: int | None = None):
        if num_pages < 2:
            raise ValueError(f"{num_pages=} must be >= 2 (page 0 is the reserved null page)")
        if page_size < 1:
            raise ValueError(f"{page_size=} must be >= 1")
        if states is not None and states < 1:
            raise ValueError(f"{states=} must be >= 1 (the row-state snapshots a pool keeps)")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: list[int] = list(range(num_pages - 1, NULL_PAGE, -1))  # stack: pops 1, 2, 3, ... first
        self._refs = np.zeros(num_pages, np.int64)  # i64[num_pages] requests holding each page
        self._page_of: dict[bytes, int] = {}  # key -> the cached page holding it
        self._key_of: dict[int, bytes] = {}  # cached page -> its key
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached pages no request holds, least recent first
        self.max_states = states
        self._states: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()  # key -> (row state at its page's end,
        # its bytes), least recently used first

    @property
    def num_free(self) -> int:
        """Pages ``allocate`` can take: the free ones and the cached ones no request holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Cached pages no request holds (evictable)."""
        return len(self._evictable)

    @property
    def num_states(self) -> int:
        """Row-state snapshots kept."""
        return len(self._states)

    @property
    def state_bytes(self) -> int:
        """Bytes of the row-state snapshots kept."""
        return sum(n for _, n in self._states.values())

    @property
    def num_held(self) -> int:
        """Pages some request holds."""
        return self.capacity - self.num_free

    @property
    def capacity(self) -> int:
        """Allocatable pages: all but the null page."""
        return self.num_pages - 1

    def pages_for(self, tokens: int) -> int:
        """Pages that hold ``tokens`` tokens (ceil division)."""
        return -(-tokens // self.page_size)

    def allocate(self, n: int) -> np.ndarray:
        """Take ``n`` pages: ``i32[n]``, free ones first, then the least recently released cached ones (their
        keys forgotten). Raises ``OutOfPages`` (taking nothing) when fewer than ``n`` are free or evictable."""
        if n < 0:
            raise ValueError(f"{n=} must be >= 0")
        if n > self.num_free:
            raise OutOfPages(f"asked for {n} pages, {self.num_free} of {self.capacity} are free")
        pages = []
        for _ in range(n):
            if self._free:
                pages.append(self._free.pop())
            else:
                page, _ = self._evictable.popitem(last=False)
                key = self._key_of.pop(page)
                del self._page_of[key]
                self._states.pop(key, None)
                pages.append(page)
        pages = np.array(pages, np.int32)
        self._refs[pages] = 1
        return pages

    def free(self, pages: np.ndarray) -> None:
        """Drop one reference to each of ``pages`` (a request's, in token order): a page no request holds any more
        goes back to the pool, or stays cached (evictable, most recently released last, ``pages`` in reverse order:
        a prefix's tail goes before its head) if it has a key. Raises ``ValueError`` (freeing
        nothing) on the null page, an out-of-range page, a page listed twice or a page no request holds (a
        double free)."""
        pages = np.asarray(pages, np.int64).reshape(-1)
        bad = pages[(pages <= NULL_PAGE) | (pages >= self.num_pages)]
        if bad.size:
            raise ValueError(f"cannot free pages {bad.tolist()}: allocatable pages are 1..{self.num_pages - 1}")
        unique, counts = np.unique(pages, return_counts=True)
        if (counts > 1).any():
            raise ValueError(f"pages {unique[counts > 1].tolist()} are listed more than once")
        if not (self._refs[pages] > 0).all():
            raise ValueError(f"pages {pages[self._refs[pages] <= 0].tolist()} are not allocated (double free?)")
        self._refs[pages] -= 1
        released = [int(p) for p in pages if self._refs[p] == 0]
        for page in reversed(released):  # a prefix's last pages are evicted first: its first ones stay usable
            if page in self._key_of:
                self._evictable[page] = None
        self._free.extend(reversed([p for p in released if p not in self._key_of]))

    # ---- the prefix cache ----------------------------------------------------------------------
    def match(self, keys: Sequence[bytes]) -> np.ndarray:
        """The cached pages of the longest prefix of ``keys`` (held or evictable), with row states up to the deepest
        one whose last page has a snapshot: ``i32[n]``."""
        pages, usable = [], 0
        for key in keys:
            if (page := self._page_of.get(key)) is None:
                break
            pages.append(page)
            if self.max_states is None or key in self._states:
                usable = len(pages)
        return np.array(pages[:usable], np.int32)

    def has(self, key: bytes) -> bool:
        """A page is cached under ``key``."""
        return key in self._page_of

    def has_state(self, key: bytes) -> bool:
        """A row-state snapshot is kept at the end of page ``key``."""
        return key in self._states

    def cached_run(self, keys: Sequence[bytes]) -> int:
        """How many of the leading ``keys`` are cached, snapshots or not."""
        return next((i for i, key in enumerate(keys) if key not in self._page_of), len(keys))

    def keep_state(self, key: bytes, state: Any, nbytes: int) -> None:
        """Keep ``state`` (``nbytes`` bytes), the row state at the end of the cached page ``key``; the least recently
        used snapshot out past ``states`` of them."""
        if key not in self._page_of:
            raise ValueError("a row state is kept only with its cached page")
        self._states[key] = (state, nbytes)
        self._states.move_to_end(key)
        while len(self._states) > self.max_states:
            self._states.popitem(last=False)

    def state(self, key: bytes) -> Any:
        """The row state kept at the end of page ``key`` (now the most recently used)."""
        self._states.move_to_end(key)
        return self._states[key][0]

    def cost(self, shared: np.ndarray, pages: int) -> int:
        """The free pages a request of ``pages`` pages takes when it shares ``shared`` (its first pages): its own
        pages, and the shared ones no request holds now (they leave the evictable pages)."""
        return pages - shared.size + int((self._refs[shared] == 0).sum())

    def share(self, pages: np.ndarray) -> None:
        """One more reference to each of the cached ``pages`` (those no request held leave the evictable ones)."""
        for page in np.asarray(pages).reshape(-1).tolist():
            if page not in self._key_of:
                raise ValueError(f"page {page} is not cached: only cached pages are shared")
            self._evictable.pop(page, None)
            self._refs[page] += 1

    def cache(self, page: int, key: bytes) -> None:
        """Cache the held, fully written ``page`` under ``key``, for later requests to share; nothing if ``key`` is
        cached already (another request wrote the same prefix) or ``page`` has a key."""
        if not self._refs[page] > 0:
            raise ValueError(f"page {page} is not held: only a written page is cached")
        if key in self._page_of or page in self._key_of:
            return
        self._page_of[key], self._key_of[page] = page, key


class Admitted(NamedTuple):
    """A running request: its batch row and its reserved pages ``i32[pages_for(prompt + max_new)]`` (ids in
    the pool of the row's data shard), the first ``shared`` of them cached pages it shares (read only); with row
    states, ``points``: the page counts past ``shared`` at whose end its prefill keeps a snapshot besides its
    boundary's (where it leaves its shard's cached run, and the longest run a request waiting when it was admitted
    shares with it: branch points later prompts resume from)."""

    request_id: Hashable
    row: int
    pages: np.ndarray
    shared: int = 0
    points: tuple[int, ...] = ()


class _Waiting(NamedTuple):
    request_id: Hashable
    pages: int
    keys: tuple[bytes, ...]  # the keys of the prompt pages it may share (``page_keys``)


class Admission:
    """A FIFO queue of requests waiting for pages and batch rows, and the requests running.

    Strict FIFO: ``admit`` stops at the first waiting request that does not fit, even when a smaller
    one behind it would. A large request is therefore never starved by a stream of small ones, at the
    price of idle pages while it waits for running requests to finish. Requests that could never fit
    are refused by ``submit``, so the head of the queue always fits once enough requests finish.
    """

    def __init__(self, allocators: list[PageAllocator], *, max_batch: int, max_position_embeddings: int,
                 block: int = 1):
        """``allocators``: one pool per data shard (equal sizes); ``max_batch`` rows, divided evenly over them;
        ``block``: the pages a shared prefix with row states is a multiple of (where snapshots are taken)."""
        if max_batch < 1:
            raise ValueError(f"{max_batch=} must be >= 1")
        if not allocators or max_batch % len(allocators):
            raise ValueError(f"{max_batch=} batch rows do not divide over {len(allocators)} data shards")
        if len({(a.num_pages, a.page_size) for a in allocators}) != 1:
            raise ValueError("every data shard's pool must have the same pages")
        self.allocators = list(allocators)
        self.block = block
        # per shard, the keys the prefills running there will cache (pages) and snapshot at (row states), by request
        self._pending: list[dict[bytes, Hashable]] = [{} for _ in allocators]
        self._pending_states: list[dict[bytes, Hashable]] = [{} for _ in allocators]
        self._expected: dict[Hashable, tuple[int, list[bytes], list[bytes]]] = {}
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

    def submit(self, request_id: Hashable, prompt_len: int, max_new_tokens: int, keys: Sequence[bytes] = ()) -> None:
        """Queue a request; ``keys``: those of the prompt pages it may share (``page_keys``, at most its full
        pages before its last prompt token). Raises ``ValueError`` when it could never run (``check``) or was
        already queued."""
        if request_id in self._running or request_id in self._waiting_ids:
            raise ValueError(f"request {request_id!r} was already submitted")
        pages = self.check(request_id, prompt_len, max_new_tokens)
        if len(keys) * self.allocators[0].page_size >= prompt_len:
            raise ValueError(f"request {request_id!r}: {len(keys)} shared pages leave no prompt token to compute")
        self._queue.append(_Waiting(request_id, pages, tuple(keys)))
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

    def _reach(self, shard: int, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` a request could share on ``shard`` once the prefills running there cache what they
        will (their pages, and with row states their snapshots)."""
        pool, pages, states = self.allocators[shard], self._pending[shard], self._pending_states[shard]
        usable = 0
        for i, key in enumerate(keys):
            if not (pool.has(key) or key in pages):
                break
            if pool.max_states is None or pool.has_state(key) or key in states:
                usable = i + 1
        return usable

    def _shard_for(self, waiting: _Waiting) -> tuple[int, np.ndarray] | None | bool:
        """The shard with a free row and the pages ``waiting`` takes there that holds the longest cached prefix of
        it, the least loaded among equals; with the cached pages it shares there (None: no shard fits it; False: it
        waits for a running prefill that will cache more of its prefix than any shard holds now)."""
        fits, now, later = [], 0, 0
        for d, a in enumerate(self.allocators):
            shared = a.match(waiting.keys)
            now, later = max(now, shared.size), max(later, self._reach(d, waiting.keys))
            if self._free_rows[d] and a.cost(shared, waiting.pages) <= a.num_free:
                fits.append((-shared.size, -a.num_free, -len(self._free_rows[d]), d, shared))
        if later > now:
            return False
        best = min(fits, key=lambda f: f[:4], default=None)
        return None if best is None else best[3:]

    def admit(self, max_new: int) -> list[Admitted]:
        """Admit up to ``max_new`` requests from the head of the queue while pages and batch rows allow;
        each goes to the least-loaded shard that fits it and gets that shard's lowest free batch row and
        its pages, reserved in full. A request whose prefix a running prefill will cache waits for it, keeping its
        place (SGLang's in-batch prefix sharing); those behind it go on."""
        if max_new < 0:
            raise ValueError(f"{max_new=} must be >= 0")
        admitted, deferred = [], []
        while len(admitted) < max_new and self._queue:
            found = self._shard_for(self._queue[0])
            if found is False:
                deferred.append(self._queue.popleft())
                continue
            if found is None:
                break
            (shard, shared), waiting = found, self._queue.popleft()
            request_id = waiting.request_id
            self._waiting_ids.remove(request_id)
            pool = self.allocators[shard]
            points = self._points(pool, waiting.keys, shared.size, [w.keys for w in (*deferred, *self._queue)])
            pool.share(shared)  # before allocate, which may evict cached pages no request holds
            own = pool.allocate(waiting.pages - shared.size)
            entry = Admitted(request_id, heapq.heappop(self._free_rows[shard]), np.concatenate([shared, own]),
                             shared.size, points)
            self._running[request_id] = entry
            self._expect(request_id, shard, waiting.keys[shared.size:],
                         [waiting.keys[n - 1] for n in (*points, len(waiting.keys)) if n > shared.size])
            admitted.append(entry)
        self._queue.extendleft(reversed(deferred))
        return admitted

    def _points(self, pool: PageAllocator, keys: Sequence[bytes], shared: int,
                waiting: list[Sequence[bytes]]) -> tuple[int, ...]:
        """With row states, a request's branch points (``Admitted.points``) past the ``shared`` pages it shares:
        where it leaves ``pool``'s cached run, and the longest run of its keys one of the ``waiting`` requests' keys
        start with."""
        if pool.max_states is None:
            return ()
        common = max((next((i for i, (a, b) in enumerate(zip(keys, other)) if a != b), min(len(keys), len(other)))
                      for other in waiting), default=0)
        runs = {n // self.block * self.block for n in (pool.cached_run(keys), common)}
        return tuple(sorted(n for n in runs if shared < n < len(keys)))

    def _expect(self, request_id: Hashable, shard: int, pages: Sequence[bytes], states: Sequence[bytes]) -> None:
        """A running prefill will cache ``pages`` and keep snapshots at ``states`` (until ``settle``)."""
        pages = [k for k in pages if k not in self._pending[shard]]
        states = [k for k in states if k not in self._pending_states[shard]]
        self._pending[shard].update(dict.fromkeys(pages, request_id))
        self._pending_states[shard].update(dict.fromkeys(states, request_id))
        self._expected[request_id] = (shard, pages, states)

    def settle(self, request_id: Hashable) -> None:
        """A running request's prefill has cached what it will (or ended): requests waiting for it go on."""
        shard, pages, states = self._expected.pop(request_id, (0, [], []))
        for key in pages:
            self._pending[shard].pop(key, None)
        for key in states:
            self._pending_states[shard].pop(key, None)

    def cache_pages(self, request_id: Hashable, keys: Sequence[bytes], state: tuple[Any, int] | None = None) -> None:
        """Cache a running request's first ``len(keys)`` pages (fully written prompt pages) under ``keys``; with
        ``state`` (a row state and its bytes) the snapshot at the last one's end."""
        entry = self._running[request_id]
        pool = self.allocators[self.shard_of(entry.row)]
        for page, key in zip(entry.pages[entry.shared:len(keys)].tolist(), keys[entry.shared:]):
            pool.cache(page, key)
        if state is not None:
            pool.keep_state(keys[-1], *state)
        self.settle(request_id)

    def keep_state(self, request_id: Hashable, key: bytes, state: tuple[Any, int]) -> None:
        """Keep a row state (and its bytes) at the end of the cached page ``key`` in a running request's shard."""
        self.allocators[self.shard_of(self._running[request_id].row)].keep_state(key, *state)

    def cached_run(self, request_id: Hashable, keys: Sequence[bytes]) -> int:
        """How many of the leading ``keys`` a running request's shard has cached, snapshots or not."""
        return self.allocators[self.shard_of(self._running[request_id].row)].cached_run(keys)

    def shared_state(self, request_id: Hashable, keys: Sequence[bytes]) -> Any:
        """The row state at the end of the cached prefix a running request shares (``keys``: its page keys)."""
        entry = self._running[request_id]
        return self.allocators[self.shard_of(entry.row)].state(keys[entry.shared - 1])

    def finish(self, request_id: Hashable) -> None:
        """Release a running request's pages (the cached ones stay cached) and batch row."""
        if request_id not in self._running:
            raise KeyError(f"request {request_id!r} is not running")
        entry = self._running.pop(request_id)
        self.settle(request_id)
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
