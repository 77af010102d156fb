"""The streams and buckets: made (idempotently) by the admin, awaited by services."""

from __future__ import annotations

import asyncio
import functools
import logging

from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, NotFoundError
from sandhold.bus.electing import patiently
from sandhold.bus.names import Names

log = logging.getLogger(__name__)

_STREAM_EXISTS_DIFFERENT = 10058
# "no suitable peers for placement": a replicated stream asked of a cluster whose
# nodes have not all joined yet (just started, or one restarting).
_NO_SUITABLE_PEERS = 10005
SECRETS_MAX_AGE_S = 7 * 86400  # a command not launched within a week loses its secrets


def stream_configs(
    names: Names,
    *,
    replicas: int = 1,
    output_max_age_s: float = 7 * 86400,
    output_max_bytes: int = -1,
    duplicate_window_s: float = 120.0,
) -> list[StreamConfig]:
    p = names.prefix

    def _kept(name: str, subjects: str, max_age_s: float) -> StreamConfig:
        """Values kept one per subject, the newest only, read by direct get."""
        return StreamConfig(
            name=name,
            subjects=[subjects],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            num_replicas=replicas,
            max_msgs_per_subject=1,
            max_age=max_age_s or None,
            allow_direct=True,
            duplicate_window=duplicate_window_s,
        )

    return [
        # The audit trail: kept forever, one subject per aggregate.
        StreamConfig(
            name=names.events_stream,
            subjects=[f"{p}.ev.>"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            num_replicas=replicas,
            duplicate_window=duplicate_window_s,
            allow_direct=True,
        ),
        StreamConfig(
            name=names.output_stream,
            subjects=[f"{p}.out.>"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            num_replicas=replicas,
            max_age=output_max_age_s,
            max_bytes=output_max_bytes,
            discard=DiscardPolicy.OLD,
            duplicate_window=duplicate_window_s,
            allow_direct=True,
        ),
        # Accepted while the scheduler is down; gone once handled.
        StreamConfig(
            name=names.requests_stream,
            subjects=[f"{p}.req.>"],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            num_replicas=replicas,
            duplicate_window=duplicate_window_s,
        ),
        # The save store: one message per chunk subject (its sha256), so a chunk
        # already stored is refused by an expected-sequence-0 write (NATS-NOTES).
        StreamConfig(
            name=names.saves_stream,
            subjects=[f"{p}.chunk.*", f"{p}.manifest.*"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            num_replicas=replicas,
            max_msgs_per_subject=1,
            allow_direct=True,
            duplicate_window=duplicate_window_s,
        ),
        StreamConfig(
            name=names.hostwork_stream,
            subjects=[f"{p}.work.>"],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            num_replicas=replicas,
            duplicate_window=duplicate_window_s,
        ),
        # A command's secrets between its request and its launch: one subject per
        # command, removed once it started (or after a week unlaunched). Only the
        # scheduler reads or writes it; the store is encrypted at rest.
        _kept(names.secrets_stream, f"{p}.secret.*.*", SECRETS_MAX_AGE_S),
        # Connections' values (decision 031): one subject per set request, kept
        # while the sandbox refers to it (no age limit), removed when replaced,
        # removed or the sandbox deleted. Only the scheduler reads or writes it.
        _kept(names.connections_stream, f"{p}.conn.*.*", 0.0),
    ]


async def ensure_streams(
    js: JetStreamContext, names: Names, *, replicas: int = 1, timeout_s: float = 60.0
) -> None:
    """Create every stream and bucket; update one whose settings changed.

    A cluster that has just started answers only once its nodes elected a meta
    leader, and a replicated stream is made once its peers agreed, and placed
    once as many nodes joined as it has replicas: until the deadline, a request
    that times out, finds JetStream not ready or finds too few peers is asked
    again (the first such wait is logged, to say what it waits for)."""
    said: set[str] = set()

    def waiting(err: Exception) -> None:
        """Each reason to wait is logged once: what it waits for, and when that changed."""
        reason = "too few peers" if _unplaced(err) else "an answer"
        if reason not in said:
            said.add(reason)
            log.warning("waiting for the cluster to place its streams (%s): %s", reason, err)

    def unplaced(err: Exception) -> bool:
        if _unplaced(err):
            waiting(err)
            return True
        return False

    wait = functools.partial(
        patiently, wait_s=timeout_s, pause_s=0.2, on_first_wait=waiting, also=unplaced
    )
    for config in stream_configs(names, replicas=replicas):

        async def add(config: StreamConfig = config) -> None:
            try:
                await js.add_stream(config)
            except BadRequestError as err:
                if err.err_code != _STREAM_EXISTS_DIFFERENT:
                    raise
                await js.update_stream(config)

        await wait(add)
    # Hosts' leases, and service instances' (decision 036).
    for bucket in (names.lease_bucket, names.instance_bucket):
        kv = KeyValueConfig(bucket=bucket, history=1, replicas=replicas, storage=StorageType.FILE)
        await wait(functools.partial(js.create_key_value, kv))


def _unplaced(err: Exception) -> bool:
    return isinstance(err, BadRequestError) and err.err_code == _NO_SUITABLE_PEERS


async def await_streams(js: JetStreamContext, names: Names, *, poll_s: float = 0.5) -> None:
    """Wait until every stream and bucket exists. Services never make them: only
    the admin user may (`sandhold up`, or `sandhold streams ensure` on a cluster)."""
    said = False

    def unanswered(err: Exception) -> None:
        log.warning("waiting for JetStream to answer about the streams (%r)", err)

    for stream in names.all_streams:
        while True:
            try:
                # A cluster that has just (re)started answers once it has elected its
                # leaders: a service started meanwhile waits, it does not die of it.
                await patiently(
                    functools.partial(js.stream_info, stream),
                    wait_s=None,
                    pause_s=poll_s,
                    on_first_wait=unanswered,
                )
                break
            except NotFoundError:
                if not said:
                    log.warning(
                        "waiting for stream %s: the admin makes it (`sandhold up`, or "
                        "`sandhold streams ensure`)",
                        stream,
                    )
                    said = True
                await asyncio.sleep(poll_s)
