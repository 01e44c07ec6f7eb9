"""Grouping experts of every layer into regions by what routes to them.

Each expert gets a profile: which tokens route to it (over the corpus's most frequent
token ids) and which corpus categories, each as P(x | expert) / sqrt(P(x)) (so that
frequent tokens do not swamp the rest), row-normalised, the category part weighted
half. Tokens and categories are coordinates every layer shares, so experts of
different layers that serve the same text land together. The profiles are centred,
reduced to their leading singular directions (a spectral embedding of the profile
similarity graph), and split by k-means (k-means++ seeding, a fixed seed, several
restarts, the lowest inertia wins). Pure NumPy: no SciPy or scikit-learn.

The regions' 2-D map positions are a classical multidimensional scaling of their
centroids, so regions that serve similar text sit near each other.
"""
from __future__ import annotations

import numpy as np

SEED = 20260
PROFILE_TOKENS = 4096  # the most frequent corpus tokens used as profile coordinates
CATEGORY_WEIGHT = 0.5


def profiles(rec) -> np.ndarray:
    """(L*E, F) expert profiles from a Recorder (see the module docstring)."""
    L, E, V = rec.L, rec.E, rec.V
    N = L * E
    vocab = np.argsort(-rec.token_total, kind="stable")[:PROFILE_TOKENS]
    vocab = vocab[rec.token_total[vocab] > 0]
    col = np.full(V, -1, np.int64)
    col[vocab] = np.arange(len(vocab))
    X = np.zeros((N, len(vocab)), np.float64)
    keys, counts, _ = rec.tok.range(0, N * V)
    n, t = keys // V, keys % V
    keep = col[t] >= 0
    np.add.at(X, (n[keep], col[t[keep]]), counts[keep])
    routed = np.maximum(rec.count.reshape(N, 1), 1)
    p_tok = rec.token_total[vocab] / max(rec.tokens, 1)
    X = X / routed / np.sqrt(np.maximum(p_tok, 1e-12))
    parts = [_unit_rows(X)]
    if len(rec.categories) > 1 and rec.cat_tokens.sum() > 0:
        C = rec.cat_count.reshape(N, -1).astype(np.float64)
        p_cat = rec.cat_tokens / rec.cat_tokens.sum()
        C = C / np.maximum(C.sum(1, keepdims=True), 1) / np.sqrt(np.maximum(p_cat, 1e-12))
        parts.append(CATEGORY_WEIGHT * _unit_rows(C))
    return np.concatenate(parts, axis=1)


def cluster(X: np.ndarray, k: int, seed: int = SEED, restarts: int = 8) -> np.ndarray:
    """(N,) region index of each row of X, in 0..k-1 (every index used when N >= k)."""
    N = len(X)
    k = max(1, min(k, N))
    Y = X - X.mean(0)
    U, S, _ = np.linalg.svd(Y, full_matrices=False)
    dims = max(1, min(len(S), 2 * k))
    Z = U[:, :dims] * S[:dims]  # (N, dims)
    rng = np.random.default_rng(seed)
    best, best_inertia = None, np.inf
    for _ in range(restarts):
        labels, inertia = _kmeans(Z, k, rng)
        if inertia < best_inertia - 1e-12:
            best, best_inertia = labels, inertia
    return best


def layout(X: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
    """(k, 2) positions in [0.1, 0.9] of the regions' centroids (classical MDS)."""
    cent = np.stack([X[labels == r].mean(0) if (labels == r).any() else np.zeros(X.shape[1]) for r in range(k)])
    if k == 1:
        return np.array([[0.5, 0.5]])
    D2 = ((cent[:, None, :] - cent[None, :, :]) ** 2).sum(-1)
    J = np.eye(k) - 1.0 / k
    B = -0.5 * J @ D2 @ J
    w, v = np.linalg.eigh(B)
    order = np.argsort(-w)[:2]
    P = v[:, order] * np.sqrt(np.maximum(w[order], 0))
    if P.shape[1] < 2:
        P = np.c_[P, np.zeros(k)]
    for d in range(2):  # a fixed orientation: the biggest region's coordinate is not negative
        if P[0, d] < 0:
            P[:, d] = -P[:, d]
    span = P.max(0) - P.min(0)
    span[span < 1e-9] = 1.0
    return 0.1 + 0.8 * (P - P.min(0)) / span


def _unit_rows(A: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(A, axis=1, keepdims=True)
    return A / np.maximum(n, 1e-12)


def _kmeans(Z: np.ndarray, k: int, rng: np.random.Generator, iters: int = 100) -> tuple[np.ndarray, float]:
    N = len(Z)
    centers = [Z[rng.integers(N)]]
    for _ in range(1, k):  # k-means++: the next center far from the chosen ones
        d = np.min(((Z[:, None, :] - np.array(centers)[None]) ** 2).sum(-1), axis=1)
        total = d.sum()
        centers.append(Z[rng.choice(N, p=d / total)] if total > 0 else Z[rng.integers(N)])
    C = np.array(centers)
    labels = np.zeros(N, np.int64)
    for it in range(iters):
        d = ((Z[:, None, :] - C[None]) ** 2).sum(-1)  # (N, k)
        new = d.argmin(1)
        for r in range(k):  # an empty cluster takes the point farthest from its center
            if not (new == r).any():
                far = d[np.arange(N), new].argmax()
                new[far] = r
                d[far] = 0
        if it and (new == labels).all():
            break
        labels = new
        C = np.stack([Z[labels == r].mean(0) for r in range(k)])
    inertia = float(((Z - C[labels]) ** 2).sum())
    return labels, inertia
