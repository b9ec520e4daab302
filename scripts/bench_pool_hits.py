"""Hit rate of the GPU segment pool under RAG traffic over documents of unequal lengths, on the CPU.

The pool's arena is one buffer, so a new entry needs one hole of its size: how the pool chooses what
to evict decides how many entries a miss costs. This replays a seeded trace (k documents a request
from a corpus of D, Zipf(s) popularity, lengths uniform within ±spread of a mean) through the real
`SegmentStore` on the CPU (a small layout: only sizes matter, and each length maps to the bytes of
the Qwen3.5-35B-A3B shape's entries scaled down) and counts hits, misses and evictions, per pool size
and spread. The ideal is an LRU that needs no contiguity (bytes alone), computed beside it.

    python scripts/bench_pool_hits.py --label after
    git archive e2ca46f | tar -x -C /tmp/before && echo e2ca46f > /tmp/before/COMMIT
    PYTHONPATH=/tmp/before python scripts/bench_pool_hits.py --label before --tree /tmp/before
"""
from __future__ import annotations

import argparse
import random
from collections import OrderedDict

import torch
from results import before_after_arguments, result_path, write_labelled_run

from hypic.cache.model_caches import LinearShape
from hypic.cache.segment_store import SegmentKey, SegmentLayout, SegmentStore, SegmentTuple
from hypic.kernels.linear_families import get_family

ROW_TOKENS = 16  # tokens of a document a K/V row of the small layout stands for


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--documents", type=int, default=100)
    parser.add_argument("--mean-tokens", type=int, default=1500)
    parser.add_argument("--spreads", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 0.3, 0.6])
    parser.add_argument("--pool-documents", type=lambda s: [int(x) for x in s.split(",")], default=[19, 43],
                        help="pool sizes, in documents of the mean length (19: Fig. 11's pool5x; 43: 12 GiB)")
    parser.add_argument("--docs-per-request", type=int, default=8)
    parser.add_argument("--zipf-s", type=float, default=1.0)
    parser.add_argument("--requests", type=int, default=3000)


def small_layout() -> SegmentLayout:
    shape = LinearShape(get_family("gdn"), 1, 4, 4, 4, 4)
    return SegmentLayout((shape,), num_full=1, kv_heads=1, head_dim=64, state_dtype=torch.float32,
                         model_dtype=torch.float32)


def trace(args: argparse.Namespace, rng: random.Random) -> list[list[int]]:
    weights = [1 / (rank + 1) ** args.zipf_s for rank in range(args.documents)]
    requests = []
    for _ in range(args.requests):
        docs: dict[int, None] = {}
        while len(docs) < args.docs_per_request:
            docs.setdefault(rng.choices(range(args.documents), weights)[0])
        requests.append(list(docs))
    return requests


def replay_pool(lay: SegmentLayout, capacity: int, rows: list[int], requests: list[list[int]]) -> dict:
    """Each request's documents looked up in order; a miss stores the document's tuple (as its cold
    prefill would). Entries are unpinned between requests, as once the request has run."""
    store = SegmentStore(lay, capacity, "cpu")
    tuples = {n: _tuple(lay, n) for n in set(rows)}
    for request in requests:
        for doc in request:
            key = SegmentKey.of("bench", 8, None, doc.to_bytes(4, "little"))
            entry = store.get(key)
            if entry is None:
                store.put(key, tuples[rows[doc]])
            else:
                store.unpin(entry)
    stats = store.stats()
    return {"hit_rate": stats.hits / (stats.hits + stats.misses), "evictions": stats.evictions}


def replay_ideal(sizes: list[int], capacity: int, requests: list[list[int]]) -> dict:
    """LRU by bytes alone: what any placement of the same entries could at best keep."""
    held: OrderedDict[int, int] = OrderedDict()
    hits = misses = evictions = used = 0
    for doc in (d for request in requests for d in request):
        if doc in held:
            held.move_to_end(doc)
            hits += 1
            continue
        misses += 1
        while used + sizes[doc] > capacity and held:
            used -= held.popitem(last=False)[1]
            evictions += 1
        held[doc], used = sizes[doc], used + sizes[doc]
    return {"hit_rate": hits / (hits + misses), "evictions": evictions}


def _tuple(lay: SegmentLayout, rows: int) -> SegmentTuple:
    kv = torch.zeros(rows, lay.kv_heads, lay.head_dim)
    return SegmentTuple((4, 4 + rows), [torch.zeros(lay.t_shape(0))], [torch.zeros(lay.s0_shape(0))],
                        [torch.zeros(lay.conv_shape(0))], [kv], [kv])


def main() -> None:
    args = before_after_arguments(__doc__, result_path("pool_hits", "cpu", "zipf"), options)
    lay, results = small_layout(), {}
    for spread in args.spreads:
        rng = random.Random(0)
        tokens = [round(args.mean_tokens * (1 + spread * (2 * rng.random() - 1))) for _ in range(args.documents)]
        rows = [max(1, t // ROW_TOKENS) for t in tokens]
        sizes = [lay.entry_bytes(n) for n in rows]
        requests = trace(args, rng)
        for pool_docs in args.pool_documents:
            capacity = pool_docs * lay.entry_bytes(args.mean_tokens // ROW_TOKENS)
            name = f"spread {spread:g}, pool of {pool_docs} documents"
            results[name] = {"pool": replay_pool(lay, capacity, rows, requests),
                             "ideal": replay_ideal(sizes, capacity, requests)}
            pool, ideal = results[name]["pool"], results[name]["ideal"]
            print(f"{name}: hit rate {pool['hit_rate']:.3f} ({pool['evictions']} evictions), "
                  f"ideal {ideal['hit_rate']:.3f} ({ideal['evictions']})")
    write_labelled_run(args, "pool_hits", [], {"settings": {k: v for k, v in vars(args).items()
                                                            if k not in ("label", "tree", "out")}, "by_case": results})


if __name__ == "__main__":
    main()
