"""Page allocator and FIFO admission: invariants under random submit / admit / finish sequences."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ess_jax.allocator import NULL_PAGE, Admission, OutOfPages, PageAllocator

# ---- PageAllocator -----------------------------------------------------------------------------


def test_pages_for_is_ceil_division():
    alloc = PageAllocator(num_pages=8, page_size=4)
    assert [alloc.pages_for(t) for t in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]


def test_allocate_never_hands_out_the_null_page_and_raises_when_empty():
    alloc = PageAllocator(num_pages=5, page_size=2)
    assert alloc.capacity == alloc.num_free == 4
    pages = alloc.allocate(4)
    assert pages.dtype == np.int32 and sorted(pages.tolist()) == [1, 2, 3, 4]
    assert alloc.allocate(0).shape == (0,)
    with pytest.raises(OutOfPages, match="asked for 1 pages, 0 of 4 are free"):
        alloc.allocate(1)
    alloc.free(pages[:2])
    with pytest.raises(OutOfPages):
        alloc.allocate(3)
    assert alloc.num_free == 2  # a failed allocate takes nothing


@pytest.mark.parametrize("bad, match", [
    ([NULL_PAGE], "allocatable pages are 1..4"),
    ([5], "allocatable pages are 1..4"),
    ([-1], "allocatable pages are 1..4"),
    ([1, 1], "listed more than once"),
    ([3], "not allocated"),
])
def test_free_rejects_bad_pages_atomically(bad, match):
    alloc = PageAllocator(num_pages=5, page_size=2)
    alloc.allocate(2)  # pages 1, 2
    with pytest.raises(ValueError, match=match):
        alloc.free(np.array([2] + bad))
    assert alloc.num_free == 2  # page 2 was not freed either


def test_double_free_raises():
    alloc = PageAllocator(num_pages=4, page_size=2)
    pages = alloc.allocate(2)
    alloc.free(pages)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(pages[:1])


def test_freed_pages_are_reused_last_freed_first():
    alloc = PageAllocator(num_pages=6, page_size=1)
    a, b = alloc.allocate(2), alloc.allocate(2)
    alloc.free(a)
    alloc.free(b)
    np.testing.assert_array_equal(alloc.allocate(2), b)


@pytest.mark.parametrize("kwargs, match", [(dict(num_pages=1, page_size=4), "num_pages=1"),
                                           (dict(num_pages=4, page_size=0), "page_size=0")])
def test_allocator_rejects_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PageAllocator(**kwargs)


# ---- Admission ---------------------------------------------------------------------------------


def make_admission(num_pages=9, page_size=4, max_batch=3, max_position_embeddings=64) -> Admission:
    return Admission([PageAllocator(num_pages, page_size)], max_batch=max_batch,
                     max_position_embeddings=max_position_embeddings)


@pytest.mark.parametrize("prompt_len, max_new, match", [
    (0, 4, "empty prompt"),
    (4, -1, "max_new_tokens=-1 must be >= 0"),
    (60, 5, r"prompt \(60 tokens\) \+ max_new_tokens \(5\) = 65 exceeds the 64 tokens"),
    (30, 3, r"needs 9 pages \(33 tokens at page size 4\) but the pool has 8 allocatable pages \(32 tokens\); "
            "raise --num-pages to at least 10"),
])
def test_submit_refuses_requests_that_can_never_run(prompt_len, max_new, match):
    adm = make_admission()
    with pytest.raises(ValueError, match=match):
        adm.submit("r", prompt_len, max_new)
    assert adm.waiting == ()


def test_submit_refuses_duplicate_ids():
    adm = make_admission()
    adm.submit("a", 3, 1)
    with pytest.raises(ValueError, match="already submitted"):
        adm.submit("a", 3, 1)
    adm.admit(1)
    with pytest.raises(ValueError, match="already submitted"):
        adm.submit("a", 3, 1)


def test_whole_pool_request_fits():
    adm = make_admission()
    adm.submit("big", 30, 2)  # 32 tokens = 8 pages = the whole pool
    [entry] = adm.admit(4)
    assert sorted(entry.pages.tolist()) == list(range(1, 9)) and adm.num_free_pages == 0


def test_head_of_queue_is_not_overtaken():
    adm = make_admission()
    adm.submit("a", 20, 4)  # 6 pages
    adm.submit("big", 16, 4)  # 5 pages: waits for "a"
    adm.submit("small", 1, 1)  # 1 page: would fit, but must not overtake "big"
    assert [e.request_id for e in adm.admit(3)] == ["a"]
    assert adm.admit(3) == [] and adm.waiting == ("big", "small")
    adm.finish("a")
    assert [e.request_id for e in adm.admit(3)] == ["big", "small"]


def test_admit_respects_max_new_and_batch_rows():
    adm = make_admission(max_batch=2)
    for name in "abcd":
        adm.submit(name, 2, 1)
    assert [e.request_id for e in adm.admit(1)] == ["a"]
    assert [(e.request_id, e.row) for e in adm.admit(5)] == [("b", 1)]  # only two rows
    adm.finish("a")
    assert [(e.request_id, e.row) for e in adm.admit(5)] == [("c", 0)]  # the freed row is reused
    with pytest.raises(KeyError, match="'d' is not running"):
        adm.finish("d")
    with pytest.raises(ValueError, match="max_new=-1"):
        adm.admit(-1)


def test_page_table_rows_follow_batch_rows_and_pad_with_the_null_page():
    adm = make_admission()
    adm.submit("a", 5, 2)  # 2 pages
    adm.submit("b", 1, 1)  # 1 page
    a, b = adm.admit(2)
    table = adm.page_table(pages_per_row=3)
    assert table.dtype == np.int32 and table.shape == (3, 3)
    np.testing.assert_array_equal(table[a.row], [*a.pages, NULL_PAGE])
    np.testing.assert_array_equal(table[b.row], [*b.pages, NULL_PAGE, NULL_PAGE])
    np.testing.assert_array_equal(table[2], [NULL_PAGE] * 3)
    with pytest.raises(ValueError, match="holds 2 pages > pages_per_row=1"):
        adm.page_table(pages_per_row=1)


def test_data_shards_route_to_the_least_loaded_shard_with_their_own_pages_and_rows():
    shards = [PageAllocator(9, 4) for _ in range(2)]
    adm = Admission(shards, max_batch=4, max_position_embeddings=64)  # rows 0-1: shard 0, rows 2-3: shard 1
    adm.submit("a", 20, 4)  # 6 pages: shard 0 (a tie: the lowest shard)
    adm.submit("b", 2, 2)  # 1 page: shard 1, the most free pages
    adm.submit("c", 2, 2)  # 1 page: shard 1 again (7 free pages against 2)
    adm.submit("d", 10, 2)  # 3 pages: shard 0 has a row but 2 pages, shard 1 no row: it waits
    adm.submit("e", 6, 2)  # 2 pages: would fit shard 0, but must not overtake d
    adm.submit("f", 2, 2)
    admitted = {e.request_id: e for e in adm.admit(10)}
    assert {r: e.row for r, e in admitted.items()} == {"a": 0, "b": 2, "c": 3}
    assert [adm.shard_of(s) for s in range(4)] == [0, 0, 1, 1] and adm.waiting == ("d", "e", "f")
    # page ids are local to each shard's pool: both hand out page 1 first, never the null page
    assert admitted["a"].pages.tolist() == [1, 2, 3, 4, 5, 6]
    assert admitted["b"].pages.tolist() == [1] and admitted["c"].pages.tolist() == [2]
    adm.finish("c")  # shard 1 has a row and 7 pages again
    assert [(e.request_id, e.row, e.pages.tolist()) for e in adm.admit(10)] == [("d", 3, [2, 3, 4]),
                                                                                 ("e", 1, [7, 8])]
    assert [a.num_free for a in shards] == [0, 4] and adm.num_free_pages == 4 and adm.waiting == ("f",)
    adm.finish("a")
    [f] = adm.admit(10)
    assert (f.request_id, f.row, f.pages.tolist()) == ("f", 0, [1])
    np.testing.assert_array_equal(adm.page_table(pages_per_row=3)[3], [2, 3, 4])  # d, on shard 1's pages
    with pytest.raises(ValueError, match="do not divide over 3 data shards"):
        Admission([PageAllocator(9, 4) for _ in range(3)], max_batch=4, max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"the pool of each data shard has 8 allocatable pages.*--num-pages "
                                         r"\(per data shard\) to at least 10"):
        adm.submit("big", 30, 3)


class AdmissionMachine(RuleBasedStateMachine):
    """Random submit / admit / finish sequences against a model of the FIFO queue."""

    @initialize(num_pages=st.integers(2, 24), page_size=st.integers(1, 8), max_batch=st.integers(1, 5))
    def setup(self, num_pages, page_size, max_batch):
        self.adm = Admission([PageAllocator(num_pages, page_size)], max_batch=max_batch, max_position_embeddings=96)
        self.queue: list[int] = []  # the expected FIFO order
        self.pages_needed: dict[int, int] = {}
        self.next_id = 0

    @rule(prompt_len=st.integers(0, 80), max_new=st.integers(0, 40))
    def submit(self, prompt_len, max_new):
        alloc = self.adm.allocators[0]
        fits = (prompt_len >= 1 and max_new >= 0 and prompt_len + max_new <= 96
                and alloc.pages_for(prompt_len + max_new) <= alloc.capacity)
        if fits:
            self.adm.submit(self.next_id, prompt_len, max_new)
            self.queue.append(self.next_id)
            self.pages_needed[self.next_id] = alloc.pages_for(prompt_len + max_new)
        else:
            with pytest.raises(ValueError, match=f"request {self.next_id}"):
                self.adm.submit(self.next_id, prompt_len, max_new)
        self.next_id += 1

    @rule(max_new=st.integers(0, 4))
    def admit(self, max_new):
        admitted = self.adm.admit(max_new)
        ids = [e.request_id for e in admitted]
        assert ids == self.queue[: len(ids)], "admission is strict FIFO"
        self.queue = self.queue[len(ids):]
        for entry in admitted:
            assert entry.pages.dtype == np.int32 and entry.pages.size == self.pages_needed[entry.request_id]
        if len(ids) < max_new and self.queue:  # stopped early: the head must not fit
            assert self.adm.num_free_rows == 0 or self.pages_needed[self.queue[0]] > self.adm.num_free_pages

    @precondition(lambda self: self.adm.running)
    @rule(data=st.data())
    def finish(self, data):
        self.adm.finish(data.draw(st.sampled_from(sorted(self.adm.running))))

    @invariant()
    def pages_are_owned_once(self):
        alloc = self.adm.allocators[0]
        owned = [p for e in self.adm.running.values() for p in e.pages.tolist()]
        everything = owned + alloc._free  # the free list itself: no page may be both free and owned
        assert NULL_PAGE not in everything
        assert sorted(everything) == list(range(1, alloc.num_pages)), "every page is owned exactly once"
        assert self.adm.num_free_pages == alloc.num_pages - 1 - len(owned)

    @invariant()
    def rows_are_unique(self):
        rows = [e.row for e in self.adm.running.values()]
        assert len(set(rows)) == len(rows) and all(0 <= s < self.adm.max_batch for s in rows)
        assert self.adm.num_free_rows == self.adm.max_batch - len(rows)
        assert self.adm.waiting == tuple(self.queue)

    def teardown(self):
        if not hasattr(self, "adm"):
            return
        for request_id in list(self.adm.running):
            self.adm.finish(request_id)
        assert self.adm.num_free_pages == self.adm.allocators[0].capacity
        assert self.adm.num_free_rows == self.adm.max_batch


AdmissionMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestAdmission = AdmissionMachine.TestCase


@given(st.lists(st.integers(1, 6), max_size=12), st.randoms(use_true_random=False))
def test_every_page_comes_back(sizes, rng):
    alloc = PageAllocator(num_pages=40, page_size=2)
    held = [alloc.allocate(n) for n in sizes if n <= alloc.num_free]
    rng.shuffle(held)
    for pages in held:
        alloc.free(pages)
    assert alloc.num_free == alloc.capacity
    assert sorted(alloc.allocate(alloc.capacity).tolist()) == list(range(1, 40))
