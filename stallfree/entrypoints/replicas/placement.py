"""Which replica a request goes to.

cache_aware (the default) keeps, per replica, an approximate index of the prompts it was sent:
each prompt is cut into blocks of `prefix_block_chars` characters, and block i is remembered
as a hash of blocks 0..i, so a lookup walks the prompt's blocks until one is not there. A
request follows the replica that holds the longest run of its leading blocks when that run
covers at least `cache_threshold` of the prompt, since that replica's prefix cache most likely
still holds those tokens' KV; otherwise, and whenever the load is out of balance (the busiest
replica has more than `balance_abs_threshold` requests beyond the idlest and more than
`balance_rel_threshold` times as many), it goes to the least loaded replica. Load is what
the front has in flight on each replica; among equals, the replica that has been sent the
fewest requests wins, so sequential requests with new prompts spread too.

Only replicas whose process runs are chosen, and of those, the ones whose last `/health` probe
answered 200 while any does. The index is the front's guess, not the replicas' state: a replica's cache may have evicted
what the index remembers, and costs only a cache miss.
"""

from __future__ import annotations

import itertools
import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from stallfree.config.replicas import ReplicaConfig
from stallfree.entrypoints.router.pool import Server


class PrefixIndex:
    """The prompt blocks one replica was sent, as chained hashes, least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, chain: Sequence[int]) -> int:
        """How many leading blocks of `chain` this replica was sent."""
        for i, h in enumerate(chain):
            if h not in self._blocks:
                return i
        return len(chain)

    def insert(self, chain: Sequence[int]) -> None:
        for h in chain:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()


def block_chain(key: str, block_chars: int) -> list[int]:
    """The chained hashes of `key`'s whole blocks (a last, partial block is left out)."""
    chain: list[int] = []
    h = 0
    for start in range(0, len(key) - block_chars + 1, block_chars):
        h = hash((h, key[start : start + block_chars]))
        chain.append(h)
    return chain


def _text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return "".join(f"{v}," for v in value)  # token ids, written out
    return None


def prompt_key(body: dict[str, Any]) -> str | None:
    """What a request is placed by: a chat's messages as JSON (a shared system prompt is a
    shared prefix of it), a prompt's text or token ids (of a list of prompts, the first), or
    None when the body holds none of these."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return json.dumps(messages, ensure_ascii=False, separators=(",", ":"), default=str)
    for name in ("prompt", "text", "input_ids"):
        value = body.get(name)
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            value = value[0]
        text = _text(value)
        if text is not None:
            return text
    return None


@dataclass(slots=True, eq=False)
class Replica:
    """One engine behind the front: its server (URL and requests in flight), the index of
    what it was sent, and whether its process is still there."""

    index: int
    server: Server
    prefixes: PrefixIndex
    alive: bool = True
    answering: bool = True  # its /health answered 200 when last probed
    sent: int = 0  # requests placed on it

    @property
    def label(self) -> str:
        return str(self.index)


class NoReplica(Exception):
    """Every replica has exited."""


@dataclass(slots=True)
class Placement:
    replicas: list[Replica]
    settings: ReplicaConfig
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    def choose(self, key: str | None) -> tuple[Replica, str]:
        """The replica for a request placed by `key`, and why: "prefix" (it holds the
        longest prefix), "load" (least loaded) or "turn" (round robin)."""
        replica, reason = self._choose(key)
        replica.sent += 1
        return replica, reason

    def _choose(self, key: str | None) -> tuple[Replica, str]:
        alive = [r for r in self.replicas if r.alive]
        if not alive:
            raise NoReplica
        # a replica alive but not answering its /health (hung, or failing) is passed over
        # while another answers
        live = [r for r in alive if r.answering] or alive
        policy = self.settings.policy
        if policy == "round_robin":
            return live[next(self._turn) % len(live)], "turn"
        if policy == "least_load" or key is None:
            return _least_loaded(live), "load"
        chain = block_chain(key, self.settings.prefix_block_chars)
        chosen, reason = _least_loaded(live), "load"
        if chain and not self._out_of_balance(live):
            best = max(live, key=lambda r: r.prefixes.match(chain))
            matched = best.prefixes.match(chain)
            if matched and matched >= self.settings.cache_threshold * len(chain):
                chosen, reason = best, "prefix"
        chosen.prefixes.insert(chain)
        return chosen, reason

    def _out_of_balance(self, live: list[Replica]) -> bool:
        loads = [r.server.inflight for r in live]
        low, high = min(loads), max(loads)
        s = self.settings
        return high - low > s.balance_abs_threshold and high > s.balance_rel_threshold * low


def _least_loaded(live: list[Replica]) -> Replica:
    # ties: the replica sent the fewest requests, then the first
    return min(live, key=lambda r: (r.server.inflight, r.sent))
