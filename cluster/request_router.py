"""The Ray Serve request router that puts router/ policies and admission in front of replicas.

Contract with the replica deployment:
- its `record_routing_stats()` returns {"stats": ReplicaStats.to_msgpack()}
  (use encode_routing_stats); the stats' timestamp_s is time.time() on the replica.
- its handler is called with the request as the first positional argument (or
  as kwarg "request", or as keyword arguments): a dict or an object carrying
  "prompt_token_ids" (list[int]) or "num_prompt_tokens" (int), and "max_tokens"
  (at top level or inside "sampling_params"); or with a list of such requests as the
  first positional argument (a group placed together: route_group_from_call).
  Anything else routes by load alone.

Wiring: request_router_config(RouterConfig(...)) -> RequestRouterConfig, passed as
`request_router_config=` to `@serve.deployment` / `.options()`. Ray Serve hands
its request_router_kwargs (dataclasses.asdict of the RouterConfig) to
KVFleetRequestRouter.initialize_state in every handle and proxy.
serve_request_router_config("serve-...") does the same for Ray Serve's own routers,
the peers kvfleet's policies are measured against.

All routing logic lives in router/; this module only translates Serve's types.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from ray.serve.config import RequestRouterConfig
from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cluster import live_stats, routing_trace
from cluster.messages import GroupRefusedError
from replica.hashing import root_hash
from replica.stats import ReplicaStats
from router import Admission, OverloadedError, RouterConfig, RouteRequest

logger = logging.getLogger(__name__)

ROUTING_STATS_KEY = "stats"
REQUEST_ROUTER_CLASS_PATH = "cluster.request_router.KVFleetRequestRouter"
# ClusterConfig.router names of Ray Serve's own routers -> their class paths (Ray 2.60).
SERVE_ROUTER_CLASS_PATHS = {
    "serve-pow2": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
    "serve-round-robin": "ray.serve.experimental.round_robin_router:RoundRobinRouter",
    "serve-consistent-hash": "cluster.request_router.PromptHashRouter",
}
DEFAULT_NUM_PREFIX_TOKENS = 64


def encode_routing_stats(stats: ReplicaStats) -> dict[str, bytes]:
    """What the deployment's record_routing_stats() returns."""
    return {ROUTING_STATS_KEY: stats.to_msgpack()}


def decode_routing_stats(routing_stats: Mapping[str, Any] | None) -> ReplicaStats | None:
    """ReplicaStats from a replica's routing_stats, or None when absent or unreadable."""
    data = (routing_stats or {}).get(ROUTING_STATS_KEY)
    if not isinstance(data, bytes | bytearray):
        return None
    try:
        return ReplicaStats.from_msgpack(data)
    except (ValueError, TypeError) as e:
        logger.warning("Unreadable routing stats (%s); routing as if unknown.", e)
        return None


def _field(payload: Any, name: str) -> Any:
    if isinstance(payload, Mapping):
        return payload.get(name)
    return getattr(payload, name, None)


def _as_token_ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, list | tuple) and all(isinstance(t, int) for t in value):
        return tuple(value)
    return ()


def _as_count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def route_request_from_call(
    request_id: str, args: Sequence[Any], kwargs: Mapping[str, Any], prefix_salt: str = ""
) -> RouteRequest:
    """The RouteRequest for a handle call; tolerant: no prompt info means route by load.
    Its prompt hashes from root_hash(prefix_salt, the request's cache_salt), as the
    replica's engine hashes it (replica.hashing)."""
    payloads = [*args[:1], kwargs.get("request"), kwargs]
    for payload in payloads:
        if payload is None:
            continue
        token_ids = _as_token_ids(_field(payload, "prompt_token_ids"))
        num_prompt_tokens = len(token_ids) or _as_count(_field(payload, "num_prompt_tokens"))
        if not num_prompt_tokens:
            continue
        max_tokens = _as_count(_field(payload, "max_tokens")) or _as_count(
            _field(_field(payload, "sampling_params"), "max_tokens")
        )
        root = root_hash(prefix_salt, _cache_salt(payload))
        return RouteRequest(request_id, token_ids, num_prompt_tokens, max_tokens, root_hash=root)
    return RouteRequest(request_id)


