"""Typed errors a kvfleet request can end with, besides ValueError (bad input) and
router.OverloadedError (not admitted).

Every request submitted through cluster.Client ends in exactly one of: a completion
(finish_reason "length" | "stop"), ValueError naming the bad field, OverloadedError, or
a ReplicaError below. A request that has streamed no token yet when its replica fails is
resubmitted through the router first (see Client.stream); these errors reach the caller
only when tokens were already streamed (they are then in `token_ids`) or when the
retries are spent.

Their constructor arguments are plain values, so they pickle across Ray processes.
"""

from __future__ import annotations

from collections.abc import Sequence


class ReplicaError(RuntimeError):
    """The replica serving a request failed while the request was in flight.

    token_ids holds the tokens the caller had already received for the request (the
    partial output, possibly empty); num_attempts how many replicas were tried.
    """

    def __init__(
        self,
        message: str,
        request_id: str = "",
        replica_id: str = "",
        token_ids: Sequence[int] = (),
        num_attempts: int = 1,
    ) -> None:
        super().__init__(message, request_id, replica_id, list(token_ids), num_attempts)
        self.message = message
        self.request_id = request_id
        self.replica_id = replica_id
        self.token_ids = list(token_ids)
        self.num_attempts = num_attempts

    def __str__(self) -> str:
        return (
            f"{self.message} (request {self.request_id!r}, replica {self.replica_id!r}, "
            f"{len(self.token_ids)} tokens streamed, {self.num_attempts} attempt(s))"
        )

    def with_progress(
        self, request_id: str, token_ids: Sequence[int], num_attempts: int
    ) -> ReplicaError:
        """The same error, as raised to the caller of request_id after token_ids."""
        return type(self)(self.message, request_id, self.replica_id, token_ids, num_attempts)


class ReplicaDiedError(ReplicaError):
    """The replica is gone or unreachable: its actor died, its node was lost, or its
    carrier stream sent nothing (not even a heartbeat) for the carrier timeout."""
