"""Every Redis key and channel name edgeq uses, in one place.

A producer in another language needs only these (README, "Wire contract"). arq's own key
prefixes come from ``arq.constants``, so an arq that renamed them would be noticed here and
nowhere else.

Per job:

- ``arq:job:<id>``: the payload, as arq stores it; ``arq:in-progress:<id>``: taken by a
  worker; ``arq:retry:<id>``: its start count; ``arq:result:<id>``: arq's result record;
- ``edgeq:events:{<id>}``: the replay stream; ``edgeq:terminal:{<id>}``: set with the terminal
  event; ``edgeq:stream:<id>``: the pub/sub channel the events are published on;
- ``edgeq:engine-failures:{<id>}``: how many engine failures (a death or a stall) the job was
  running at, written by the failing worker before it exits; a job at two is not continued
  again but quarantined (core/leases.py).

On a Redis Cluster (core/cluster.py) the queue's name carries a hash tag, ``{edgeq:queue}``,
and every job id begins with it (``{edgeq:queue}3f2a…``, ``new_job_id``): then all of a
queue's keys, arq's per-job keys too, live in the queue's slot. A job id that carries a tag is
not wrapped in braces again: its streams are ``edgeq:events:<id>`` and ``edgeq:terminal:<id>``.

Per queue (``{queue}`` is ``EDGEQ_QUEUE``, itself arq's sorted set of queued job ids):

- ``{queue}:wake``: channel an idle worker waits on, published after each enqueue;
- ``{queue}:leases``: sorted set, running job id -> lease expiry (Unix ms, Redis's clock);
- ``{queue}:workers`` and ``{queue}:worker:{id}``: the live-worker index and records;
- ``{queue}:outcomes:{minute}``: hash, outcome -> jobs that ended that minute;
- ``{queue}:tenancy``, ``{queue}:fair``, ``{queue}:tenant-of``, ``{queue}:queued-by-tenant``
  and ``{queue}:aging``: priority classes and tenants' fair shares (core/scheduling.py);
- ``{queue}:abort``: on a Redis Cluster only, arq's abort set for this queue (elsewhere arq's
  own ``arq:abort``, one set for every queue).
- ``{queue}:adapters``: hash, LoRA adapter name -> its path on the workers, the adapters every
  worker on the queue serves (core/adapters.py, ``edgeq adapters``).
- ``{queue}:dead-letter``: sorted set, quarantined job id -> when (Unix ms, Redis's clock);
  ``{queue}:dead-letter:<id>``: hash, that job's payload, engine failures and reason, expiring
  after EDGEQ_DEAD_LETTER_TTL_S (core/dead_letter.py, ``edgeq dead-letter``);
  ``{queue}:poison-refused:<fingerprint>``: the id of a quarantined job whose request has that
  fingerprint, for EDGEQ_POISON_REFUSE_S: the same request is refused at the door
  (core/fingerprint.py, lua/enqueue.lua).
- ``{queue}:limits-usage:<tenant>``: hash, what a tenant with rate limits or token budgets
  used in the current minute, UTC day and month; ``{queue}:reservation:<id>``: hash, the
  tokens a job reserved at admission, until its end settles them in the step that writes its
  terminal event, whoever writes it (core/events.py, lua/settle.lua, lua/limits.lua).
- ``{queue}:idempotency:<tenant>:<key>``: the job id a submit's idempotency key was given,
  and a hash of its request, for EDGEQ_IDEMPOTENCY_TTL_S (lua/enqueue.lua).
- ``{queue}:usage:<tenant>:<YYYY-MM-DD>``: hash, the tenant's usage ledger for one UTC day,
  field ``<model>|<class>|<counter>`` -> count; ``{queue}:usage-tenants:<YYYY-MM-DD>``: set,
  the tenants with a ledger that day. Both written with a job's terminal event and expiring
  EDGEQ_USAGE_KEEP_DAYS after their last write (core/ledger.py, ``edgeq usage``).

OpenAI's Files and Batches (resources/batches/store.py), per queue:

- ``{queue}:file:<file_id>``: hash, a file's record and content (expires after the retention);
  ``{queue}:files:<tenant>``: sorted set, the tenant's file ids by creation time;
- ``{queue}:batch:<batch_id>``: hash, a batch's record; ``{queue}:batches:<tenant>``: sorted
  set, the tenant's batch ids by creation time; ``{queue}:batches-active``: set, the batches
  a runner still has to run or finish;
- ``{queue}:batch-input:<batch_id>``: list, each line's validated request, by line number;
  ``{queue}:batch-inflight:<batch_id>``: set, the line numbers enqueued and not yet recorded;
  ``{queue}:batch-out:<batch_id>`` and ``{queue}:batch-err:<batch_id>``: hashes, custom_id ->
  its output or error line (written once each); ``{queue}:batch-attempts:<batch_id>``: hash,
  line -> how often it was run again; ``{queue}:batch-lease:<batch_id>``: the runner holding
  the batch, with a short TTL; ``{queue}:batches-active:<tenant>``: set, the tenant's
  batches not finished yet (its EDGEQ_GATEWAY_BATCHES_PER_TENANT); ``{queue}:batch-lines``:
  set, ``<batch_id>:<line>`` of every batch line queued or running, of all batches together
  (EDGEQ_GATEWAY_BATCH_QUEUED_MAX; a chat's admission leaves them out of the queue's depth).

OpenAI's Responses and their webhooks (resources/responses/, resources/webhooks.py):

- ``edgeq:response:{<id>}``: hash, a stored response's ``request`` (JSON) and, once its job
  ended, its ``events`` (JSON list); ``edgeq:response-follow:{<id>}``: the lease of the one
  gateway process following it; ``{queue}:responses:open``: set, the job ids of stored
  responses not yet ended;
- ``{queue}:webhooks:due``: sorted set, delivery -> when its next attempt is due (Unix s);
  ``{queue}:webhooks:deliveries``: hash, delivery -> its record (endpoint, body, attempts);
  ``{queue}:webhooks:lock:<delivery>``: held by the process attempting it, with a short TTL.
"""