def _cache_salt(payload: Any) -> str | None:
    # The wire's params (SamplingParams.to_dict) or a call's sampling_params; a malformed
    # one is the replica's to refuse, so routing takes it as no salt.
    for params in (_field(payload, "params"), _field(payload, "sampling_params")):
        salt = _field(params, "cache_salt") if params is not None else None
        if isinstance(salt, str) and salt:
            return salt
    return None


def route_group_from_call(
    request_id: str, payloads: Sequence[Any], prefix_salt: str = ""
) -> RouteRequest:
    """The RouteRequest of a group call (LLMServer.submit_group: a list of requests placed
    together): the first request's prompt for prefix affinity, every request's prompt
    blocks and max_tokens summed, so admission holds back or rejects the whole group."""
    members = [
        route_request_from_call(request_id, (payload,), {}, prefix_salt) for payload in payloads
    ]
    if not members:
        return RouteRequest(request_id)
    first = members[0]
    return RouteRequest(
        request_id,
        first.prompt_token_ids,
        first.num_prompt_tokens,
        sum(m.max_tokens for m in members),
        tuple(m.num_prompt_tokens for m in members[1:]),
        root_hash=first.root_hash,
    )


def _route_request(pending_request: PendingRequest | None, prefix_salt: str = "") -> RouteRequest:
    """Keyed by kvfleet's request id when the call carries one (a SubmitRequest's wire
    dict: the id the replica's ack names; a group's first one), else by Serve's internal
    request id."""
    if pending_request is None:
        return RouteRequest("")
    args = pending_request.args
    group = args[0] if args and isinstance(args[0], list) else None
    if group is not None:
        first = group[0] if group and isinstance(group[0], dict) else {}
        request_id = first.get("request_id")
        if not isinstance(request_id, str) or not request_id:
            request_id = pending_request.metadata.internal_request_id
        return route_group_from_call(request_id, group, prefix_salt)
    request_id = args[0].get("request_id") if args and isinstance(args[0], dict) else None
    if not isinstance(request_id, str) or not request_id:
        request_id = pending_request.metadata.internal_request_id
    return route_request_from_call(request_id, args, pending_request.kwargs, prefix_salt)


