"""The jobs a worker runs now, in one registry: the job loop (worker/lifecycle.py) enters each
claimed job with its task and removes it when the task ends; the job function marks the time
it serves the job with its tenant; the lease renewals, the heartbeat, the metrics and the
stall handling (worker/app.py, worker/liveness.py) read it."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass


@dataclass(slots=True)
class RunningJob:
    """One claimed job while its task runs."""

    task: asyncio.Task[None]
    #: The job's tenant while its function serves it (worker/jobs.py), else None: before the
    #: chat starts, after it ended (its records are the loop's to finish, and the lease goes
    #: with them), and once it was handed over. Only then is its lease renewed, and it is
    #: counted as running.
    tenant: str | None = None


class RunningJobs(dict[str, RunningJob]):
    """Running jobs: id -> RunningJob. Its length is the slots the loop has taken."""

    def tasks(self) -> list[asyncio.Task[None]]:
        return [job.task for job in self.values()]

    def serving(self, job_id: str, tenant: str) -> None:
        """The job function serves ``job_id`` for ``tenant`` from now on."""
        if (job := self.get(job_id)) is not None:
            job.tenant = tenant

    def served(self, job_id: str) -> None:
        """The job function is done with ``job_id``: no more renewals, no more counting."""
        if (job := self.get(job_id)) is not None:
            job.tenant = None

    def leased(self) -> list[str]:
        """The jobs served now: the ones whose leases this worker renews."""
        return [job_id for job_id, job in self.items() if job.tenant is not None]

    def by_tenant(self) -> dict[str, int]:
        return dict(Counter(job.tenant for job in self.values() if job.tenant is not None))
