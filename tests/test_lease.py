"""One run computes a node at a time: a second run waits while the holder lives, and takes over at once from a
holder that died on this host or whose lease expired."""
import asyncio
import json
import socket
import subprocess
import sys

from posttrain.pipeline import lease


def test_a_second_run_waits_until_the_first_releases(tmp_path, monkeypatch):
    monkeypatch.setattr(lease, "POLL_S", 0.05)

    async def race():
        first = await lease.hold(None, str(tmp_path), "opd", "k" * 64, "run-1")
        waiting = asyncio.create_task(lease.hold(None, str(tmp_path), "opd", "k" * 64, "run-2"))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # the first still holds it
        first.release()
        second = await asyncio.wait_for(waiting, 5)
        second.release()
        return first.name, second.name

    assert asyncio.run(race()) == ("LEASE.1", "LEASE.2")


def test_a_dead_holder_on_this_host_is_not_waited_for(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    folder = tmp_path / "artifacts" / "opd" / ".leases" / ("k" * 16)
    folder.mkdir(parents=True)
    (folder / "LEASE.1").write_text(json.dumps({"run_id": "killed", "host": socket.gethostname(), "pid": gone.pid,
                                                "expires": 4e9}))
    held = asyncio.run(asyncio.wait_for(lease.hold(None, str(tmp_path), "opd", "k" * 64, "run-2"), 5))
    assert held.name == "LEASE.2"
    assert json.loads((folder / "LEASE.1").read_text())["run_id"] == "killed"  # nothing deleted or overwritten
    held.release()
    assert json.loads((folder / "LEASE.2").read_text())["expires"] == 0


def test_an_expired_lease_of_another_host_is_taken_over(tmp_path):
    folder = tmp_path / "artifacts" / "opd" / ".leases" / ("k" * 16)
    folder.mkdir(parents=True)
    (folder / "LEASE.1").write_text(json.dumps({"run_id": "lost", "host": "other-node", "pid": 1, "expires": 1.0}))
    held = asyncio.run(asyncio.wait_for(lease.hold(None, str(tmp_path), "opd", "k" * 64, "run-2"), 5))
    assert held.name == "LEASE.2"
    held.release()
