"""Requests: `Req`, sampling parameters, request errors and the output types a consumer sees."""
