"""How a model call ends, as callers of any model adapter see it: the adapter's errors and the per-call
observation its ``CallObserver`` is told. Kept apart from ``actors.model_openai`` (and free of the ``openai``
SDK) so that a trajectory whose model calls run in the node's model client actor (``actors.model_client``)
raises and catches the same types without loading the SDK.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

from runtime.errors import DependencyError, ProviderRateLimited
from runtime.ports import RateLimitInfo, Usage

__all__ = ["CallObserved", "CallObserver", "ModelCallFailed", "ModelRateLimited"]


class ModelRateLimited(ProviderRateLimited):
    """HTTP 429 from the provider; ``rate_limit`` is what its headers said (``remaining`` repeats the
    ``x-ratelimit-remaining-*`` counts), ``status`` is 429."""

    status = 429

    def __init__(
        self,
        message: str,
        *,
        scope: str | None,
        retry_after: float | None,
        remaining: Mapping[str, float],
        rate_limit: RateLimitInfo | None = None,
    ) -> None:
        super().__init__(message, scope=scope, retry_after=retry_after, rate_limit=rate_limit)
        self.remaining = dict(remaining)


class ModelCallFailed(DependencyError):
    """The model call failed outside the harness's control.

    ``usage`` is what was billed before the failure (see the module docstring), ``usage_estimated`` whether
    it is the adapter's estimate, ``status`` the HTTP status when the server answered one, ``rate_limit``
    what the response's headers said about limits (None: no headers).
    """

    def __init__(
        self,
        message: str,
        *,
        scope: str | None,
        usage: Usage,
        non_retryable: bool = False,
        status: int | None = None,
        usage_estimated: bool = False,
        rate_limit: RateLimitInfo | None = None,
    ) -> None:
        super().__init__(message, scope=scope, non_retryable=non_retryable, usage=usage)
        self.usage: Usage = usage
        self.status = status
        self.usage_estimated = usage_estimated
        self.rate_limit = rate_limit


@dataclass(frozen=True, slots=True)
class CallObserved:
    """One model call as the adapter saw it end, for counters (``CallObserver``).

    ``status`` is the HTTP status the server answered (None: no answer, e.g. connection refused or a
    deadline before the headers); ``outcome`` is ``reply``, ``rate_limited``, ``failed`` or ``cancelled``
    (a 200 whose stream then broke is status 200, outcome ``failed``); ``hint_source`` names the header
    that carried a retry hint.
    """

    provider: str
    trajectory_id: str
    status: int | None
    outcome: Literal["reply", "rate_limited", "failed", "cancelled"]
    hint_source: str | None = None
    retry_after_s: float | None = None
    usage_estimated: bool = False


class CallObserver(Protocol):
    """Told about every call ``complete`` made (once per call). Must be quick and must not raise."""

    def observe(self, call: CallObserved) -> None: ...
