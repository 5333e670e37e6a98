"""Routers the simulator drives: the real router/ code, and peer policies for comparison.

Real: kv, prefix, pow2 run router.Admission + router.make_policy unchanged, on the
ReplicaStats snapshots the replicas published (stale by the stats period plus the
propagation delay), with this router's reservations and hold/backoff.

Peers (simulator-side re-implementations, approximate, no admission: they queue
at the replica as their own systems do):
  sglang       SGLang router cache_aware: load = requests in flight from this
               router; if max - min > 64 and max > 1.5 * min, least loaded;
               else the worker whose router-side tree shares the longest prefix,
               if that covers > 30% of the prompt, else the smallest tree.
  dynamo       Dynamo KV router (approximate-index mode): argmin over workers of
               1.0 * (prefill blocks queued + this prompt's blocks not cached there)
               + (active blocks + this prompt's blocks), ties at random.
  serve_pow2   Ray Serve's default router: two replicas at random, the one with
               fewer requests in flight (Serve's queue-length cache, here exact).
  serve_consistent_hash
               Ray Serve's ConsistentHashRouter (ray.serve.experimental, Ray 2.60):
               a ring of 100 virtual nodes per replica, node i of a replica at
               mmh3.hash64(f"{replica id}:{i}", seed 0xF9B4CA77), a key at the first
               node clockwise (bisect_right, wrapping); the key is the session id,
               here the prompt's head (its first block's tokens, as a client would set
               x-session-id per system prompt). The owner, else up to 2 clockwise
               successors when the owner is at max_ongoing_requests (kvfleet's
               ClusterConfig default, 4096), else backoff and retry, as Serve does.
  random       uniform.
  round_robin  in turn.
The router-side tree is a per-worker LRU of chained block hashes (a radix tree's
paths, one node per block) capped at the replica's block count, with an inverted
index hash -> workers for longest-prefix search.
"""

from __future__ import annotations

import bisect
import random
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from bench.sim_workload import Workload
from replica.stats import ReplicaStats
from router import Admission, OverloadedError, RouterConfig, RouteRequest
from router.prefix_index import HashPostings

REAL_POLICIES = ("kv", "prefix", "pow2")
PEER_POLICIES = (
    "sglang", "dynamo", "serve_pow2", "serve_consistent_hash", "random", "round_robin",
)  # fmt: skip
ALL_POLICIES = REAL_POLICIES + PEER_POLICIES
# The names (bench.sim --routers): dashes for underscores.
ROUTER_ALIASES = {p.replace("_", "-"): p for p in ALL_POLICIES}


def policy_name(router: str) -> str:
    """A --routers name (serve-pow2 or serve_pow2) as the simulator's policy name."""
    name = ROUTER_ALIASES.get(router, router)
    if name not in ALL_POLICIES:
        raise ValueError(f"routers: unknown {router!r}; choose from {sorted(ROUTER_ALIASES)}")
    return name


HELD = -1
REJECTED = -2


class SimRouter:
    """route() returns (replica index, 0) or (HELD, retry_after_s) or (REJECTED, 0).

    observe() hands over a replica's snapshot when it reaches the router (routers
    with needs_stats); on_first_token / on_finish report progress (tracks_progress);
    on_admitted is when the engine takes a routed request. Each does nothing here.
    """

    name = ""
    needs_stats = needs_hashes = tracks_progress = False

    def route(self, rid: int, now_s: float, attempt: int, held_since_s: float) -> tuple[int, float]:
        raise NotImplementedError

    def observe(self, replica: int, stats: ReplicaStats) -> None:
        pass

    def on_first_token(self, rid: int, replica: int) -> None:
        pass

    def on_finish(self, rid: int, replica: int) -> None:
        pass

    def on_admitted(self, rid: int, replica: int, admit_s: float) -> None:
        pass