from __future__ import annotations

import uuid

from arq.constants import (
    in_progress_key_prefix,
    job_key_prefix,
    result_key_prefix,
    retry_key_prefix,
)

from edgeq.core.cluster import hash_tag

STREAM_CHANNEL_PREFIX = "edgeq:stream:"
#: A channel nobody publishes on. A client's pub/sub connection subscribes to it with its
#: first stream and never leaves it (producer/subscriptions.py), so the connection is never
#: "subscribed to nothing" between two streams.
SUBSCRIPTIONS_ANCHOR_CHANNEL = "edgeq:stream-anchor"
#: Outcome tallies are counted per minute.
OUTCOME_BUCKET_S = 60


def new_job_id(queue: str) -> str:
    """A fresh job id for ``queue``: 32 hex digits, after the queue's hash tag if it has one
    (a queue on a Redis Cluster)."""
    tag = hash_tag(queue)
    return f"{{{tag}}}{uuid.uuid4().hex}" if tag is not None else uuid.uuid4().hex


def _in_job_slot(job_id: str) -> str:
    """The job id as the part of a key that decides its slot: itself if it carries a hash
    tag (the queue's), else wrapped in braces, so a job's streams share one slot."""
    return job_id if hash_tag(job_id) is not None else f"{{{job_id}}}"


def job_key(job_id: str) -> str:
    """arq's key holding a job's payload."""
    return f"{job_key_prefix}{job_id}"


def retry_key(job_id: str) -> str:
    """arq's count of a job's starts (``job_try``): a continued job has been started twice."""
    return f"{retry_key_prefix}{job_id}"


def in_progress_key(job_id: str) -> str:
    """arq's key marking a job as taken by a worker."""
    return f"{in_progress_key_prefix}{job_id}"


def result_key(job_id: str) -> str:
    """arq's key holding a finished job's result."""
    return f"{result_key_prefix}{job_id}"


def stream_channel(job_id: str) -> str:
    """The pub/sub channel a job's events are published on."""
    return f"{STREAM_CHANNEL_PREFIX}{job_id}"


