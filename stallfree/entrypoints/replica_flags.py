"""Data-parallel replicas' rows of the flag table on `serve` (vLLM's `--data-parallel-size`,
SGLang's `--dp-size`), filling the `replicas` section."""

from __future__ import annotations

from stallfree.entrypoints.flags import Table, flag, positive_int

# fmt: off
REPLICA_FLAGS: Table = (
    ("data-parallel replicas (docs/replicas.md)", [
        flag("--data-parallel-size", "--dp-size", "-dp", dest="data_parallel_size",
             type=positive_int, metavar="N", sets="replicas.data_parallel_size",
             help="run N engines, each in its own process with its own scheduler and KV pool "
             "(and --tp-size ranks of its own), behind one HTTP front that places each request"),
        flag("--replica-policy", choices=["cache_aware", "least_load", "round_robin"],
             sets="replicas.policy",
             help="how the front places a request on a replica: cache_aware follows the "
             "longest prompt prefix a replica has seen unless the load is out of balance"),
    ]),
)
# fmt: on