class RealRouter(SimRouter):
    """router.Admission + make_policy, as cluster.request_router calls them.

    The one difference is how snapshots arrive: the Serve adapter hands Admission
    the whole list each call (admit(stats), which syncs by identity); here each
    snapshot is observed once, when it becomes visible, and route() calls
    decide() — the same code path after the sync (tests/router checks both).
    """

    needs_stats = True

    def __init__(self, config: RouterConfig, workload: Workload, num_replicas: int) -> None:
        self.name = config.policy
        self.needs_hashes = config.policy == "prefix"
        self.workload = workload
        self.admission = Admission(config)
        # A request reaches its replica when it is routed (no network here), and the
        # replica's ack tells the router so (cluster.live_stats.note_admitted).
        # Kept for the reservation TTL (no reservation outlives it), oldest first.
        self.admitted_s: dict[str, tuple[str, float]] = {}
        self.ttl_s = config.reservation_ttl_s
        self.admission.reservations.admitted_at = self._admitted_at
        self.index_of = {f"replica-{i}": i for i in range(num_replicas)}
        self.rng = random.Random(config.seed)

    def _admitted_at(self, request_id: str, replica_id: str) -> float | None:
        known = self.admitted_s.get(request_id)
        return known[1] if known is not None and known[0] == replica_id else None

    def route_request(self, rid: int) -> RouteRequest:
        wl = self.workload
        num_prompt, max_tokens = wl.prompt_len_list[rid], wl.output_len_list[rid]
        if self.needs_hashes:
            # The trace's block names: the real chained hashes of shared prefix blocks
            # (what replicas publish) and unique names for the request's own blocks,
            # which match nothing, as their real hashes would not.
            bs = wl.block_size
            hashes = wl.block_hashes(rid, num_prompt // bs)
            return RouteRequest.with_block_hashes(str(rid), num_prompt, bs, hashes, max_tokens)
        return RouteRequest(str(rid), num_prompt_tokens=num_prompt, max_tokens=max_tokens)

    def observe(self, replica: int, stats: ReplicaStats) -> None:
        self.admission.observe(stats)

    def route(self, rid: int, now_s: float, attempt: int, held_since_s: float) -> tuple[int, float]:
        request = self.route_request(rid)
        try:
            decision = self.admission.decide(
                request, now_s, attempt=attempt,
                held_since_s=None if attempt == 0 else held_since_s,
            )  # fmt: skip
        except OverloadedError:
            return REJECTED, 0.0
        if not decision.admitted:
            return HELD, decision.retry_after_s
        tier = decision.tiers[0]
        replica_id = tier[0] if len(tier) == 1 else self.rng.choice(tier)
        self.admission.reserve(request, replica_id, now_s)
        admitted_s = self.admitted_s
        admitted_s.pop(request.request_id, None)  # a retry: keep insertion order by time
        admitted_s[request.request_id] = (replica_id, now_s)
        while now_s - next(iter(admitted_s.values()))[1] > self.ttl_s:
            del admitted_s[next(iter(admitted_s))]
        return self.index_of[replica_id], 0.0

    def on_admitted(self, rid: int, replica: int, admit_s: float) -> None:
        """The engine takes the request at admit_s, after the replica's request path
        (SimConfig.serve_request_s): its ack says so, as cluster.live_stats does."""
        request_id = str(rid)
        known = self.admitted_s.get(request_id)
        if known is not None:
            self.admitted_s[request_id] = (known[0], admit_s)


class RandomRouter(SimRouter):
    name = "random"

    def __init__(self, num_replicas: int, seed: int) -> None:
        self.num_replicas = num_replicas
        self.rng = random.Random(seed)

    def route(self, rid: int, now_s: float, attempt: int, held_since_s: float) -> tuple[int, float]:
        return self.rng.randrange(self.num_replicas), 0.0


class RoundRobinRouter(RandomRouter):
    name = "round_robin"

    def __init__(self, num_replicas: int, seed: int) -> None:
        super().__init__(num_replicas, seed)
        self.next = seed % num_replicas

    def route(self, rid: int, now_s: float, attempt: int, held_since_s: float) -> tuple[int, float]:
        replica, self.next = self.next, (self.next + 1) % self.num_replicas
        return replica, 0.0


class ServePow2Router(RandomRouter):
    name = "serve_pow2"
    tracks_progress = True

    def __init__(self, num_replicas: int, seed: int) -> None:
        super().__init__(num_replicas, seed)
        self.in_flight = [0] * num_replicas

    def route(self, rid: int, now_s: float, attempt: int, held_since_s: float) -> tuple[int, float]:
        replica = 0
        if self.num_replicas > 1:
            first, second = self.rng.sample(range(self.num_replicas), 2)
            # Serve keeps the first of equal queue lengths.
            replica = second if self.in_flight[second] < self.in_flight[first] else first
        self.in_flight[replica] += 1
        return replica, 0.0

    def on_finish(self, rid: int, replica: int) -> None:
        self.in_flight[replica] -= 1


class ServeConsistentHashRouter(SimRouter):
    """See the module docstring (serve_consistent_hash)."""

    name = "serve_consistent_hash"
    tracks_progress = True
    SEED = 0xF9B4CA77  # ray.serve.experimental.consistent_hash_router.CONSISTENT_HASH_SEED

    def __init__(
        self,
        workload: Workload,
        num_replicas: int,
        key_tokens: int,
        num_virtual_nodes: int = 100,
        num_fallback_replicas: int = 2,
        max_ongoing_requests: int = 4096,
    ) -> None:
        import mmh3

        self.hash64 = lambda key: mmh3.hash64(key, seed=self.SEED, signed=False)[0]
        self.workload = workload
        self.key_tokens = key_tokens
        ring = sorted(
            (self.hash64(f"replica-{r}:{i}".encode()), r)
            for r in range(num_replicas)
            for i in range(num_virtual_nodes)
        )
        self.ring_hashes = [h for h, _ in ring]
        self.ring_replicas = [r for _, r in ring]
        self.num_ranked = min(num_replicas, 1 + num_fallback_replicas)
        self.max_ongoing = max_ongoing_requests
        self.in_flight = [0] * num_replicas

    def ranked(self, rid: int) -> list[int]:
        """The owner of the prompt head's key, then its distinct clockwise successors."""
        head = self.workload.prompt_token_ids(rid)[: self.key_tokens]
        key_hash = self.hash64(",".join(map(str, head)).encode())
        start = bisect.bisect_right(self.ring_hashes, key_hash) % len(self.ring_hashes)
        ranked: list[int] = []
        for offset in range(len(self.ring_hashes)):
            replica = self.ring_replicas[(start + offset) % len(self.ring_hashes)]
            if replica not in ranked:
                ranked.append(replica)
                if len(ranked) == self.num_ranked:
                    break
        return ranked

    def route(self, rid: int, now_s: float, attempt: int, held_since_s: float) -> tuple[int, float]:
        for replica in self.ranked(rid):
            if self.in_flight[replica] < self.max_ongoing:
                self.in_flight[replica] += 1
                return replica, 0.0
        return HELD, min(0.025 * 2**attempt, 0.5)  # Serve's backoff sequence, capped

    def on_finish(self, rid: int, replica: int) -> None:
        self.in_flight[replica] -= 1


class ApproxPrefixIndex:
    """Router-side record of which worker was sent which block chains (LRU-capped per worker).

    Postings are router.prefix_index.HashPostings (slot = worker), so a longest-prefix
    search is O(prompt blocks) big-int ANDs plus numpy over the workers, however many
    workers share a prefix (sets per hash cost O(workers) per block).
    """

    def __init__(self, num_workers: int, max_blocks_per_worker: int) -> None:
        self.trees: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_workers)]
        self.sizes = np.zeros(num_workers, dtype=np.int64)  # len(trees[w])
        self.owners = HashPostings()
        self.max_blocks = max_blocks_per_worker

    def insert(self, worker: int, hashes: Sequence[int]) -> None:
        tree = self.trees[worker]
        owners = self.owners
        for h in hashes:
            if h in tree:
                tree.move_to_end(h)
            else:
                tree[h] = None
                owners.add(h, worker)
        while len(tree) > self.max_blocks:
            h, _ = tree.popitem(last=False)
            owners.discard(h, worker)
        self.sizes[worker] = len(tree)

    def overlaps(self, hashes: Sequence[int]) -> np.ndarray:
        """int64 [num_workers]: leading blocks of `hashes` in each worker's tree."""
        return self.owners.matched_blocks(hashes, len(self.trees))


