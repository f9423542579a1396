"""Screenshots of what a reviewer sees, for a person to look at: the MLflow UI (the experiment's runs, the latest
pipeline run, its registered model version) and the run's report.html, rendered by headless Chromium.

`make ui-shots` (or `python -m posttrain.tools.ui_shots`) on a home with a finished run; the PNGs go to <home>/ui/."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from posttrain.pipeline import tracking
from posttrain.pipeline.report_html import chromium
from posttrain.pipeline.run import home_dir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shoot(exe: str, url: str, png: Path) -> Path:
    subprocess.run([exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1400,1000", "--virtual-time-budget=15000", f"--screenshot={png}", url],
                   check=True, capture_output=True, timeout=180)
    return png


def main() -> int:
    home = home_dir()
    exe = chromium()
    if exe is None:
        print("ui-shots: no Chromium (Debian: apt-get install chromium, or set POSTTRAIN_CHROMIUM)", file=sys.stderr)
        return 2
    latest = home / "latest" / "report.json"
    if not latest.exists():
        print(f"ui-shots: no finished run under {home}: `make run` first", file=sys.stderr)
        return 2
    report = json.loads(latest.read_text())
    out = home / "ui"
    out.mkdir(exist_ok=True)
    c = tracking.client(home)
    exp = tracking.experiment_id(c, home)  # tags an older store as a training experiment too
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", tracking.tracking_uri(home),
                               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                              env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(120):
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        ml = f"?{tracking.ML_VIEW}"
        pages = {"experiment": f"{base}/#/experiments/{exp}{ml}",
                 "pipeline_run": f"{base}/#/experiments/{exp}/runs/{report['mlflow_run_id']}{ml}"}
        if reg := report.get("registered_model"):
            name, version = reg.rsplit("@", 1)
            pages["model_version"] = f"{base}/#/models/{name}/versions/{version}{ml}"
        if report.get("report_html"):
            pages["report_html"] = Path(report["report_html"]).resolve().as_uri()
        for name, url in pages.items():
            print(f"{_shoot(exe, url, out / f'{name}.png')}  <- {url}")
    finally:
        server.terminate()
        server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
