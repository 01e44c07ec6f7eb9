# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Prompt lookup's index in C: what coli.speculate.ngram.NgramDrafter proposes (its Python
twin; tests/test_speculate_lookup.py checks them against each other), at the cost of a
hash probe per token.

A request's context (prompt + output) is kept here as int32 tokens. Every min-gram
occurrence is indexed: a hash table maps a min-gram to the latest position p just after
one (ctx[p - n:p] == the gram), and ``prev[p]`` chains to the occurrence before it, so
the latest CANDIDATES occurrences are a walk down the chain. Hashes are 64-bit; a
probe compares the tokens too, so two min-grams never share a chain.

``step(output, k)`` is the runner's per-step call: it takes the tokens emitted since the
last call from the request's output list, indexes them, and looks the context's suffix
up; None (no allocation, no Python work) when the suffix never occurred before.
"""
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from libc.stdint cimport int32_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc, realloc


cdef inline uint64_t _mix(uint64_t h) noexcept nogil:
    h ^= h >> 33
    h *= 0xff51afd7ed558ccdULL
    h ^= h >> 33
    h *= 0xc4ceb9fe1a85ec53ULL
    h ^= h >> 33
    return h


cdef class NgramIndex:
    """``NgramIndex(context=(), max_ngram, min_ngram, candidates)``: ``extend(tokens)``,
    ``propose(k)`` -> list (as NgramDrafter.propose(context, k)), ``step(output, k)`` ->
    list or None, ``match``, ``len()``, ``tokens(start)``."""

    cdef int32_t *tok  # (cap,) the context
    cdef int32_t *prev  # (cap,) prev[p]: the occurrence of p's min-gram before p (-1: none)
    cdef Py_ssize_t n, cap
    cdef Py_ssize_t indexed  # positions p < indexed are in the table
    cdef uint64_t *hkey  # (tcap,) the min-gram's hash at each table entry
    cdef int32_t *head  # (tcap,) its latest position (-1: an empty entry)
    cdef Py_ssize_t tcap, tcount
    cdef readonly int max_n, min_n, candidates
    cdef public int match  # the length of the last proposal's match (0: none)
    cdef public Py_ssize_t seen  # ``step``: output tokens already taken

    def __cinit__(self, context=(), int max_ngram=16, int min_ngram=2, int candidates=8):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_ngram}, {max_ngram}")
        self.max_n, self.min_n, self.candidates = max_ngram, min_ngram, candidates
        self.cap, self.tcap = 256, 512
        self.tok = <int32_t *>malloc(self.cap * sizeof(int32_t))
        self.prev = <int32_t *>malloc(self.cap * sizeof(int32_t))
        self.hkey = <uint64_t *>malloc(self.tcap * sizeof(uint64_t))
        self.head = <int32_t *>malloc(self.tcap * sizeof(int32_t))
        if not (self.tok and self.prev and self.hkey and self.head):
            raise MemoryError()
        cdef Py_ssize_t i
        for i in range(self.tcap):
            self.head[i] = -1
        self.extend(context if type(context) is list else list(context))

    def __dealloc__(self):
        free(self.tok)
        free(self.prev)
        free(self.hkey)
        free(self.head)

    def __len__(self):
        return self.n

    def tokens(self, Py_ssize_t start=0):
        """The context from ``start`` on, as a list."""
        cdef Py_ssize_t i
        start = max(0, min(start, self.n))
        return [self.tok[i] for i in range(start, self.n)]

    cdef uint64_t _hash(self, Py_ssize_t p) noexcept nogil:
        """The hash of the min-gram ending at p (tok[p - min_n:p])."""
        cdef uint64_t h = <uint64_t>self.min_n
        cdef Py_ssize_t j
        for j in range(p - self.min_n, p):
            h = _mix(h ^ (<uint64_t>(<uint32_t>self.tok[j]) + 0x9e3779b97f4a7c15ULL))
        return h

    cdef bint _same(self, Py_ssize_t p, Py_ssize_t q) noexcept nogil:
        """Whether the min-grams ending at p and at q are the same tokens."""
        cdef Py_ssize_t j
        for j in range(1, self.min_n + 1):
            if self.tok[p - j] != self.tok[q - j]:
                return False
        return True

    cdef Py_ssize_t _find(self, Py_ssize_t p, uint64_t h) noexcept nogil:
        """The table entry of the min-gram ending at p: its own, or the empty one it would take."""
        cdef Py_ssize_t mask = self.tcap - 1
        cdef Py_ssize_t i = <Py_ssize_t>(h & <uint64_t>mask)
        while self.head[i] >= 0 and not (self.hkey[i] == h and self._same(self.head[i], p)):
            i = (i + 1) & mask
        return i

    cdef int _grow_table(self) except -1:
        cdef Py_ssize_t old_cap = self.tcap, i, j, mask
        cdef uint64_t *old_key = self.hkey
        cdef int32_t *old_head = self.head
        cdef uint64_t *nk = <uint64_t *>malloc(2 * old_cap * sizeof(uint64_t))
        cdef int32_t *nh = <int32_t *>malloc(2 * old_cap * sizeof(int32_t))
        if not (nk and nh):
            free(nk)
            free(nh)
            raise MemoryError()
        self.tcap, self.hkey, self.head = 2 * old_cap, nk, nh
        mask = self.tcap - 1
        for i in range(self.tcap):
            nh[i] = -1
        for i in range(old_cap):  # distinct min-grams: each goes to the first free entry of its probe
            if old_head[i] >= 0:
                j = <Py_ssize_t>(old_key[i] & <uint64_t>mask)
                while nh[j] >= 0:
                    j = (j + 1) & mask
                nk[j], nh[j] = old_key[i], old_head[i]
        free(old_key)
        free(old_head)
        return 0

    cdef int _push(self, long t) except -1:
        """Append one token and index the min-gram that now has a next token."""
        cdef Py_ssize_t p, i
        cdef uint64_t h
        if t < 0 or t > 0x7fffffff:
            raise ValueError(f"token id out of range: {t}")
        if self.n == self.cap:
            self.cap *= 2
            self.tok = <int32_t *>realloc(self.tok, self.cap * sizeof(int32_t))
            self.prev = <int32_t *>realloc(self.prev, self.cap * sizeof(int32_t))
            if not (self.tok and self.prev):
                raise MemoryError()
        self.tok[self.n] = <int32_t>t
        self.n += 1
        # index the min-gram ending at p: positions p < n - 1 ... here p = n - 1, whose next token exists now
        p = self.n - 1
        if p >= self.min_n:
            if 2 * (self.tcount + 1) > self.tcap:
                self._grow_table()
            h = self._hash(p)
            i = self._find(p, h)
            self.prev[p] = self.head[i]  # -1 for a new min-gram
            if self.head[i] < 0:
                self.hkey[i] = h
                self.tcount += 1
            self.head[i] = <int32_t>p
        self.indexed = self.n
        return 0

    def extend(self, list tokens, Py_ssize_t start=0):
        """Append tokens[start:] to the context."""
        cdef Py_ssize_t i
        for i in range(start, PyList_GET_SIZE(tokens)):
            self._push(<object>PyList_GET_ITEM(tokens, i))

    cdef object _propose(self, Py_ssize_t k):
        """As NgramDrafter.propose(context, k), None instead of []."""
        cdef Py_ssize_t L = self.n, p, i, top, best = 0, m, period, c
        cdef int best_n = 0, nn
        cdef uint64_t h
        self.match = 0
        if k < 1 or L <= self.min_n:
            return None
        # the context's last min-gram ends at L (not indexed: its next token is to come)
        h = self._hash(L)
        i = self._find(L, h)
        p = self.head[i]
        c = 0
        while p >= 0 and c < self.candidates:
            nn = self.min_n
            top = self.max_n if self.max_n < p else p
            while nn < top and self.tok[p - 1 - nn] == self.tok[L - 1 - nn]:
                nn += 1
            if nn > best_n:
                best, best_n = p, nn
                if nn == self.max_n:
                    break
            p = self.prev[p]
            c += 1
        if best_n == 0:
            return None
        self.match = best_n
        period = L - best  # ctx[best:] followed that match; past the end it repeats with this period
        return [self.tok[best + m % period] for m in range(k)]

    def propose(self, Py_ssize_t k):
        """Draft tokens continuing the context: the earlier occurrence of its suffix with
        the longest match decides; [] when none."""
        d = self._propose(k)
        return [] if d is None else d

    def step(self, list output, Py_ssize_t k):
        """Take ``output[seen:]`` (the request's tokens since the last call) into the context,
        then ``propose(k)``; None when the suffix never occurred before."""
        cdef Py_ssize_t i, n = PyList_GET_SIZE(output)
        for i in range(self.seen, n):
            self._push(<object>PyList_GET_ITEM(output, i))
        self.seen = n
        return self._propose(k)

    def take(self, list output):
        """Take ``output[seen:]`` into the context without a lookup; returns how many."""
        cdef Py_ssize_t i, n = PyList_GET_SIZE(output), got = n - self.seen
        for i in range(self.seen, n):
            self._push(<object>PyList_GET_ITEM(output, i))
        self.seen = n
        return got
