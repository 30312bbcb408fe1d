"""Prefix cache: KV pages of finished (or retracted) requests kept in a tree keyed by their tokens, so that a new
request whose prompt starts with the same tokens reuses those pages instead of recomputing them
(`--enable-prefix-caching`).

Granularity is one full page: a node of the tree is one page of the pool holding the KV of `page_size` tokens, its
key those tokens, its parent the page before it. Only full pages are shared, and a request never matches its whole
sequence (the last token is always computed, for its logits), so a request only ever writes pages of its own: the
shared ones are read-only. A request's pages join the cache as soon as they are computed (after each prefill chunk),
so that a request arriving while another with the same prompt still runs already reuses them; the rest of its full
pages join when it finishes.

Ownership: a page is either free (the allocator's), a request's own, or the cache's (a node). A node counts the live
requests reading it (`refs`; matching a path refers to every node on it, so a node is referenced at least as often as
any of its children). Nodes with no reader are evictable, least recently used leaves first: the pool counts them as
free (`MLAKVPool.num_free_pages`) and evicts them when an allocation needs their pages (`MLAKVPool.allocate`), so the
cache never takes memory a running request needs.

Exact: children are keyed by their token tuples (no hashes that could collide), so a match is always the same tokens
at the same positions, whose KV is the same.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from pdlab.runtime.core import Req


@dataclass(eq=False)
class _Node:
    page: int  # -1 for the root
    key: tuple[int, ...]
    parent: "_Node | None"
    depth: int = 0  # pages from the root (the root 0): a request reading this node shares its first `depth` pages
    children: dict[tuple[int, ...], "_Node"] = field(default_factory=dict)
    refs: int = 0


class PrefixCache:
    """The cached pages of one pool. `free(pages)`: gives pages back to the pool (evicted or duplicate ones).

    A request that reads cached pages holds the node of its last shared one (`Req.prefix_node`; its depth is
    `Req.prefix_pages`): the path back to the root is what it reads."""

    def __init__(self, free: Callable[[list[int]], None], page_size: int):
        self._free = free
        self.page_size = page_size
        self.root = _Node(-1, (), None)
        self.num_pages = 0  # pages the cache holds (nodes)
        self._referenced = 0  # nodes with refs > 0
        self._leaves: OrderedDict[_Node, None] = OrderedDict()  # evictable leaves (refs 0, no child), LRU first
        self.hit_tokens = 0  # tokens served from the cache (prompt tokens not computed), for metrics
        self.queried_tokens = 0  # prompt tokens looked up

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def evictable(self) -> int:
        """Pages no live request reads: free for any allocation (evicted on demand)."""
        return self.num_pages - self._referenced

    # ---- lookup --------------------------------------------------------------------------------
    def match(self, req: "Req") -> int:
        """Give `req` (no pages yet, nothing computed; else it returns 0) the cached pages of its longest cached prefix
        of full pages, short of its last token, and refer to them: req.pages / req.prefix_node / req.cached_len are
        set. Returns the tokens matched (0: nothing cached)."""
        if req.pages or req.cached_len:  # it has KV of its own already (a restored backup): nothing to share
            return 0
        ps, ids = self.page_size, req.tokens(0, req.seq_len)
        self.queried_tokens += len(ids)
        node = self.root
        for i in range((len(ids) - 1) // ps):  # the last token is always computed
            child = node.children.get(tuple(ids[i * ps:(i + 1) * ps]))
            if child is None:
                break
            node = child
        path = self._path(node)
        for n in path:
            self._ref(n)
        req.pages = [n.page for n in path]
        req.prefix_node = node if path else None
        req.cached_len = len(path) * ps
        self.hit_tokens += req.cached_len
        return req.cached_len

    def unmatch(self, req: "Req") -> None:
        """Undo `match` for a request that was not admitted after all (it matches again when it is)."""
        self.hit_tokens -= req.cached_len
        self.queried_tokens -= req.seq_len
        self.release(req, keep=False)
        req.cached_len = 0

    def next_page(self, req: "Req", upto: int) -> tuple | None:
        """What names the page `req` computes next, when its computed tokens end where its shared pages do and tokens
        [cached_len, upto) complete that page: (the node it extends, the page's tokens); two requests with the same
        one would compute the same page. None otherwise."""
        ps, start = self.page_size, req.cached_len
        if start != req.prefix_pages * ps or start + ps > upto:
            return None
        return (req.prefix_node or self.root, tuple(req.tokens(start, start + ps)))

    # ---- a request computed more of its prompt -------------------------------------------------
    def insert_computed(self, req: "Req") -> int:
        """Share the full pages `req` computed past its shared ones while it still runs (after a prefill chunk), so
        that requests admitted from now on match them: they become cache nodes that `req` reads (req.prefix_pages
        grows). A page whose tokens another request cached first stays `req`'s own, and so do the pages after it.
        Returns the pages shared."""
        before = req.prefix_pages
        self._insert(req, reading=True)
        return req.prefix_pages - before

    # ---- a request is done with its pages ------------------------------------------------------
    def release(self, req: "Req", keep: bool) -> None:
        """Take back `req`'s pages: the full pages of its computed KV go into the cache when `keep` (a page the cache
        already holds with the same tokens is freed as a duplicate), its references are dropped, and every other page
        is freed. req.pages / req.prefix_node are cleared."""
        tail, kept, free = req.prefix_node, req.prefix_pages, []
        if keep:
            kept, free = self._insert(req, reading=False)
        for n in self._path(tail):
            self._unref(n)
        free += req.pages[kept:]
        if free:
            self._free(free)
        req.pages, req.prefix_node = [], None

    def _insert(self, req: "Req", reading: bool) -> tuple[int, list[int]]:
        """Add req's computed full pages past its shared ones under its last shared node. reading (a running
        request): each new node is referred to by req and becomes its last shared one; a page whose tokens are cached
        already stops the walk (req keeps computing into its own pages). Else (a request done with its pages): such a
        page is a duplicate to free and the walk goes on under the cached one. Returns (pages of req now cached or
        shared, duplicate pages to free)."""
        ps, start, pages = self.page_size, req.prefix_pages, req.pages
        full = min(min(req.cached_len, req.seq_len) // ps, len(pages))
        node, dupes = req.prefix_node or self.root, []
        if full <= start:
            return start, dupes
        ids = req.tokens(start * ps, full * ps)
        for i in range(start, full):
            key = tuple(ids[(i - start) * ps:(i - start + 1) * ps])
            child = node.children.get(key)
            if child is None:
                child = _Node(pages[i], key, node, node.depth + 1)
                self._add_child(node, child)
                self.num_pages += 1
                if reading:
                    self._ref(child)
                    req.prefix_node = child
            elif reading:  # computed by another request at the same time: ours stays own
                return i, dupes
            else:
                dupes.append(pages[i])  # the same tokens are cached already (another request stored them first)
            node = child
        self._touch(node)  # the most recently used leaf, when it is one
        return full, dupes

    # ---- eviction ------------------------------------------------------------------------------
    def evict(self, n: int) -> int:
        """Free up to `n` unreferenced pages, least recently used leaves first; returns how many were freed."""
        freed: list[int] = []
        while len(freed) < n and self._leaves:
            leaf, _ = self._leaves.popitem(last=False)
            parent = leaf.parent
            del parent.children[leaf.key]
            freed.append(leaf.page)
            self.num_pages -= 1
            if parent is not self.root and parent.refs == 0 and not parent.children:
                self._leaves[parent] = None
                self._leaves.move_to_end(parent, last=False)  # older than anything used after its child
        if freed:
            self._free(freed)
        return len(freed)

    def clear(self) -> int:
        """Evict every unreferenced page (e.g. after the start-up warm-up); returns how many were freed."""
        return self.evict(self.num_pages)

    # ---- checks ---------------------------------------------------------------------------------
    def check(self, live: list["Req"]) -> set[int]:
        """AssertionError unless each node's refs is the number of live requests whose shared prefix runs through it
        and the counters agree with the tree; returns the cached page ids."""
        refs: dict[int, int] = {}
        for r in live:
            assert [n.page for n in self._path(r.prefix_node)] == r.pages[:r.prefix_pages], \
                f"{r.rid}: its shared pages are not its cached path"
            for p in r.pages[:r.prefix_pages]:
                refs[p] = refs.get(p, 0) + 1
        pages, referenced, stack = set(), 0, list(self.root.children.values())
        while stack:
            n = stack.pop()
            assert n.page not in pages, f"page {n.page} is cached twice"
            pages.add(n.page)
            assert n.refs == refs.get(n.page, 0), f"cached page {n.page} has {n.refs} refs, {refs.get(n.page, 0)} " \
                                                  "requests read it"
            assert all(c.refs <= n.refs for c in n.children.values()), "a child is read more often than its parent"
            referenced += n.refs > 0
            assert (n in self._leaves) == (n.refs == 0 and not n.children), f"page {n.page}: eviction list is wrong"
            stack.extend(n.children.values())
        assert len(pages) == self.num_pages and referenced == self._referenced, "the cache's counters are off"
        assert set(refs) <= pages, "a request's shared page is not in the cache"
        return pages

    # ---- internals -----------------------------------------------------------------------------
    @staticmethod
    def _path(tail: "_Node | None") -> list[_Node]:
        """The nodes from the root's child down to `tail` (none for None or the root), in that order."""
        out = []
        while tail is not None and tail.parent is not None:
            out.append(tail)
            tail = tail.parent
        return out[::-1]

    def _add_child(self, parent: _Node, child: _Node) -> None:
        parent.children[child.key] = child
        self._leaves.pop(parent, None)  # a parent is no leaf
        self._leaves[child] = None

    def _ref(self, n: _Node) -> None:
        if n.refs == 0:
            self._referenced += 1
            self._leaves.pop(n, None)
        n.refs += 1

    def _unref(self, n: _Node) -> None:
        n.refs -= 1
        assert n.refs >= 0, f"cached page {n.page} released more often than matched"
        if n.refs == 0:
            self._referenced -= 1
            if not n.children:
                self._leaves[n] = None

    def _touch(self, n: _Node) -> None:
        if n in self._leaves:
            self._leaves.move_to_end(n)
