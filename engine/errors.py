"""Errors the engine raises to its caller; the HTTP side maps them to status codes."""


class PromptTooLongError(ValueError):
    """The prompt (plus one generated token) does not fit the context or the KV budget."""

    def __init__(self, num_tokens: int, limit: int, what: str = "the model's context length"):
        self.num_tokens, self.limit, self.what = num_tokens, limit, what
        super().__init__(f"prompt has {num_tokens} tokens, but {what} allows at most {limit} "
                         f"(prompt + at least one new token)")

    def __reduce__(self):          # crosses the engine process's pipe (engine/engine_core.py)
        return type(self), (self.num_tokens, self.limit, self.what)


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; retry later (HTTP 429/503 with Retry-After)."""


class EngineDeadError(RuntimeError):
    """The step loop stopped after an internal error; the replica should be replaced."""


class RequestFailedError(RuntimeError):
    """The engine failed while running this request (it was stopped; the engine serves on)."""


class TPGroupError(RuntimeError):
    """A forward failed on some rank of a tensor-parallel group. The ranks' collectives may be
    out of step, so the group never serves again: the engine stops and the replica is rebuilt."""


class InvalidParamError(ValueError):
    """A request field the engine refuses (HTTP 400 naming `param`)."""

    def __init__(self, message: str, param: str):
        self.message, self.param = message, param
        super().__init__(message)

    def __reduce__(self):          # crosses the engine process's pipe (engine/engine_core.py)
        return type(self), (self.message, self.param)
