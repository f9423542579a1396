"""bench/store: the artifact store's overhead. The smoke DAG, `REPS` times each, alternating, with a local
POSTTRAIN_HOME and with `s3://` on moto's S3 server on loopback (the same machine, a fresh bucket prefix and
mirror per run, so nothing is cached); wall seconds per run, their ratio, and the bytes each stage published.
Loopback has no bandwidth limit: the difference is the store's per-request work (listing, commit, manifest,
one PUT per file, downloads into the mirror), which a real bucket adds its latency to.

BENCH_SMALL=1 (bench/__init__.py): the smoke DAG with one RL specialist (bench.SMOKE_SETS), one run with `s3://`;
the local run is the small mode's smoke run (the same command on a local POSTTRAIN_HOME, run once for the other
benchmarks, its wall time recorded then)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from statistics import mean

import bench
from bench import mark, out_dir, size, small, smoke_args, smoke_wall_s

OUT = out_dir()
SMOKE_RUN = True  # small mode's local run is the smoke run (bench/__init__.py)
REPS = size(2, 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    import boto3
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    aws = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    try:
        for _ in range(200):
            try:
                urllib.request.urlopen(aws["AWS_ENDPOINT_URL"], timeout=1)
                break
            except OSError:
                time.sleep(0.3)
        s3 = boto3.client("s3", endpoint_url=aws["AWS_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id="bench", aws_secret_access_key="bench")
        s3.create_bucket(Bucket="bench")
        work = Path(tempfile.mkdtemp(prefix="bench-store-"))
        wall: dict[str, list[float]] = {"local": [], "s3": []}
        for rep in range(REPS):
            for kind in wall:
                if small() and kind == "local":  # the smoke run: the same command on a local home
                    wall[kind].append(smoke_wall_s())
                    print(f"{kind} rep {rep}: {wall[kind][-1]} s (the small mode's smoke run)", flush=True)
                    continue
                home = str(work / f"local{rep}") if kind == "local" else f"s3://bench/run{rep}"
                env = {**os.environ, **aws, "POSTTRAIN_HOME": home, "POSTTRAIN_LOCAL": str(work / f"mirror{rep}"),
                       "RAY_AUTH_MODE": "disabled"}
                t0 = time.perf_counter()
                args = smoke_args() if small() else ["run", "--profile", "smoke-dense"]
                p = subprocess.run([sys.executable, "-m", "posttrain.cli", *args], env=env, capture_output=True,
                                   text=True)
                if p.returncode:
                    raise RuntimeError(f"{kind} run failed:\n{p.stderr[-2000:]}")
                wall[kind].append(round(time.perf_counter() - t0, 1))
                print(f"{kind} rep {rep}: {wall[kind][-1]} s", flush=True)
        sizes: dict[str, int] = {}
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket="bench", Prefix="run0/artifacts/"):
            for o in page.get("Contents", []):
                stage = o["Key"].split("/")[2]
                sizes[stage] = sizes.get(stage, 0) + o["Size"]
    finally:
        server.terminate()
    fig = {"profile": "smoke-dense", "sets": bench.SMOKE_SETS if small() else [], "reps": REPS,
           "wall_s_local": wall["local"], "wall_s_s3": wall["s3"],
           "s3_over_local": round(mean(wall["s3"]) / mean(wall["local"]), 3),
           "s3_extra_s_per_run": round(mean(wall["s3"]) - mean(wall["local"]), 1),
           "bytes_published_per_stage": sizes, "bytes_published": sum(sizes.values()),
           "s3_server": "moto on loopback", "machine": f"{os.cpu_count()} cores"}
    fig = mark(fig)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "store.json").write_text(json.dumps(fig, indent=1))
    print(json.dumps(fig, indent=1))
