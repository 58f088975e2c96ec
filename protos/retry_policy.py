"""Retrying gRPC calls: the seeded, jittered exponential backoff (:class:`RetryPolicy`), the wait
before a retryable call's next attempt, and the kit's error for a call that failed for good."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from fctkit.errors import InputError, RpcStatusError


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff for UNAVAILABLE: ``attempts`` tries in all, waits growing from
    ``initial_backoff_s`` by ``multiplier`` up to ``max_backoff_s``, each stretched by up to
    ``jitter`` (a fraction) from a generator seeded with ``seed``."""

    attempts: int = 6
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.initial_backoff_s < 0 or self.multiplier < 1 or not 0 <= self.jitter <= 1:
            raise InputError("RetryPolicy: attempts >= 1, initial_backoff_s >= 0, multiplier >= 1, 0 <= jitter <= 1")

    def delays(self) -> Iterator[float]:
        """The waits between consecutive attempts (``attempts - 1`` of them)."""
        rng = random.Random(self.seed)
        delay = self.initial_backoff_s
        for _ in range(self.attempts - 1):
            yield min(delay, self.max_backoff_s) * (1 + self.jitter * rng.random())
            delay *= self.multiplier


def status_error(error: grpc.RpcError) -> RpcStatusError:
    """The kit error for a failed gRPC call."""
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else str(error)
    return RpcStatusError(code.name if code else "UNKNOWN", details or "")


def sleep_before_retry(
    error: grpc.RpcError,
    delays: Iterator[float],
    retry_on: tuple[grpc.StatusCode, ...] = (grpc.StatusCode.UNAVAILABLE,),
) -> None:
    """A call failing with a retryable status waits for its next attempt; anything else (or no
    attempts left) raises the kit's error for the status."""
    delay = next(delays, None) if _code(error) in retry_on else None
    if delay is None:
        raise status_error(error) from None
    time.sleep(delay)


def _code(error: grpc.RpcError) -> grpc.StatusCode | None:
    return error.code() if hasattr(error, "code") else None
