"""The front's placement and metrics merge, without processes: the prefix index, the choice of
a replica under each policy, and the merge of the replicas' expositions."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from stallfree.config.replicas import ReplicaConfig
from stallfree.entrypoints.replicas.metrics import ReplicaMetrics, merge_expositions
from stallfree.entrypoints.replicas.placement import (
    NoReplica,
    Placement,
    PrefixIndex,
    Replica,
    block_chain,
    prompt_key,
)
from stallfree.entrypoints.router.pool import Server

SHARED = "You are a careful assistant. Answer in one short sentence. " * 3


def placement(n: int = 2, **settings: object) -> Placement:
    replicas = [
        Replica(i, Server(f"http://127.0.0.1:{9000 + i}", "replica"), PrefixIndex(1024))
        for i in range(n)
    ]
    return Placement(replicas, ReplicaConfig(prefix_block_chars=8, **settings))


def test_block_chain_hashes_whole_blocks_chained():
    assert block_chain("abcdefg", 8) == []  # a partial block is left out
    ab = block_chain("aaaaaaaabbbbbbbb", 8)
    ba = block_chain("bbbbbbbbaaaaaaaa", 8)
    assert len(ab) == len(ba) == 2
    # block i stands for blocks 0..i: the same text after another prefix is another block
    assert ab[1] != ba[0] and ab[0] != ba[1]
    assert block_chain("aaaaaaaabbbbbbbbcc", 8) == ab


def test_prefix_index_matches_leading_blocks_and_forgets_the_oldest():
    index = PrefixIndex(capacity=3)
    first = block_chain("a" * 8 + "b" * 8 + "c" * 8, 8)
    index.insert(first)
    assert index.match(first) == 3
    assert index.match(block_chain("a" * 8 + "x" * 16, 8)) == 1
    index.insert(block_chain("z" * 8, 8))  # over capacity: the least recently used goes
    assert len(index) == 3
    assert index.match(first) == 0


@pytest.mark.parametrize(
    ("body", "key"),
    [
        ({"prompt": "hello"}, "hello"),
        ({"prompt": ["first", "second"]}, "first"),
        ({"prompt": [1, 22, 3]}, "1,22,3,"),
        ({"prompt": [[5, 6], [7]]}, "5,6,"),
        ({"text": "native"}, "native"),
        ({"input_ids": [9]}, "9,"),
        ({"messages": [{"role": "user", "content": "hi"}]}, '[{"role":"user","content":"hi"}]'),
        ({"prompt": 3}, None),
        ({"model": "m"}, None),
    ],
)
def test_prompt_key(body, key):
    assert prompt_key(body) == key


def test_a_shared_prefix_follows_its_replica_and_new_prompts_spread():
    p = placement()
    choices = [p.choose(SHARED + f"question {i}?") for i in range(5)]
    assert [c[1] for c in choices] == ["load", "prefix", "prefix", "prefix", "prefix"]
    assert len({c[0].index for c in choices}) == 1
    # new prompts, one after another (nothing in flight): to the replica sent fewer requests
    other = [p.choose(f"{i} another topic entirely, nothing shared")[0].index for i in range(6)]
    assert other == [1, 1, 1, 1, 1, 0]
    assert [r.sent for r in p.replicas] == [6, 5]


def test_the_least_loaded_replica_wins_when_no_prefix_covers_enough():
    p = placement(cache_threshold=0.9)
    first, _ = p.choose(SHARED + "a")
    first.server.inflight = 3
    # a long new suffix: the shared blocks cover under 90% of the prompt
    chosen, reason = p.choose(SHARED + "b" * len(SHARED) * 2)
    assert (chosen.index, reason) == (1 - first.index, "load")


def test_load_out_of_balance_overrides_the_prefix():
    p = placement(balance_abs_threshold=2, balance_rel_threshold=1.5)
    first, _ = p.choose(SHARED + "a")
    first.server.inflight = 3  # 3 - 0 > 2 and 3 > 1.5 * 0
    assert p.choose(SHARED + "b")[0] is not first
    first.server.inflight = 2  # within the absolute threshold: the prefix wins again
    assert p.choose(SHARED + "c") == (first, "prefix")


def test_exited_replicas_are_never_chosen():
    p = placement()
    first, _ = p.choose(SHARED)
    first.alive = False
    for policy in ("cache_aware", "least_load", "round_robin"):
        p.settings = ReplicaConfig(policy=policy)
        assert all(p.choose(SHARED)[0] is not first for _ in range(3))
    for r in p.replicas:
        r.alive = False
    with pytest.raises(NoReplica):
        p.choose(SHARED)


def test_a_replica_not_answering_is_passed_over_while_another_answers():
    p = placement()
    first, _ = p.choose(SHARED)
    first.answering = False
    assert all(p.choose(SHARED)[0] is not first for _ in range(3))
    for r in p.replicas:
        r.answering = False  # none answers (a drain, say): any live one will do
    assert {p.choose(f"{i} new")[0].index for i in range(4)} == {0, 1}


def test_round_robin_and_least_load_ignore_prefixes():
    p = placement(3, policy="round_robin")
    assert [p.choose(SHARED) for _ in range(4)] == [(p.replicas[i], "turn") for i in (0, 1, 2, 0)]
    p = placement(2, policy="least_load")
    p.replicas[0].server.inflight = 1
    assert p.choose(SHARED) == (p.replicas[1], "load")


def _exposition(engine: str, running: int) -> bytes:
    return (
        f"# HELP stallfree:num_requests_running Requests.\n"
        f"# TYPE stallfree:num_requests_running gauge\n"
        f'stallfree:num_requests_running{{engine="{engine}"}} {running}.0\n'
        f"# HELP stallfree:steps_total Batches.\n"
        f"# TYPE stallfree:steps_total counter\n"
        f'stallfree:steps_total{{engine="{engine}"}} 7.0\n'
    ).encode()


def test_merged_expositions_declare_each_family_once_with_every_series():
    merged = merge_expositions(
        [_exposition("0", 1), _exposition("1", 2), ReplicaMetrics(["0", "1"]).render()]
    )
    text = merged.decode()
    helps = [line for line in text.splitlines() if line.startswith("# HELP")]
    assert len(helps) == len(set(helps))
    families = {f.name: f for f in text_string_to_metric_families(text)}
    running = families["stallfree:num_requests_running"].samples
    assert {(s.labels["engine"], s.value) for s in running} == {("0", 1.0), ("1", 2.0)}
    assert len(families["stallfree:steps"].samples) == 2
    up = families["stallfree:replica_up"].samples
    assert {s.labels["engine"] for s in up} == {"0", "1"}
    assert merge_expositions([]) == b""
