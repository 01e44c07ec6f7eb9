"""Cluster mode: 8 concurrent multi-turn clients against Ray workers (coli.cluster).

    python benchmarks/bench_cluster.py [--clients 8] [--turns 4] [--max-tokens 32]

Runs three configurations on one local Ray cluster, one after another: 2 workers with
cache-aware routing, 2 workers with round-robin, 1 worker (cache-aware). Each client
keeps one conversation: every turn sends the whole history plus a new user message.
Reports completion tok/s over the wall time of all clients, the prompt tokens the workers
had to prefill, and the prefix-cache hit rate (prompt tokens the workers restored from KV /
prompt tokens), as the workers count it.
"""
from __future__ import annotations

import argparse
import json
import threading
import time

import ray

import coli
import coli.cluster
from coli.sampling import SamplingParams
from coli.scheduler.events import ContextLengthExceededError, TextDelta, Usage

TOPICS = ["rivers", "mountains", "birds", "trees", "the sea", "bread", "music", "winter", "cats", "boats"]


def client(runner, model, k: int, turns: int, max_tokens: int, out: list) -> None:
    msgs = []
    for t in range(turns):
        msgs.append({"role": "user", "content": f"Tell me something new about {TOPICS[k % len(TOPICS)]}, part {t}."})
        try:
            handle = runner.submit(model.prompt_ids(msgs), max_tokens=max_tokens, sampling=SamplingParams(temperature=0))
        except ContextLengthExceededError:  # the conversation outgrew the context: it ends here
            return
        evs = list(handle.events(timeout=600))
        usage = next(e for e in evs if isinstance(e, Usage))
        out.append(usage)
        msgs.append({"role": "assistant", "content": "".join(e.text for e in evs if isinstance(e, TextDelta))})


def run(model, workers: int, policy: str, args, name: str) -> dict:
    runner = coli.cluster.start(None, workers=workers, address="auto", cluster=name,
                                load_options=dict(threads=args.threads),
                                runner_options=dict(kv_slots=args.kv_slots, max_queue=64),
                                config=coli.cluster.ClusterConfig(policy=policy))
    try:
        usages: list[Usage] = []
        threads = [threading.Thread(target=client, args=(runner, model, k, args.turns, args.max_tokens, usages))
                   for k in range(args.clients)]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
        prompt = sum(u.prompt_tokens for u in usages)
        cached = sum(u.cached_tokens for u in usages)
        done = sum(u.completion_tokens for u in usages)
        return dict(workers=workers, policy=policy, requests=len(usages), completion_tokens=done,
                    seconds=round(wall, 2), tok_s=round(done / wall, 1),
                    prefill_computed=prompt - cached,
                    prefix_cache_hit_rate=round(cached / prompt, 3),
                    routing_hit_rate=round(runner.metrics.value("colibri_cluster_routing_hit_rate") or 0, 3))
    finally:
        runner.close()
        for h in runner.transport.handles.values():
            ray.kill(h)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kv-slots", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=1, help="runs per configuration; the median tok/s is reported")
    args = ap.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, namespace="coli", log_to_driver=False)
    model = coli.load(threads=1)
    rows = []
    configs = [(2, "cache-aware"), (2, "round-robin"), (1, "cache-aware")]
    runs = {c: [] for c in configs}
    for rep in range(args.repeat):  # interleaved, so a busy moment of the machine hits every configuration
        for i, (workers, policy) in enumerate(configs):
            runs[(workers, policy)].append(run(model, workers, policy, args, f"bench{rep}x{i}"))
            print(json.dumps(runs[(workers, policy)][-1]), flush=True)
    for c in configs:
        rs = sorted(runs[c], key=lambda r: r["tok_s"])
        rows.append(rs[len(rs) // 2])
    ray.shutdown()
    print("| workers | routing | requests | completion tok/s | prompt tokens prefilled "
          "| prefix-cache hit rate | routing hit rate |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workers']} | {r['policy']} | {r['requests']} | {r['tok_s']} | {r['prefill_computed']} "
              f"| {r['prefix_cache_hit_rate']:.1%} | {r['routing_hit_rate']:.1%} |")


if __name__ == "__main__":
    main()
