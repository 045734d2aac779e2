"""Rewards from one or more HTTP reward servers, with sharding, retries and timeouts (httpx)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import httpx

from rlhf_rollout.rewards import RewardResult, normalize_reward_output

__all__ = ["RETRIES_KEY", "RemoteReward", "RemoteRewardError"]

RETRIES_KEY = "reward_retries"
"""``extra_logs`` key: per sample, the retries its request took (each retry is also logged as a warning)."""

_log = logging.getLogger(__name__)


class RemoteRewardError(RuntimeError):
    """A reward server could not be reached or answered badly; the message names the URL."""


class RemoteReward:
    """POST ``{"queries": [...], "prompts": [...], "labels": [...]}`` to reward servers.

    A batch of ``m`` samples is cut into ``len(urls)`` contiguous shards, one per URL, sent
    concurrently. A server answers ``{"rewards": [...], "scores": [...]?, "extra_logs": {...}?}``
    with one value per sample of its shard. Connection errors, timeouts, 5xx, 408 and 429 answers are retried
    ``retries`` times with exponential backoff (``backoff_s * 2**attempt``), each retry logged as a
    warning and counted in the result's ``extra_logs[RETRIES_KEY]``; 4xx answers and malformed bodies fail
    at once. Every error names the URL.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        timeout_s: float = 60.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        if not self.urls:
            raise ValueError("RemoteReward needs at least one URL")
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"reward URL {url!r} must start with http:// or https://")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.headers = dict(headers or {})

    async def ascore(
        self,
        *,
        queries: Sequence[str],
        prompts: Sequence[str],
        labels: Sequence[Any],
        images: Sequence[Sequence[Any]] | None = None,
    ) -> RewardResult:
        """Posts the texts; images are not sent (a server that needs them takes them from the labels)."""
        n, k = len(queries), len(self.urls)
        if not (len(prompts) == n and len(labels) == n):
            raise ValueError(f"queries/prompts/labels lengths differ: {n}, {len(prompts)}, {len(labels)}")
        bounds = [n * i // k for i in range(k + 1)]
        async with httpx.AsyncClient(timeout=self.timeout_s, headers=self.headers) as client:
            jobs = [
                self._post(client, url, queries[lo:hi], prompts[lo:hi], labels[lo:hi], offset=lo)
                for url, lo, hi in zip(self.urls, bounds, bounds[1:], strict=False)
                if hi > lo
            ]
            parts = await asyncio.gather(*jobs)
        rewards, scores = [], []
        extra: dict[str, list[float]] = {}
        for part in parts:
            rewards += part.rewards
            scores += part.scores
            for key, values in part.extra_logs.items():
                extra.setdefault(key, []).extend(values)
        extra = {key: v for key, v in extra.items() if len(v) == n}  # keys every server reported
        return RewardResult(rewards=rewards, scores=scores, extra_logs=extra)

    async def _post(self, client, url, queries, prompts, labels, *, offset: int) -> RewardResult:
        body = {"queries": list(queries), "prompts": list(prompts), "labels": list(labels)}
        last: str = ""
        for attempt in range(self.retries + 1):
            if attempt:
                wait = self.backoff_s * 2 ** (attempt - 1)
                _log.warning(
                    "reward server %s: attempt %d of %d failed (%s); retrying in %.1f s",
                    url, attempt, self.retries + 1, last, wait,
                )  # fmt: skip
                await asyncio.sleep(wait)
            try:
                resp = await client.post(url, json=body)
            except httpx.TimeoutException:
                last = f"timed out after {self.timeout_s} s"
                continue
            except httpx.TransportError as err:
                last = f"{type(err).__name__}: {err}"
                continue
            if resp.status_code >= 500 or resp.status_code in (408, 429):  # overloaded or slow: retried
                last = f"HTTP {resp.status_code}: {resp.text[:200]}"
                continue
            if resp.status_code >= 400:
                raise RemoteRewardError(
                    f"reward server {url} rejected the request: HTTP {resp.status_code}: {resp.text[:200]}"
                )
            try:
                payload = resp.json()
            except ValueError as err:
                raise RemoteRewardError(
                    f"reward server {url} answered non-JSON: {resp.text[:200]!r}"
                ) from err
            try:
                out = normalize_reward_output(
                    payload,
                    n=len(queries),
                    source=f"reward server {url} (samples {offset}..{offset + len(queries) - 1})",
                )
            except ValueError as err:
                raise RemoteRewardError(str(err)) from err
            out.extra_logs[RETRIES_KEY] = [float(attempt)] * len(queries)
            return out
        raise RemoteRewardError(f"reward server {url} failed after {self.retries + 1} attempts: {last}")