def events_key(job_id: str) -> str:
    """The job's replay stream: every event it published, by seq."""
    return f"edgeq:events:{_in_job_slot(job_id)}"


def terminal_key(job_id: str) -> str:
    """Exists once the job's terminal event is written; nothing is accepted after it."""
    return f"edgeq:terminal:{_in_job_slot(job_id)}"


def engine_failures_key(job_id: str) -> str:
    """How many engine failures (deaths or stalls) the job was running at."""
    return f"edgeq:engine-failures:{_in_job_slot(job_id)}"


def dead_letter_key(queue: str) -> str:
    """A sorted set per queue: quarantined job id -> when it was quarantined (Unix ms)."""
    return f"{queue}:dead-letter"


def dead_letter_entry_key(queue: str, job_id: str) -> str:
    """A quarantined job's hash: ``payload`` (arq's record), ``failures``, ``reason``, ``at``."""
    return f"{queue}:dead-letter:{job_id}"


def poison_refusal_key(queue: str, fingerprint: str) -> str:
    """Set, with a TTL, while the request of this fingerprint (core/fingerprint.py) is refused
    at the door: it holds the id of the quarantined job that had it."""
    return f"{queue}:poison-refused:{fingerprint}"


def idempotency_key(queue: str, tenant: str, key: str) -> str:
    """A submit's idempotency key, scoped by tenant: two tenants' keys never meet."""
    return f"{queue}:idempotency:{tenant}:{key}"


def limits_usage_key(queue: str, tenant: str) -> str:
    """A hash per tenant with limits: its requests and tokens this minute, its tokens this UTC
    day and month, each beside the window it counts (lua/limits.lua)."""
    return f"{limits_usage_prefix(queue)}{tenant}"


def key_limits_usage_key(queue: str, key_name: str) -> str:
    """``limits_usage_key``'s hash for a named API key with limits of its own. A tenant name
    holds no ``:`` (core/scheduling.py TENANT_PATTERN), so no tenant's hash is ever this one."""
    return f"{limits_usage_prefix(queue)}key:{key_name}"


def limits_usage_prefix(queue: str) -> str:
    """``limits_usage_key`` without its tenant: the terminal step (lua/settle.lua) adds the
    tenant (or ``key:`` and the API key's name) a job's reservation names, so a writer that
    does not know them still settles it."""
    return f"{queue}:limits-usage:"


def reservation_key(queue: str, job_id: str) -> str:
    """A hash per admitted job of a limited tenant: the tokens it reserved and the windows it
    reserved them in, until its end settles them (lua/settle.lua)."""
    return f"{queue}:reservation:{job_id}"


def wake_channel(queue: str) -> str:
    """Idle workers wait on this channel; a producer publishes on it after each enqueue."""
    return f"{queue}:wake"


def leases_key(queue: str) -> str:
    """A sorted set per queue: running job id -> lease expiry (Unix ms, Redis's clock)."""
    return f"{queue}:leases"


def workers_key(queue: str) -> str:
    """A sorted set per queue: worker id -> last heartbeat (Unix ms)."""
    return f"{queue}:workers"


def worker_key(queue: str, worker_id: str) -> str:
    """One worker's record (JSON), expiring one lease after its heartbeat."""
    return f"{queue}:worker:{worker_id}"


def outcomes_key(queue: str, now_s: float) -> str:
    """A hash per queue and minute: outcome (``done`` or error code) -> jobs ended."""
    return f"{queue}:outcomes:{int(now_s // OUTCOME_BUCKET_S)}"


def usage_key(queue: str, tenant: str, day: str) -> str:
    """A hash per queue, tenant and UTC day (``YYYY-MM-DD``): ``<model>|<class>|<counter>``
    -> count. A tenant name holds no ``:`` (core/scheduling.py TENANT_PATTERN), so the key
    reads back unambiguously."""
    return f"{queue}:usage:{tenant}:{day}"


def usage_tenants_key(queue: str, day: str) -> str:
    """A set per queue and UTC day: the tenants that have a usage hash that day."""
    return f"{queue}:usage-tenants:{day}"


