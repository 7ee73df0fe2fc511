"""A JSONL job split across engine replicas on Ray, exactly once per id like the local backend.

The driver (the process running scripts/generate.py) stays the only writer of the output
file, through `jobs.JobOutput`: the torn-line repair, the skipping of ids already written
and the refusal of duplicate input ids all happen before any replica starts, exactly as
for one engine. Replicas are Ray actors, each owning an `LLM`; the driver hands each one
`job.batch_size` records at a time (`job.batches_per_replica` queued, so a replica never
waits for the next batch) and writes a batch's results when it comes back.

A replica that dies (killed, out of memory, its node lost) loses its unfinished batches: the
driver starts a new replica in its place (at most `ray.max_replica_restarts` times per place)
and puts the lost batches back at the front of the queue, for whichever replica is free
first. A batch's results arrive all together or not at all, and `JobOutput` drops a result
for an id already written, so retries never write an id twice. A batch that has been lost
`job.max_batch_attempts` times (a record that kills any engine?) stops the job with what was
written kept; a rerun resumes.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from jaxcb.config import Config
from jaxcb.distributed.ray_cluster import check_room, connect, import_ray, replica_options, wait_until_ready
from jaxcb.engine import LLM
from jaxcb.jobs import JobOutput, JobRecord, generate_results, max_in_flight

log = logging.getLogger(__name__)


class JobReplica:
    """One engine in a Ray actor: runs batches of job records, returns their result records."""

    def __init__(self, cfg: Config):
        self.llm = LLM(cfg, progress=False)
        self.max_in_flight = max_in_flight(self.llm)

    def ready(self) -> int:
        """Called once the model is loaded and compiled; the replica's process id."""
        return os.getpid()

    def run_batch(self, records: list[JobRecord]) -> list[dict]:
        return list(generate_results(self.llm, records, self.max_in_flight))


class JobFailedError(RuntimeError):
    """The job cannot go on; what was written stays, and a rerun of the same command resumes."""


@dataclass
class _Batch:
    records: list[JobRecord]
    attempts: int = 0  # times it was lost with its replica


@dataclass
class _ReplicaSlot:
    """A place for one replica; when its replica dies a new one takes the place."""

    index: int
    actor: Any
    restarts: int = 0
    batches_in_flight: int = 0
    retired: bool = False  # died more than ray.max_replica_restarts times


def run_on_ray_replicas(cfg: Config, records: list[JobRecord], open_output: Callable[[], JobOutput]) -> None:
    """Generate `records` on cfg.job.num_replicas Ray replicas; results go to the output `open_output` gives."""
    ray = import_ray()
    owns_connection = connect(cfg.ray)
    replica_class = ray.remote(JobReplica).options(**replica_options(cfg.ray, max_restarts=0))
    slots: list[_ReplicaSlot] = []
    output = None
    try:
        check_room(cfg.ray, cfg.job.num_replicas, "job")
        slots = [_ReplicaSlot(i, replica_class.remote(cfg)) for i in range(cfg.job.num_replicas)]
        pids = wait_until_ready(ray, [s.actor.ready.remote() for s in slots], cfg.ray)
        log.info("job replicas up, process ids %s", pids)
        output = open_output()
        readable = []
        for rec in records:
            if rec.id is None or rec.error:  # an unreadable line needs no engine: report it here
                output.write({"id": rec.id, "line": rec.line, "error": rec.error})
            else:
                readable.append(rec)
        _drive(ray, cfg, slots, readable, output, lambda: replica_class.remote(cfg))
    finally:
        if output is not None:
            output.close()
        for slot in slots:
            ray.kill(slot.actor, no_restart=True)
        if owns_connection:
            ray.shutdown()


def _drive(ray, cfg: Config, slots: list[_ReplicaSlot], records: list[JobRecord], output: JobOutput,
           new_replica: Callable[[], Any]) -> None:
    """Hand out batches, write results as batches come back, and replace replicas that die."""
    size = cfg.job.batch_size
    queue = deque(_Batch(records[i:i + size]) for i in range(0, len(records), size))
    in_flight: dict[Any, tuple[_ReplicaSlot, Any, _Batch]] = {}  # result ref -> (slot, the actor it went to, batch)
    lost_errors = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.OutOfMemoryError)
    while queue or in_flight:
        for slot in slots:
            while queue and not slot.retired and slot.batches_in_flight < cfg.job.batches_per_replica:
                batch = queue.popleft()
                in_flight[slot.actor.run_batch.remote(batch.records)] = (slot, slot.actor, batch)
                slot.batches_in_flight += 1
        if not in_flight:
            raise JobFailedError(
                f"every replica died more than ray.max_replica_restarts={cfg.ray.max_replica_restarts} times; "
                f"{sum(len(b.records) for b in queue)} records are left (a rerun resumes)"
            )
        [ref], _ = ray.wait(list(in_flight), num_returns=1)
        slot, actor, batch = in_flight.pop(ref)
        current = slot.actor is actor  # False: a batch of a replica already replaced
        if current:
            slot.batches_in_flight -= 1
        try:
            results = ray.get(ref)
        except lost_errors as e:
            batch.attempts += 1
            first_id, last_id = batch.records[0].id, batch.records[-1].id
            if batch.attempts >= cfg.job.max_batch_attempts:
                raise JobFailedError(
                    f"the batch of ids {first_id}..{last_id} was lost with its replica {batch.attempts} times "
                    f"(job.max_batch_attempts={cfg.job.max_batch_attempts}); stopping, a rerun resumes"
                ) from e
            log.warning("replica %d died; its batch of ids %s..%s goes back in the queue", slot.index, first_id, last_id)
            queue.appendleft(batch)
            if current:
                _replace(ray, cfg, slot, new_replica)
            continue
        for result in results:
            output.write(result)


def _replace(ray, cfg: Config, slot: _ReplicaSlot, new_replica: Callable[[], Any]) -> None:
    ray.kill(slot.actor, no_restart=True)  # if only unreachable, it must not come back and work for nobody
    slot.batches_in_flight = 0
    if slot.restarts >= cfg.ray.max_replica_restarts:
        slot.retired = True
        log.error("replica %d died %d times; going on without it", slot.index, slot.restarts + 1)
        return
    slot.restarts += 1
    slot.actor = new_replica()  # its calls queue until its model is loaded
    log.warning("replica %d restarted (%d of ray.max_replica_restarts=%d)", slot.index, slot.restarts,
                cfg.ray.max_replica_restarts)
