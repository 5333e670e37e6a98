"""RouteRequest: what the router knows of one request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from replica.hashing import ROOT_HASH, prefix_block_hashes


@dataclass(frozen=True)
class RouteRequest:
    """A request as routing sees it: its id, its prompt (or only its length), max_tokens.

    Give prompt_token_ids when known (prefix routing needs them); otherwise
    num_prompt_tokens alone sizes the admission check. Neither: route by load alone.
    A group of requests placed together (one call carrying several) routes as its first
    request, whose prompt gives the prefix affinity, with group_prompt_lens the prompt
    lengths of the others: their blocks add to the group's need (num_prompt_blocks), and
    max_tokens is the group's sum.
    root_hash: the parent of the prompt's first block, replica.hashing.root_hash of the
    deployment's prefix_salt and the request's cache_salt, as the replica hashes it
    (cluster.request_router sets it); matching under another root finds nothing.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...] = ()
    num_prompt_tokens: int = 0
    max_tokens: int = 0
    group_prompt_lens: tuple[int, ...] = ()
    root_hash: int = ROOT_HASH
    _hashes_by_block_size: dict[int, tuple[int, ...]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_token_ids, tuple):
            object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        if self.num_prompt_tokens < 0:
            raise ValueError(f"num_prompt_tokens must be >= 0, got {self.num_prompt_tokens}")
        if not isinstance(self.group_prompt_lens, tuple):
            object.__setattr__(self, "group_prompt_lens", tuple(self.group_prompt_lens))
        if any(n < 0 for n in self.group_prompt_lens):
            raise ValueError(f"group_prompt_lens must be >= 0, got {self.group_prompt_lens}")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        num_ids = len(self.prompt_token_ids)
        if num_ids and self.num_prompt_tokens not in (0, num_ids):
            raise ValueError(
                f"num_prompt_tokens ({self.num_prompt_tokens}) disagrees with "
                f"len(prompt_token_ids) ({num_ids})"
            )
        if num_ids:
            object.__setattr__(self, "num_prompt_tokens", num_ids)

    @classmethod
    def with_block_hashes(
        cls,
        request_id: str,
        num_prompt_tokens: int,
        block_size: int,
        block_hashes: Sequence[int],
        max_tokens: int = 0,
    ) -> RouteRequest:
        """A request whose prompt is known only by its full blocks' chained hashes at one
        block size (the simulator's traces name blocks without materializing tokens)."""
        if len(block_hashes) != num_prompt_tokens // block_size:
            raise ValueError(
                f"block_hashes: {len(block_hashes)} hashes for {num_prompt_tokens} tokens "
                f"of block size {block_size}"
            )
        request = cls(request_id, num_prompt_tokens=num_prompt_tokens, max_tokens=max_tokens)
        request._hashes_by_block_size[block_size] = tuple(block_hashes)
        return request

    @classmethod
    def from_tokens(
        cls, request_id: str, prompt_token_ids: Sequence[int], max_tokens: int = 0
    ) -> RouteRequest:
        return cls(request_id, tuple(prompt_token_ids), max_tokens=max_tokens)

    @property
    def knows_prompt(self) -> bool:
        """Whether prefix matching has anything to match: token ids or block hashes."""
        return bool(self.prompt_token_ids) or any(self._hashes_by_block_size.values())

    def num_prompt_blocks(self, block_size: Any) -> Any:
        """KV blocks the prompt (a group's prompts) occupies on a replica with this block
        size; block_size may be a numpy array of them (one count per replica)."""
        num_blocks = -(-self.num_prompt_tokens // block_size)
        for num_tokens in self.group_prompt_lens:
            num_blocks = num_blocks + -(-num_tokens // block_size)
        return num_blocks

    def prompt_block_hashes(self, block_size: int) -> tuple[int, ...]:
        """Chained hashes of the prompt's full blocks, computed once per block size."""
        hashes = self._hashes_by_block_size.get(block_size)
        if hashes is None:
            hashes = tuple(prefix_block_hashes(self.prompt_token_ids, block_size, self.root_hash))
            self._hashes_by_block_size[block_size] = hashes
        return hashes

    def leading_block_hash(self, num_tokens: int, block_size: int) -> int | None:
        """The chained hash of the last full block within the prompt's first num_tokens
        tokens, which names that whole prefix; None when there is no such block (or the
        prompt is not known at this block size)."""
        depth = min(num_tokens, self.num_prompt_tokens) // block_size
        hashes = self.prompt_block_hashes(block_size) if depth else ()
        return hashes[depth - 1] if 0 < depth <= len(hashes) else None