def tenancy_key(queue: str) -> str:
    """A hash per queue: the tenants' weights and caps and the aging time, as the workers
    last published them (core/scheduling.py)."""
    return f"{queue}:tenancy"


def fair_key(queue: str) -> str:
    """A hash per queue: each band's virtual clock and each tenant flow's next start tag."""
    return f"{queue}:fair"


def tenant_of_key(queue: str) -> str:
    """A hash per queue: queued job id -> its tenant (until a worker claims it)."""
    return f"{queue}:tenant-of"


def queued_by_tenant_key(queue: str) -> str:
    """A hash per queue: tenant -> jobs queued and not yet claimed."""
    return f"{queue}:queued-by-tenant"


def adapters_key(queue: str) -> str:
    """A hash per queue: LoRA adapter name -> its path as the workers see it."""
    return f"{queue}:adapters"


def aging_key(queue: str) -> str:
    """A sorted set per queue: queued job id -> when it moves up one priority class (Unix ms,
    Redis's clock)."""
    return f"{queue}:aging"


def cluster_abort_set_key(queue: str) -> str:
    """arq's abort set for one queue on a Redis Cluster: arq's own ``arq:abort`` serves every
    queue and lives in a slot of its own, which arq's transactions cannot reach from the
    queue's (worker/claim.py)."""
    return f"{queue}:abort"


def file_key(queue: str, file_id: str) -> str:
    """A stored file's hash: its record fields and its ``content``."""
    return f"{queue}:file:{file_id}"


def files_key(queue: str, tenant: str) -> str:
    """A sorted set per tenant: file id -> created (Unix s)."""
    return f"{queue}:files:{tenant}"


def batch_key(queue: str, batch_id: str) -> str:
    """A batch's record (hash)."""
    return f"{queue}:batch:{batch_id}"


def batches_key(queue: str, tenant: str) -> str:
    """A sorted set per tenant: batch id -> created (Unix ms)."""
    return f"{queue}:batches:{tenant}"


def active_batches_key(queue: str) -> str:
    """A set per queue: the batches not finished yet, which some runner must take."""
    return f"{queue}:batches-active"


def tenant_active_batches_key(queue: str, tenant: str) -> str:
    """A set per tenant: its batches not finished yet (what its batch cap counts)."""
    return f"{queue}:batches-active:{tenant}"


def batch_lines_key(queue: str) -> str:
    """A set per queue: ``<batch_id>:<line>`` of every batch line queued or running."""
    return f"{queue}:batch-lines"


def file_key_prefix(queue: str) -> str:
    """What every file's key starts with (``file_key``), for the scripts that count a
    tenant's files from its index."""
    return file_key(queue, "")


def batch_key_prefix(queue: str) -> str:
    """What every batch's key starts with (``batch_key``)."""
    return batch_key(queue, "")


def batch_part_key(queue: str, part: str, batch_id: str) -> str:
    """One of a batch's working keys: ``input``, ``inflight``, ``out``, ``err``, ``attempts``
    or ``lease``."""
    return f"{queue}:batch-{part}:{batch_id}"


def response_key(job_id: str) -> str:
    """A stored response's hash: its ``request`` and, once ended, its job's ``events``."""
    return f"edgeq:response:{{{job_id}}}"


def response_follow_key(job_id: str) -> str:
    """The lease of the gateway process following a stored response."""
    return f"edgeq:response-follow:{{{job_id}}}"


def open_responses_key(queue: str) -> str:
    """A set per queue: the job ids of stored responses not ended yet."""
    return f"{queue}:responses:open"


def webhooks_due_key(queue: str) -> str:
    """A sorted set per queue: webhook delivery -> when its next attempt is due (Unix s)."""
    return f"{queue}:webhooks:due"


def webhook_deliveries_key(queue: str) -> str:
    """A hash per queue: webhook delivery -> its record (JSON)."""
    return f"{queue}:webhooks:deliveries"


def webhook_lock_key(queue: str, delivery: str) -> str:
    """Held (with a short TTL) by the process attempting one webhook delivery."""
    return f"{queue}:webhooks:lock:{delivery}"
