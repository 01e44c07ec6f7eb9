"""Cluster workers on a real local Ray instance, driven from a separate process whose
working directory holds a `coli/` package that cannot be imported (a source checkout not
built in place): the workers still import the installed package (Ray puts the driver's
directory on their path), and two clusters of two models in one Ray instance never share
a worker (each answers with its own model)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

pytest.importorskip("ray")

from server_kit import build_chat_model  # noqa: E402

WAIT = 600  # seconds: Ray and two workers starting on a loaded machine; only a hang reaches it

DRIVER = textwrap.dedent('''
    import json, sys
    import coli.cluster
    from coli.sampling import SamplingParams
    from coli.scheduler.events import Finished, Started

    def info(runner):
        (handle,) = runner.transport.handles.values()
        import ray
        return ray.get(handle.status.remote(), timeout=300)["info"]

    out = {}
    a = coli.cluster.start(None, workers=1, address="local", num_cpus=2, load_options=dict(threads=1),
                           start_timeout=300)
    b = coli.cluster.start(sys.argv[1], workers=1, address="auto", load_options=dict(threads=1),
                           start_timeout=300)
    for name, runner in (("builtin", a), ("chat", b)):
        evs = list(runner.submit([1, 2, 3], max_tokens=2, sampling=SamplingParams(temperature=0)).events(timeout=300))
        out[name] = dict(workers=sorted(runner.transport.handles), model=info(runner)["model"],
                         finished=any(isinstance(e, Finished) for e in evs))
    print("RESULT " + json.dumps(out))
    b.close(); a.close()
''')


def test_workers_import_the_installed_package_and_keep_to_their_model(tmp_path):
    chat = build_chat_model(tmp_path)
    checkout = tmp_path / "checkout"
    (checkout / "coli").mkdir(parents=True)
    (checkout / "coli" / "__init__.py").write_text("raise ImportError('the unbuilt source tree was imported')\n")
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    r = subprocess.run([sys.executable, str(script), str(chat)], cwd=checkout, capture_output=True, text=True,
                       timeout=WAIT)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(line[7:])
    assert out["builtin"]["finished"] and out["chat"]["finished"]
    assert out["builtin"]["workers"] != out["chat"]["workers"]  # no worker shared across models
    assert out["chat"]["model"] == str(chat)
    assert out["builtin"]["model"] != str(chat)


CONNECT = textwrap.dedent('''
    import sys, ray
    from coli.cluster import ray_backend
    ray_backend.connect("auto", num_cpus=1)
    print("GCS " + ray.get_runtime_context().gcs_address, flush=True)
    sys.stdin.readline()  # until told
    print("NODES " + str(sum(n["Alive"] for n in ray.nodes())), flush=True)
''')


def test_a_server_does_not_join_the_ray_instance_another_started_for_itself(tmp_path):
    script = tmp_path / "connect.py"
    script.write_text(CONNECT)
    # Ray's own directory, short (it holds sockets) and private: other Ray instances on this
    # machine (other test runs) are not found by "auto", only the first server's
    env = {**os.environ, "RAY_TMPDIR": tempfile.mkdtemp(prefix="r", dir="/tmp")}

    def start():
        p = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdin=subprocess.PIPE, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = p.stdout.readline()
        assert line.startswith("GCS "), line + p.stderr.read()[-3000:] if p.poll() is not None else line
        return p, line.split()[1]

    first, first_gcs = start()
    second = None
    try:
        second, second_gcs = start()
        assert second_gcs != first_gcs  # it started its own instead of joining one that ends with `first`
        first.communicate("\n", timeout=WAIT)  # the first server exits, its Ray instance with it
        out, err = second.communicate("\n", timeout=WAIT)
        assert "NODES 1" in out, out + err[-3000:]  # the second server's instance lives on
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
