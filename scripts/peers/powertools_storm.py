#!/usr/bin/env python3
"""The duplicate storm against AWS Lambda Powertools for Python idempotency on Redis.

N jobs, each delivered twice. The effect of a job (a counter increment keyed by
job) must run exactly once.

sequential: one worker, the second delivery right after the first returned.
concurrent: 8 worker threads; each takes the next job, dispatches both of its
deliveries at once (two threads), waits for both, then takes the next job.

A delivery that finds the record in progress gets IdempotencyAlreadyInProgressError
from Powertools; like a broker would, it is redelivered after 5 ms until it gets
the stored result. Those redeliveries are counted as retries.

Runs outside Lambda: idempotent_function needs no Lambda context. Without one the
in-progress record has no in-progress expiry, so Powertools treats it as in
progress until the record's own TTL (expires_after_seconds, 1 h by default).

Usage: powertools_storm.py [--jobs N] [--redis-host H] [--redis-port P]
Prints one JSON line. Keys use a fresh prefix per run and are deleted afterwards.
"""

import argparse
import json
import threading
import time
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version

import redis
from aws_lambda_powertools.utilities.idempotency import IdempotencyConfig, idempotent_function
from aws_lambda_powertools.utilities.idempotency.exceptions import IdempotencyAlreadyInProgressError
from aws_lambda_powertools.utilities.idempotency.persistence.cache import CachePersistenceLayer

# CachePersistenceLayer is the current name of RedisCachePersistenceLayer (same class; the
# old name's deprecation warning fires for both). Outside Lambda there is no context to
# register, which Powertools warns about on every call.
warnings.filterwarnings("ignore", category=DeprecationWarning, module=__name__)
warnings.filterwarnings("ignore", message="Couldn't determine the remaining time left")

WORKERS = 8
RETRY_SLEEP = 0.005


class Storm:
    """One mode's effect counters, retry count and idempotent handler."""

    def __init__(self, client, prefix, jobs):
        self.effects = [0] * jobs
        self.lock = threading.Lock()
        self.retries = 0
        # One persistence layer per key prefix: configure() sets the prefix on the layer.
        persistence = CachePersistenceLayer(client=client)

        @idempotent_function(
            data_keyword_argument="job",
            persistence_store=persistence,
            config=IdempotencyConfig(),
            key_prefix=prefix,
        )
        def handle(job: dict) -> dict:
            # The effect: a counter increment keyed by job.
            with self.lock:
                self.effects[job["job"]] += 1
            return {"job": job["job"]}

        self.handle = handle

    def deliver(self, job):
        while True:
            try:
                result = self.handle(job={"job": job})
            except IdempotencyAlreadyInProgressError:
                with self.lock:
                    self.retries += 1
                time.sleep(RETRY_SLEEP)
                continue
            assert result == {"job": job}, (job, result)
            return

    def check(self, mode):
        bad = [(j, n) for j, n in enumerate(self.effects) if n != 1]
        if bad:
            raise SystemExit(f"{mode}: {len(bad)} jobs did not run their effect exactly once, e.g. {bad[:5]}")
        return sum(self.effects)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=5000)
    ap.add_argument("--redis-host", default="127.0.0.1")
    ap.add_argument("--redis-port", type=int, default=6379)
    args = ap.parse_args()
    jobs = args.jobs

    client = redis.Redis(host=args.redis_host, port=args.redis_port, decode_responses=True)
    client.ping()
    run = f"pt-storm-{uuid.uuid4().hex[:12]}"
    try:
        # Sequential.
        seq = Storm(client, f"{run}-seq", jobs)
        start = time.perf_counter()
        for job in range(jobs):
            seq.deliver(job)
            seq.deliver(job)
        seq_secs = time.perf_counter() - start
        seq_effects = seq.check("sequential")

        # Concurrent.
        conc = Storm(client, f"{run}-conc", jobs)
        next_job = iter(range(jobs))
        next_lock = threading.Lock()
        pool = ThreadPoolExecutor(max_workers=2 * WORKERS)

        def worker():
            while True:
                with next_lock:
                    job = next(next_job, None)
                if job is None:
                    return
                a = pool.submit(conc.deliver, job)
                b = pool.submit(conc.deliver, job)
                a.result()
                b.result()

        threads = [threading.Thread(target=worker) for _ in range(WORKERS)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        conc_secs = time.perf_counter() - start
        pool.shutdown()
        conc_effects = conc.check("concurrent")
    finally:
        keys = list(client.scan_iter(match=f"{run}*", count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i : i + 500])

    print(
        json.dumps(
            {
                "peer": "aws-lambda-powertools-python",
                "peer_version": version("aws-lambda-powertools"),
                "backend": f"redis {client.info('server')['redis_version']}",
                "jobs": jobs,
                "sequential_deliveries_per_sec": round(2 * jobs / seq_secs),
                "concurrent_deliveries_per_sec": round(2 * jobs / conc_secs),
                "effects": {"sequential": seq_effects, "concurrent": conc_effects},
                "retries": {"sequential": seq.retries, "concurrent": conc.retries},
            }
        )
    )


if __name__ == "__main__":
    main()
