"""Scheduling: allocation, `ScheduleBatch`, admission, the scheduler and the loops. Host state only."""
