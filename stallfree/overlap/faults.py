"""Fault injection for launched steps (a raising forward, a slow step, a failed D2H copy) and
for KV transfers between servers (dropped, delayed, sent under the wrong room, a dying sender).

Decisions are made on the host at launch, from a seeded schedule, so a run is reproducible;
the fault itself happens on the stream, where a real one would.
"""

from __future__ import annotations

import enum
import random
import time

from stallfree.config import FaultConfig


class InjectedFault(RuntimeError):
    """A fault the injector raised on purpose."""


class Fault(enum.Enum):
    NONE = "none"
    FAIL_STEP = "fail_step"
    SLOW_STEP = "slow_step"
    FAIL_COPY = "fail_copy"


class FaultInjector:
    def __init__(self, config: FaultConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)
        self.injected: dict[Fault, int] = dict.fromkeys(Fault, 0)

    def plan(self) -> Fault:
        """The fault of the next launched step."""
        cfg = self.config
        if not cfg.enabled:
            return Fault.NONE
        roll = self._rng.random()
        for fault, rate in (
            (Fault.FAIL_STEP, cfg.fail_step_rate),
            (Fault.FAIL_COPY, cfg.fail_copy_rate),
            (Fault.SLOW_STEP, cfg.slow_step_rate),
        ):
            if roll < rate:
                self.injected[fault] += 1
                return fault
            roll -= rate
        return Fault.NONE

    def before_forward(self, fault: Fault) -> None:
        """Runs on the stream."""
        if fault is Fault.FAIL_STEP:
            raise InjectedFault("injected forward failure")
        if fault is Fault.SLOW_STEP:
            time.sleep(self.config.slow_step_seconds)

    def before_copy(self, fault: Fault) -> None:
        """Runs on the stream, just before the device-to-host copy of the sampled ids."""
        if fault is Fault.FAIL_COPY:
            raise InjectedFault("injected device-to-host copy failure")


class TransferFault(enum.Enum):
    """What happens to one room's KV transfer (the prefill side's sender decides)."""

    NONE = "none"
    DROP = "drop"  # never sent
    DELAY = "delay"  # sent `kv_delay_seconds` late
    WRONG_ROOM = "wrong_room"  # sent under another room id
    KILL = "kill"  # the process dies after the first layer


class TransferFaults:
    """The seeded schedule of transfer faults (`faults.kv_*_rate`)."""

    def __init__(self, config: FaultConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)
        self.injected: dict[TransferFault, int] = dict.fromkeys(TransferFault, 0)

    def plan(self) -> TransferFault:
        cfg = self.config
        roll = self._rng.random()
        for fault, rate in (
            (TransferFault.DROP, cfg.kv_drop_rate),
            (TransferFault.DELAY, cfg.kv_delay_rate),
            (TransferFault.WRONG_ROOM, cfg.kv_wrong_room_rate),
            (TransferFault.KILL, cfg.kv_kill_rate),
        ):
            if roll < rate:
                self.injected[fault] += 1
                return fault
            roll -= rate
        return TransferFault.NONE
