"""A multi-node group beyond loopback only on a network said to be trusted (issue 42, finding
15): its ranks unpickle the step messages rank 0 sends, so whoever reaches `dist_init_addr`
could run code on every node. Loopback addresses meet as before; any other address or name is
refused at start unless `parallel.trusted_network` (`--dist-trusted-network`) is set."""

from __future__ import annotations

import pytest

from tests.engine_util import engine_config


@pytest.mark.parametrize(
    "addr", ["127.0.0.1:29500", "tcp://127.0.0.2:1", "[::1]:29500", "localhost:1"]
)
def test_loopback_meeting_points_need_no_flag(llama: str, addr: str) -> None:
    cfg = engine_config(llama, parallel={"tp_size": 2, "nnodes": 2, "dist_init_addr": addr})
    assert not cfg.parallel.trusted_network


@pytest.mark.parametrize(
    "addr", ["10.0.0.1:29500", "tcp://node0:29500", "[fd00::1]:1", "0.0.0.0:1"]
)
def test_beyond_loopback_is_refused_unless_trusted(llama: str, addr: str) -> None:
    parallel = {"tp_size": 2, "nnodes": 2, "dist_init_addr": addr}
    with pytest.raises(ValueError, match="--dist-trusted-network"):
        engine_config(llama, parallel=parallel)
    cfg = engine_config(llama, parallel={**parallel, "trusted_network": True})
    assert cfg.parallel.dist_init_addr == addr