class KVFleetRequestRouter(RequestRouter):
    """Ray Serve router: router.Admission (policy + reservations + overload) over replica stats.

    Algorithm, per choose_replicas call: decode each candidate's routing_stats
    (cached per replica while the bytes object is unchanged, so Admission's
    fleet sees the same snapshot object and skips it); where this process's
    carriers brought a newer snapshot of the replica (cluster.live_stats), take
    its load numbers with Serve's prefix hashes; build the RouteRequest from the
    call's arguments, and ask Admission.admit.
      - admitted: reserve on the first choice, return the ranked tiers (Serve
        then probes queue lengths within a tier and falls to the next tier);
        should_backoff is set so Serve backs off if every tier refuses.
      - held: sleep the suggested backoff (self.sleep, asyncio.sleep; never a busy loop)
        and return no tiers, so Serve calls again and admission re-evaluates.
      - OverloadedError (reject mode, or hold exhausted): resolve the pending
        request's future with the error, so the caller's response raises it,
        and return one tier, which makes Serve's loop see the done future and stop.
      - a submit group (route_group_from_call) that is not admitted at once is
        neither held nor rejected: GroupRefusedError, and the caller sends its
        requests one by one, so admission decides for each as it would have alone.
    Invariant: every routed request ends in a replica or an OverloadedError; a
    held request waits at most RouterConfig.max_hold_s.
    Failure: replicas without readable stats are routed to only as a last tier.
    """

    def initialize_state(self, **kwargs: Any) -> None:
        self.router_config = RouterConfig(**kwargs)
        self.admission = Admission(self.router_config)
        # Reservations end at the first snapshot stamped after the engine admitted the
        # request, which the replica's ack tells this process (cluster.live_stats).
        self.admission.reservations.admitted_at = live_stats.admitted_at
        self.clock: Callable[[], float] = time.time
        self.sleep: Callable[[float], Awaitable[None]] = asyncio.sleep  # tests inject both
        # request id (route_request_from_call's) -> (first held at, attempts so far)
        self.holds: dict[str, tuple[float, int]] = {}
        # Prompt tokens of the held requests (keyed as holds), and their sum: work
        # ahead of every new request (router.queue_wait).
        self.held_tokens: dict[str, int] = {}
        self.num_held_tokens = 0
        # replica unique id -> (routing stats bytes, decoded stats)
        self.decoded: dict[str, tuple[bytes, ReplicaStats]] = {}
        # replica unique id -> (Serve's snapshot, carrier snapshot, merged): see merge()
        self.merged: dict[str, tuple[ReplicaStats | None, ReplicaStats, ReplicaStats]] = {}

    def collect_stats(
        self, replicas: Sequence[RunningReplica]
    ) -> tuple[list[ReplicaStats], list[str]]:
        """Decoded stats keyed by Serve's replica id, and the ids with no stats."""
        known, unknown = [], []
        for replica in replicas:
            replica_id = replica.replica_id.unique_id
            stats = self.serve_stats(replica_id, replica.routing_stats)
            live = live_stats.latest(replica_id)
            if live is not None and (stats is None or live.timestamp_s > stats.timestamp_s):
                stats = self.merge(replica_id, stats, live)
            if stats is None:
                unknown.append(replica_id)
            else:
                known.append(stats)
        if len(self.decoded) + len(self.merged) > 4 * len(replicas) + 16:  # replicas left
            current = {r.replica_id.unique_id for r in replicas}
            self.decoded = {k: v for k, v in self.decoded.items() if k in current}
            self.merged = {k: v for k, v in self.merged.items() if k in current}
        return known, unknown

    def serve_stats(
        self, replica_id: str, routing_stats: Mapping[str, Any] | None
    ) -> ReplicaStats | None:
        """The snapshot Serve delivered, decoded once per bytes object it hands over."""
        data = (routing_stats or {}).get(ROUTING_STATS_KEY)
        cached = self.decoded.get(replica_id)
        if cached is not None and cached[0] is data:
            return cached[1]
        stats = decode_routing_stats(routing_stats)
        if stats is not None:
            stats = dataclasses.replace(stats, replica_id=replica_id)
            self.decoded[replica_id] = (data, stats)
        return stats

    def merge(
        self, replica_id: str, serve: ReplicaStats | None, live: ReplicaStats
    ) -> ReplicaStats:
        """The carrier's newer load numbers with Serve's prefix hashes (cluster.live_stats);
        the same object while neither input changes, so the fleet skips it."""
        cached = self.merged.get(replica_id)
        if cached is not None and cached[0] is serve and cached[1] is live:
            return cached[2]
        hashes = serve.cached_prefix_hashes if serve is not None else ()
        stats = dataclasses.replace(live, replica_id=replica_id, cached_prefix_hashes=hashes)
        self.merged[replica_id] = (serve, live, stats)
        return stats

    def forget_abandoned_holds(self, now_s: float) -> None:
        # A request cancelled between two routing attempts never comes back to clear its entry.
        config = self.router_config
        horizon_s = now_s - config.max_hold_s - 2 * config.backoff_max_s
        if self.holds and min(since_s for since_s, _ in self.holds.values()) < horizon_s:
            self.holds = {k: v for k, v in self.holds.items() if v[0] >= horizon_s}
            for request_id in [r for r in self.held_tokens if r not in self.holds]:
                self.num_held_tokens -= self.held_tokens.pop(request_id)

    def hold(self, request: RouteRequest, since_s: float, attempt: int) -> None:
        if request.request_id not in self.held_tokens:
            num_tokens = request.num_prompt_tokens + sum(request.group_prompt_lens)
            self.held_tokens[request.request_id] = num_tokens
            self.num_held_tokens += num_tokens
        self.holds[request.request_id] = (since_s, attempt)

    def unhold(self, request_id: str) -> None:
        self.holds.pop(request_id, None)
        self.num_held_tokens -= self.held_tokens.pop(request_id, 0)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None and pending_request.future.done():
            # Its caller went away (or it is settled): it reaches no replica, and it is
            # no longer work ahead of anyone.
            self.unhold(_route_request(pending_request).request_id)
            return [candidate_replicas]
        now_s = self.clock()
        self.forget_abandoned_holds(now_s)
        request = _route_request(pending_request, self.router_config.prefix_salt)
        stats, unknown = self.collect_stats(candidate_replicas)
        held_since_s, attempt = self.holds.get(request.request_id, (None, 0))
        num_held_tokens = self.num_held_tokens - self.held_tokens.get(request.request_id, 0)
        try:
            decision = self.admission.admit(
                stats,
                request,
                now_s,
                unknown_replica_ids=unknown,
                attempt=attempt,
                held_since_s=held_since_s,
                num_held_tokens=num_held_tokens,
            )
            if request.group_prompt_lens and not decision.admitted:
                # Not held: its requests go again one by one (GroupRefusedError).
                raise GroupRefusedError(decision.reason or "the group does not fit")
        except OverloadedError as error:
            if request.group_prompt_lens and not isinstance(error, GroupRefusedError):
                error = GroupRefusedError(error.reason)
            self.unhold(request.request_id)
            self.admission.release(request.request_id)
            if pending_request is None:
                raise
            pending_request.future.set_exception(error)
            # Serve (2.60, pinned) drops a request from this index only when it
            # fulfills or cancels it; a request resolved with an error would stay.
            self._remove_pending_request_from_indices(pending_request)
            return [candidate_replicas[:1]]

        if not decision.admitted:
            self.hold(request, now_s if held_since_s is None else held_since_s, attempt + 1)
            if pending_request is not None:
                pending_request.routing_context.should_backoff = False
            try:
                await self.sleep(decision.retry_after_s)
            except asyncio.CancelledError:
                self.unhold(request.request_id)
                raise
            return []

        self.unhold(request.request_id)
        self.admission.reserve(request, decision.tiers[0][0], now_s)
        if routing_trace.is_enabled():
            summaries = {replica_id: stats for replica_id, (_, stats) in self.decoded.items()}
            routing_trace.record(request, decision, now_s, summaries, self.router_config, attempt)
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        tiers = [[by_id[i] for i in tier if i in by_id] for tier in decision.tiers]
        return [tier for tier in tiers if tier]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        # Serve calls this only with strict max_ongoing_requests, once the replica
        # accepted the call: it moves the reservation made in choose_replicas if
        # Serve fell to a lower tier, keeping its time (re-stamping it now would
        # outlive the snapshot that already counts the request).
        self.admission.confirm(_route_request(pending_request), replica_id.unique_id)


