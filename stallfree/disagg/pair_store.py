"""The rendezvous of one pair's process group, kept by the prefill server and reached by the
decode side only through the authenticated bootstrap endpoint (no open `TCPStore`: nobody else
can list, read or write a pair's keys).

gloo and NCCL meet through a `torch.distributed.Store`: each rank writes its address under a key
and waits for the other's. `MemoryStore` is the prefill's (rank 0's) store of one pair, in its
memory; `HttpStore` is the decode side's (rank 1's) view of it, over
`/bootstrap/pairs/{pair_id}/store` (values in base64). A key is written once (nobody can overwrite rank 0's
address), a pair holds a handful of small keys, and every wait ends at the pair's join deadline.
"""

from __future__ import annotations

import base64
import datetime
import threading
import time
from typing import Any

import torch.distributed as dist

MAX_KEYS = 16
MAX_KEY_LEN = 256
MAX_VALUE_BYTES = 4096
STORE_POLL_S = 0.01


class StoreError(RuntimeError):
    """A store call the pair's rendezvous does not allow, or one that timed out."""


def _key(key: str) -> str:
    if not 0 < len(key) <= MAX_KEY_LEN:
        raise StoreError(f"a rendezvous key is 1 to {MAX_KEY_LEN} characters")
    return key


def _value(value: Any) -> bytes:
    data = value.encode() if isinstance(value, str) else bytes(value)
    if len(data) > MAX_VALUE_BYTES:
        raise StoreError(f"a rendezvous value is at most {MAX_VALUE_BYTES} bytes")
    return data


class MemoryStore(dist.Store):
    """One pair's keys, written once each, in the prefill server's memory."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__()
        self.timeout_s = timeout_s
        self._values: dict[str, bytes] = {}
        self._changed = threading.Condition()

    def set(self, key: str, value: Any) -> None:
        key, data = _key(key), _value(value)
        with self._changed:
            if key in self._values:
                raise StoreError(f"rendezvous key {key!r} is written already")
            if len(self._values) >= MAX_KEYS:
                raise StoreError(f"a pair's rendezvous holds at most {MAX_KEYS} keys")
            self._values[key] = data
            self._changed.notify_all()

    def peek(self, key: str) -> bytes | None:
        with self._changed:
            return self._values.get(key)

    def get(self, key: str) -> bytes:
        self.wait([key])
        with self._changed:
            return self._values[key]

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        limit = self.timeout_s if timeout is None else min(timeout.total_seconds(), self.timeout_s)
        with self._changed:
            if not self._changed.wait_for(lambda: all(k in self._values for k in keys), limit):
                raise StoreError(f"the pair's peer did not join within {limit:g} s")

    def check(self, keys: list[str]) -> bool:
        with self._changed:
            return all(k in self._values for k in keys)

    def add(self, key: str, amount: int) -> int:
        raise StoreError("a pair's rendezvous has no counters")

    def num_keys(self) -> int:
        with self._changed:
            return len(self._values)

    def delete_key(self, key: str) -> bool:
        raise StoreError("a pair's rendezvous keys are not deleted")


class HttpStore(dist.Store):
    """The decode side's view of its pair's `MemoryStore`, through the bootstrap endpoint."""

    def __init__(self, base_url: str, pair_id: str, headers: dict[str, str], timeout_s: float):
        import httpx

        super().__init__()
        self.timeout_s = timeout_s
        self._path = f"/bootstrap/pairs/{pair_id}/store"
        self._http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s + 5.0)

    def set(self, key: str, value: Any) -> None:
        value = base64.b64encode(_value(value)).decode()
        r = self._http.post(self._path, params={"key": _key(key)}, json={"value": value})
        if r.status_code != 200:
            raise StoreError(f"the prefill refused rendezvous key {key!r}: HTTP {r.status_code}")

    def _peek(self, key: str) -> bytes | None:
        r = self._http.get(self._path, params={"key": _key(key)})
        if r.status_code == 404:
            return None
        if r.status_code != 200:
            raise StoreError(f"the prefill refused rendezvous key {key!r}: HTTP {r.status_code}")
        try:
            return base64.b64decode(r.json()["value"], validate=True)
        except (ValueError, KeyError, TypeError):
            raise StoreError(f"the prefill answered rendezvous key {key!r} unreadably") from None

    def get(self, key: str) -> bytes:
        deadline = time.monotonic() + self.timeout_s
        while True:
            value = self._peek(key)
            if value is not None:
                return value
            if time.monotonic() > deadline:
                raise StoreError(f"the prefill did not write {key!r} within {self.timeout_s:g} s")
            time.sleep(STORE_POLL_S)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        for key in keys:
            self.get(key)

    def check(self, keys: list[str]) -> bool:
        return all(self._peek(k) is not None for k in keys)

    def add(self, key: str, amount: int) -> int:
        raise StoreError("a pair's rendezvous has no counters")

    def num_keys(self) -> int:
        raise StoreError("a pair's rendezvous keys are not listed")

    def delete_key(self, key: str) -> bool:
        raise StoreError("a pair's rendezvous keys are not deleted")

    def close(self) -> None:
        self._http.close()
