"""What one request may cost, checked before anything is generated: completions per request
(prompts x n), the token entries its answer would hold (`RequestCost` against
`server.max_request_cost`); a chat's messages and content parts are `screening`'s."""

from __future__ import annotations

from dataclasses import dataclass

from stallfree.entrypoints.server.base.errors import ApiError


def check_fanout(prompts: int, n: int, limit: int) -> None:
    if prompts * n > limit:
        raise ApiError(
            400,
            f"prompt: a request may ask for at most {limit} completions (prompts times n), "
            f"and this one asks for {prompts} x {n}",
            param="n" if prompts == 1 else "prompt",
            code="too_many_prompts",
        )


@dataclass(frozen=True, slots=True)
class RequestCost:
    """What a request costs, in the token entries its answer holds (a token with `k` top
    logprobs is `k + 1` entries): per prompt, n x max_tokens x (k + 1), and the prompt's
    tokens once, or, echoed, n x its tokens x (k + 1). Each bound alone (n, prompts x n, the
    top logprobs, the context) lets through a request whose answer is their product;
    `server.max_request_cost` bounds the product."""

    prompts: int
    prompt_tokens: int  # summed over the prompts
    n: int
    max_tokens: int  # per choice
    top_logprobs: int | None  # None: logprobs are off
    echo: bool = False
    logprobs_field: str = "logprobs"  # the field that asked for them (chat: top_logprobs)
    max_tokens_field: str = "max_tokens"
    max_tokens_unset: bool = False  # chat: as many as fit, the rest of the context
    # vLLM's prompt_logprobs: every choice's answer holds each prompt token and its top k
    prompt_logprobs: int | None = None

    @property
    def prompt_entries(self) -> int:
        if self.prompt_logprobs is None:
            return 0
        return self.n * self.prompt_tokens * (1 + self.prompt_logprobs)

    @property
    def weight(self) -> int:
        """Entries per token: the token and its top alternatives."""
        return 1 + (self.top_logprobs or 0)

    @property
    def total(self) -> int:
        outputs = self.prompts * self.max_tokens
        if self.echo:
            return self.n * (self.prompt_tokens + outputs) * self.weight + self.prompt_entries
        return self.prompt_tokens + self.n * outputs * self.weight + self.prompt_entries

    def formula(self) -> str:
        outputs = f"{self.max_tokens} {self.max_tokens_field}"
        if self.max_tokens_unset:
            outputs += " (unset: the rest of the context)"
        if self.prompts > 1:
            outputs = f"{self.prompts} prompts x {outputs}"
        weight = (
            ""
            if self.top_logprobs is None
            else f" x ({self.logprobs_field} {self.top_logprobs} + 1)"
        )
        extra = ""
        if self.prompt_logprobs is not None:
            extra = (
                f" + n {self.n} x {self.prompt_tokens} prompt tokens x (prompt_logprobs "
                f"{self.prompt_logprobs} + 1)"
            )
        if self.echo:
            echoed = f"{self.prompt_tokens} prompt tokens echoed + {outputs}"
            return f"n {self.n} x ({echoed}){weight}{extra}"
        return f"{self.prompt_tokens} prompt tokens + n {self.n} x {outputs}{weight}{extra}"

    def param(self) -> str:
        """The field that does most to make the cost: the prompt logprobs when they are most of
        it, the logprobs, else n, else max_tokens."""
        if 2 * self.prompt_entries > self.total:
            return "prompt_logprobs"
        if self.weight > 1:
            return self.logprobs_field
        return "n" if self.n > 1 else self.max_tokens_field

    def check(self, limit: int) -> None:
        total = self.total
        if total > limit:
            param = self.param()
            raise ApiError(
                400,
                f"{param}: this request costs {total} token entries, {self.formula()}, and "
                f"the server's budget for one request (server.max_request_cost) is {limit}; "
                "ask for fewer choices, tokens or logprobs",
                param=param,
                code="request_too_costly",
            )