def request_router_config(
    router_config: RouterConfig,
    *,
    stats_period_s: float = 0.1,
    stats_timeout_s: float = 1.0,
) -> RequestRouterConfig:
    """The RequestRouterConfig that puts KVFleetRequestRouter in front of a deployment.

    stats_period_s is how often Serve's controller calls record_routing_stats on
    each replica; RouterConfig.stats_max_age_s should be several periods.
    The router's backoff after a refused tier follows the RouterConfig's backoff.
    """
    if stats_period_s * 2 > router_config.stats_max_age_s:
        raise ValueError(
            f"stats_period_s ({stats_period_s}) must be at most half of "
            f"RouterConfig.stats_max_age_s ({router_config.stats_max_age_s})"
        )
    return RequestRouterConfig(
        request_router_class=REQUEST_ROUTER_CLASS_PATH,
        request_router_kwargs=dataclasses.asdict(router_config),
        request_routing_stats_period_s=stats_period_s,
        request_routing_stats_timeout_s=stats_timeout_s,
        initial_backoff_s=router_config.backoff_initial_s,
        backoff_multiplier=router_config.backoff_multiplier,
        max_backoff_s=router_config.backoff_max_s,
    )


def prompt_hash_key(
    args: Sequence[Any], kwargs: Mapping[str, Any], num_prefix_tokens: int
) -> str | None:
    """The consistent-hash key of a call: its first num_prefix_tokens prompt token ids
    (a group call's: its first request's)."""
    if args and isinstance(args[0], list):
        prompt = route_group_from_call("", args[0]).prompt_token_ids
    else:
        prompt = route_request_from_call("", args, kwargs).prompt_token_ids
    if not prompt:
        return None
    return "prompt:" + ",".join(map(str, prompt[:num_prefix_tokens]))