class SGLangRouter(SimRouter):
    name = "sglang"
    tracks_progress = True

    def __init__(
        self,
        workload: Workload,
        num_replicas: int,
        max_blocks: int,
        seed: int,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
    ) -> None:
        self.workload = workload
        self.index = ApproxPrefixIndex(num_replicas, max_blocks)
        self.loads = np.zeros(num_replicas, dtype=np.int64)  # requests in flight from here
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.rng = random.Random(seed)

    def route(self, rid: int, now_s: float, attempt: int, held_since_s: float) -> tuple[int, float]:
        wl = self.workload
        num_prompt = wl.prompt_len_list[rid]
        hashes = wl.block_hashes(rid, num_prompt // wl.block_size)
        loads = self.loads
        max_load, min_load = int(loads.max()), int(loads.min())
        if (
            max_load - min_load > self.balance_abs_threshold
            and max_load > self.balance_rel_threshold * min_load
        ):
            worker = int(np.argmin(loads))
        else:
            overlaps = self.index.overlaps(hashes)
            best = int(overlaps.max())
            if best * wl.block_size > self.cache_threshold * num_prompt:
                ties = np.flatnonzero(overlaps == best)
                worker = int(ties[np.argmin(loads[ties])])  # least loaded, then lowest id
            else:
                sizes = self.index.sizes
                smallest = np.flatnonzero(sizes == sizes.min()).tolist()
                worker = self.rng.choice(smallest)
        self.index.insert(worker, hashes)
        loads[worker] += 1
        return worker, 0.0

    def on_finish(self, rid: int, replica: int) -> None:
        self.loads[replica] -= 1


class DynamoRouter(SimRouter):
    name = "dynamo"
    tracks_progress = True

    def __init__(
        self,
        workload: Workload,
        num_replicas: int,
        max_blocks: int,
        seed: int,
        overlap_weight: float = 1.0,
    ) -> None:
        self.workload = workload
        self.index = ApproxPrefixIndex(num_replicas, max_blocks)
        self.prefill_blocks = np.zeros(num_replicas)
        self.active_blocks = np.zeros(num_replicas)
        self.overlap_weight = overlap_weight
        self.inflight: dict[int, tuple[int, int]] = {}  # rid -> (new prefill blocks, blocks)
        self.rng = np.random.default_rng(seed)

    def route(self, rid: int, now_s: float, attempt: int, held_since_s: float) -> tuple[int, float]:
        wl = self.workload
        bs = wl.block_size
        num_prompt_blocks = -(-wl.prompt_len_list[rid] // bs)
        hashes = wl.block_hashes(rid, wl.prompt_len_list[rid] // bs)
        new_blocks = num_prompt_blocks - self.index.overlaps(hashes).astype(np.float64)
        cost = self.overlap_weight * (self.prefill_blocks + new_blocks) + self.active_blocks
        ties = np.flatnonzero(cost == cost.min())
        worker = int(ties[0] if len(ties) == 1 else self.rng.choice(ties))
        num_blocks = num_prompt_blocks + -(-wl.output_len_list[rid] // bs)
        num_new = int(new_blocks[worker])
        self.prefill_blocks[worker] += num_new
        self.active_blocks[worker] += num_blocks
        self.inflight[rid] = (num_new, num_blocks)
        self.index.insert(worker, hashes)
        return worker, 0.0

    def on_first_token(self, rid: int, replica: int) -> None:
        self.prefill_blocks[replica] -= self.inflight[rid][0]

    def on_finish(self, rid: int, replica: int) -> None:
        self.active_blocks[replica] -= self.inflight.pop(rid)[1]


def make_sim_router(
    name: str,
    workload: Workload,
    num_replicas: int,
    max_blocks: int,
    seed: int,
    router_config: RouterConfig | None = None,
) -> SimRouter:
    if name in REAL_POLICIES:
        base = router_config or RouterConfig(seed=seed)
        config = RouterConfig(**{**base.__dict__, "policy": name})
        return RealRouter(config, workload, num_replicas)
    if name in ("sglang", "dynamo"):  # router-side prefix trees of max_blocks per replica
        cls = SGLangRouter if name == "sglang" else DynamoRouter
        return cls(workload, num_replicas, max_blocks, seed)
    if name == "serve_consistent_hash":
        return ServeConsistentHashRouter(workload, num_replicas, key_tokens=workload.block_size)
    peers = {"random": RandomRouter, "round_robin": RoundRobinRouter, "serve_pow2": ServePow2Router}
    if name in peers:
        return peers[name](num_replicas, seed)
    raise ValueError(f"policy must be one of {ALL_POLICIES}, got {name!r}")
