"""The `faults` section: seeded fault injection for the reliability tests (failed, slow and
copy-failing steps, which `overlap/faults.py` injects) and for the disaggregation tests (KV
transfers dropped, delayed, misaddressed or cut off)."""

from __future__ import annotations

from pydantic import Field

from stallfree.config.sections import Section


class FaultConfig(Section):
    """Fault injection for reliability tests; off unless enabled."""

    enabled: bool = Field(False, description="Inject faults into launched steps (tests only)")
    seed: int = Field(0, description="Seed of the fault schedule")
    fail_step_rate: float = Field(
        0.0, ge=0, le=1, allow_inf_nan=False, description="Share of steps whose forward raises"
    )
    slow_step_rate: float = Field(
        0.0, ge=0, le=1, allow_inf_nan=False, description="Share of steps made slow"
    )
    slow_step_seconds: float = Field(
        0.05, ge=0, allow_inf_nan=False, description="Extra time of a slow step"
    )
    fail_copy_rate: float = Field(
        0.0,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="Share of steps whose device-to-host copy fails",
    )
    kv_drop_rate: float = Field(
        0.0,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="prefill: share of KV transfers never sent",
    )
    kv_delay_rate: float = Field(
        0.0,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="prefill: share of KV transfers sent late",
    )
    kv_delay_seconds: float = Field(
        1.0, ge=0, allow_inf_nan=False, description="How late a delayed KV transfer is sent"
    )
    kv_wrong_room_rate: float = Field(
        0.0,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="prefill: share of KV transfers sent under another room id",
    )
    kv_kill_rate: float = Field(
        0.0,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="prefill: share of KV transfers after whose first layer the process dies",
    )