class PromptHashRouter(ConsistentHashRouter):
    """Ray Serve's ConsistentHashRouter, keyed by the prompt's first tokens.

    Algorithm: Serve's hash ring with virtual nodes (its own code, unchanged); the
    key is the call's session_id when one is set (Serve's own key: the HTTP
    x-session-id header, or handle.options(session_id=...)), else the first
    num_prefix_tokens prompt token ids, so requests sharing that prefix land on the
    same replica (prefix-cache affinity without any stats), else Serve's fallback,
    the internal request id (uniform spread).
    Invariant: the same key and the same replica set give the same replica.
    Failure: no load signal at all; a hot prefix stays on its replica (and its
    num_fallback_replicas successors once that replica refuses new requests).
    """

    def initialize_state(self, **kwargs: Any) -> None:
        num_prefix_tokens = kwargs.pop("num_prefix_tokens", DEFAULT_NUM_PREFIX_TOKENS)
        if (
            not isinstance(num_prefix_tokens, int)
            or isinstance(num_prefix_tokens, bool)
            or num_prefix_tokens < 1
        ):
            raise ValueError(
                f"num_prefix_tokens must be a positive integer, got {num_prefix_tokens!r}"
            )
        self.num_prefix_tokens = num_prefix_tokens
        super().initialize_state(**kwargs)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None and not pending_request.metadata.session_id:
            key = prompt_hash_key(
                pending_request.args, pending_request.kwargs, self.num_prefix_tokens
            )
            if key is not None:
                # A copy: the caller's request keeps its metadata; future and
                # routing context are shared, so Serve's bookkeeping is unchanged.
                metadata = dataclasses.replace(pending_request.metadata, session_id=key)
                pending_request = dataclasses.replace(pending_request, metadata=metadata)
        return await super().choose_replicas(candidate_replicas, pending_request)


def serve_request_router_config(
    router: str,
    *,
    stats_period_s: float = 0.1,
    stats_timeout_s: float = 1.0,
    num_prefix_tokens: int = DEFAULT_NUM_PREFIX_TOKENS,
) -> RequestRouterConfig:
    """The RequestRouterConfig of one of Ray Serve's own routers (ClusterConfig.router "serve-*").

    Routing stats are still collected every stats_period_s (unused by these routers),
    so the controller does the same work as with a kvfleet router and only the
    decision differs.
    """
    if router not in SERVE_ROUTER_CLASS_PATHS:
        raise ValueError(f"router must be one of {tuple(SERVE_ROUTER_CLASS_PATHS)}, got {router!r}")
    kwargs: dict[str, Any] = {}
    if router == "serve-consistent-hash":
        kwargs["num_prefix_tokens"] = num_prefix_tokens
    return RequestRouterConfig(
        request_router_class=SERVE_ROUTER_CLASS_PATHS[router],
        request_router_kwargs=kwargs,
        request_routing_stats_period_s=stats_period_s,
        request_routing_stats_timeout_s=stats_timeout_s,
    )
