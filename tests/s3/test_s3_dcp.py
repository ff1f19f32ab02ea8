"""The real S3 path: torch.distributed.checkpoint + s3torchconnector against a local SeaweedFS.

These tests pin down the facts the DCP/S3 backend is built on (see tests/s3/NOTES.md):
(a) dcp.save / dcp.load / dcp.async_save through S3StorageWriter / S3StorageReader round-trip bitwise;
(b) small objects (manifest, COMMITTED, listing step-N "folders", retention deletes) via s3torchconnector's S3Client;
(c) wrong credentials and a missing bucket raise S3Exception with a recognisable message.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ (helpers)
from helpers import assert_same_tree  # noqa: E402

pytestmark = pytest.mark.s3


@pytest.fixture(scope="module")
def s3c(s3_unavailable):
    """The s3torchconnector modules, or skip (fail under CI=true) when they are not installed."""
    try:
        import s3torchconnector  # noqa: F401
        import s3torchconnector.dcp as s3dcp
        from s3torchconnector import S3ClientConfig, S3Exception
        from s3torchconnector._s3client import S3Client
    except ImportError as e:  # s3torchconnector[dcp] needs tenacity too
        s3_unavailable(f"s3torchconnector[dcp] not importable: {e}")
    return type("S3C", (), dict(dcp=s3dcp, S3Client=S3Client, S3ClientConfig=S3ClientConfig,
                                S3Exception=S3Exception))


def _model_and_optim(seed: int):
    import torch
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optim


def _train_one_step(model, optim):
    import torch
    loss = model(torch.randn(5, 8)).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()


def _app_state(model, optim, step: int):
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optimizer": osd, "train_state": {"step": step, "tokens": step * 40},
            "rng": {"cpu": torch.get_rng_state()}}


def _roundtrip(s3c, s3_env, prefix: str, save_fn):
    """Train one step, save with save_fn(state, writer), load into a fresh model/optimizer, compare."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optim = _model_and_optim(seed=1)
    _train_one_step(model, optim)
    _train_one_step(model, optim)
    saved = _app_state(model, optim, step=2)
    reference = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                 "optimizer": get_state_dict(model, optim)[1]}

    uri = s3_env.uri(prefix)
    save_fn(saved, s3c.dcp.S3StorageWriter(s3_env.region, uri))

    # fresh, differently initialised objects; get_state_dict on a fresh optimizer allocates its state
    model2, optim2 = _model_and_optim(seed=99)
    target = _app_state(model2, optim2, step=0)
    target["train_state"] = {"step": -1, "tokens": -1}
    dcp.load(target, storage_reader=s3c.dcp.S3StorageReader(s3_env.region, uri))
    set_state_dict(model2, optim2, model_state_dict=target["model"], optim_state_dict=target["optimizer"])

    assert_same_tree(reference["model"], model2.state_dict(), "model")
    assert_same_tree(reference["optimizer"], get_state_dict(model2, optim2)[1], "optimizer")
    assert_same_tree(saved["train_state"], target["train_state"], "train_state")
    assert_same_tree(saved["rng"], target["rng"], "rng")
    return s3_env.list_keys(prefix.strip("/") + "/")


# ---------------------------------------------------------------------------- (a) DCP over S3

def test_dcp_save_load_roundtrip_s3(s3c, s3_env):
    import torch.distributed.checkpoint as dcp

    keys = _roundtrip(s3c, s3_env, "exp-a/step-00000001",
                      lambda sd, writer: dcp.save(sd, storage_writer=writer))
    # DCP layout over S3 (no process group => single rank): data file(s) + .metadata (tmp renamed away)
    assert "exp-a/step-00000001/.metadata" in keys, keys
    assert any(k.endswith(".distcp") for k in keys), keys
    assert not any(k.endswith(".tmp") for k in keys), keys
    print("\nDCP keys on S3:", keys)


def test_dcp_async_save_s3_returns_future(s3c, s3_env):
    import torch.distributed.checkpoint as dcp
    from concurrent.futures import Future

    results = {}

    def save(sd, writer):
        # S3StorageWriter is a FileSystemWriter == BlockingAsyncStager: it stages (CPU copy) synchronously,
        # so async_save returns a plain Future, not an AsyncSaveResponse.
        fut = dcp.async_save(sd, storage_writer=writer)
        results["type"] = type(fut)
        assert isinstance(fut, Future), type(fut)
        results["metadata"] = fut.result(timeout=120)

    keys = _roundtrip(s3c, s3_env, "exp-async/step-00000003", save)
    assert "exp-async/step-00000003/.metadata" in keys, keys
    assert type(results["metadata"]).__name__ == "Metadata"


def test_dcp_localhost_endpoint_needs_path_style(s3c, s3_server, monkeypatch):
    """Hostname endpoints: s3torchconnector needs S3ClientConfig(force_path_style=True) (no env var for it)."""
    import torch
    import torch.distributed.checkpoint as dcp

    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url.replace("127.0.0.1", "localhost"))
    cfg = s3c.S3ClientConfig(force_path_style=True)
    uri = s3_server.uri("exp-localhost/step-00000001")
    sd = {"w": torch.arange(6, dtype=torch.float32)}
    dcp.save(sd, storage_writer=s3c.dcp.S3StorageWriter(s3_server.region, uri, s3client_config=cfg))
    out = {"w": torch.zeros(6)}
    dcp.load(out, storage_reader=s3c.dcp.S3StorageReader(s3_server.region, uri, s3client_config=cfg))
    assert torch.equal(out["w"], sd["w"])


# ---------------------------------------------------------------------------- (b) small objects

def _put(client, bucket, key, data: bytes):
    with client.put_object(bucket, key) as w:  # S3Writer: upload happens on close()
        w.write(data)


def _common_prefixes(client, bucket, prefix):
    out = []
    for page in client.list_objects(bucket, prefix, "/"):  # ListObjectStream, paginates itself
        out += page.common_prefixes
    return out


def _keys(client, bucket, prefix):
    out = []
    for page in client.list_objects(bucket, prefix):
        out += [o.key for o in page.object_info]
    return out


def test_s3client_put_get_list_delete(s3c, s3_env):
    client = s3c.S3Client(s3_env.region)  # endpoint + credentials from AWS_* env
    b = s3_env.bucket
    exp = "exp-b/"
    manifest = {"step": 1, "world_size": 1, "backend": "dcp"}
    for step, committed in ((1, True), (2, True), (10, True), (11, False)):
        d = f"{exp}step-{step:08d}/"
        _put(client, b, d + "__0_0.distcp", b"x" * 100)
        _put(client, b, d + "manifest.json", json.dumps(dict(manifest, step=step)).encode())
        if committed:
            _put(client, b, d + "COMMITTED", b"")  # zero-byte object works

    # get: S3Reader is a file-like object
    assert json.loads(client.get_object(b, exp + "step-00000010/manifest.json").read())["step"] == 10
    # overwrite = last writer wins
    _put(client, b, exp + "step-00000010/manifest.json", b'{"step": 10, "v": 2}')
    assert json.loads(client.get_object(b, exp + "step-00000010/manifest.json").read())["v"] == 2

    # "directories": delimiter listing returns common prefixes
    dirs = _common_prefixes(client, b, exp)
    assert dirs == [exp + f"step-{s:08d}/" for s in (1, 2, 10, 11)], dirs

    # existence: head_object raises S3Exception("Service error: The object was not found")
    def exists(key):
        try:
            client.head_object(b, key)
            return True
        except s3c.S3Exception as e:
            if str(e) != "Service error: The object was not found":
                raise
            return False

    assert client.head_object(b, exp + "step-00000001/__0_0.distcp").size == 100
    committed = [d for d in dirs if exists(d + "COMMITTED")]
    latest = max(committed, key=lambda d: int(d.rstrip("/").rsplit("-", 1)[1]))
    assert latest == exp + "step-00000010/"

    # retention: delete every key under a prefix (there is no recursive delete)
    for k in _keys(client, b, exp + "step-00000001/"):
        client.delete_object(b, k)
    assert _keys(client, b, exp + "step-00000001/") == []
    client.delete_object(b, exp + "does-not-exist")  # deleting a missing key is not an error
    # GOTCHA (SeaweedFS, not AWS): the emptied "folder" still lists as a common prefix (filer directory);
    # never infer a checkpoint from a prefix alone. Deleting "<prefix>/" removes it (a no-op on AWS S3).
    assert exp + "step-00000001/" in _common_prefixes(client, b, exp)
    client.delete_object(b, exp + "step-00000001/")
    assert _common_prefixes(client, b, exp) == [exp + f"step-{s:08d}/" for s in (2, 10, 11)]
    # the stdlib client in conftest sees the same bucket
    assert s3_env.get(exp + "step-00000002/COMMITTED") == b""


# ---------------------------------------------------------------------------- (c) errors

def _client_with(s3c, s3_server, monkeypatch, **creds):
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    for k, v in s3_server.env(**creds).items():
        monkeypatch.setenv(k, v)
    return s3c.S3Client(s3_server.region)


def _err(s3c, fn):
    with pytest.raises(s3c.S3Exception) as ei:
        fn()
    return str(ei.value)


def test_wrong_secret_is_rejected(s3c, s3_server, monkeypatch):
    c = _client_with(s3c, s3_server, monkeypatch, secret_key="wrong-secret")
    b = s3_server.bucket
    msg = _err(s3c, lambda: list(c.list_objects(b, "")))
    assert msg == ("Client error: Forbidden: The request signature we calculated does not match the signature "
                   "you provided. Check your key and signing method."), msg
    assert _err(s3c, lambda: _put(c, b, "x", b"1")).startswith("Client error: Forbidden:")
    # HEAD has no body, so no message
    assert _err(s3c, lambda: c.head_object(b, "x")) == "Client error: Forbidden: <no message>"


def test_unknown_access_key_is_rejected(s3c, s3_server, monkeypatch):
    c = _client_with(s3c, s3_server, monkeypatch, access_key="NOSUCHKEY", secret_key="x")
    msg = _err(s3c, lambda: list(c.list_objects(s3_server.bucket, "")))
    assert msg == "Client error: Forbidden: The access key ID you provided does not exist in our records.", msg


def test_missing_credentials(s3c, s3_server, monkeypatch):
    c = _client_with(s3c, s3_server, monkeypatch)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    c = s3c.S3Client(s3_server.region)
    msg = _err(s3c, lambda: list(c.list_objects(s3_server.bucket, "")))
    assert msg == "Client error: No signing credentials available, see CRT debug logs", msg


def test_missing_bucket(s3c, s3_env):
    c = s3c.S3Client(s3_env.region)
    assert _err(s3c, lambda: list(c.list_objects("no-such-bucket", ""))) == \
        "Service error: The bucket does not exist"
    # HEAD cannot tell a missing bucket from a missing key
    assert _err(s3c, lambda: c.head_object("no-such-bucket", "k")) == "Service error: The object was not found"
    # PUT: a long CRT dump that contains the S3 error code
    msg = _err(s3c, lambda: _put(c, "no-such-bucket", "k", b"1"))
    assert msg.startswith("Client error: Unknown response error: MetaRequestResult { response_status: 404")
    assert "<Code>NoSuchBucket</Code>" in msg


def test_dcp_save_errors_surface(s3c, s3_server, monkeypatch):
    """What dcp.save / dcp.load raise on S3 failures (the product must turn these into one line)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from torch.distributed.checkpoint.api import CheckpointException

    sd = {"w": torch.ones(3)}
    _client_with(s3c, s3_server, monkeypatch)  # good env
    # NB: CheckpointException derives from BaseException, not Exception: `except Exception` misses it
    with pytest.raises(CheckpointException) as ei:
        dcp.save(sd, storage_writer=s3c.dcp.S3StorageWriter(s3_server.region, "s3://no-such-bucket/x/step-1"))
    missing_bucket = ei.value
    _client_with(s3c, s3_server, monkeypatch, secret_key="wrong-secret")
    with pytest.raises(CheckpointException) as ei:
        dcp.save(sd, storage_writer=s3c.dcp.S3StorageWriter(s3_server.region, s3_server.uri("x/step-1")))
    bad_creds = ei.value
    _client_with(s3c, s3_server, monkeypatch)
    with pytest.raises(BaseException) as ei:
        dcp.load({"w": torch.zeros(3)},
                 storage_reader=s3c.dcp.S3StorageReader(s3_server.region, s3_server.uri("never-saved/step-1")))
    missing_ckpt = ei.value
    assert isinstance(missing_ckpt, CheckpointException), repr(missing_ckpt)

    leaf = {name: _rank_failures(e) for name, e in
            (("missing bucket", missing_bucket), ("bad creds", bad_creds), ("missing ckpt", missing_ckpt))}
    for name, excs in leaf.items():
        print(f"\n[{name}] " + " | ".join(f"{type(x).__module__}.{type(x).__name__}: {x}" for x in excs))
    (mb,), (bc,), (mc,) = leaf.values()  # one rank (no process group)
    assert isinstance(mb, s3c.S3Exception) and "<Code>NoSuchBucket</Code>" in str(mb), repr(mb)
    assert isinstance(bc, s3c.S3Exception) and str(bc).startswith("Client error: Forbidden: "), repr(bc)
    # load of a prefix without .metadata: DCP turns the GET error into an AssertionError text
    assert isinstance(mc, AssertionError), repr(mc)
    assert "metadata is None; global metadata read failed: Service error: The key does not exist" in str(mc)


def _rank_failures(e) -> list:
    """CheckpointException.failures is {rank: (exception, traceback.StackSummary)}: the per-rank exceptions."""
    return [v[0] if isinstance(v, tuple) else v for _, v in sorted(e.failures.items())]


# ---------------------------------------------------------------------------- (a') 2 ranks, torchrun/gloo

_TWO_RANK_SCRIPT = r'''
import os, sys, warnings
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.nn.parallel import DistributedDataParallel as DDP
from s3torchconnector.dcp import S3StorageWriter, S3StorageReader

def build(seed):
    torch.manual_seed(seed)
    m = DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))
    return m, torch.optim.AdamW(m.parameters())

def main():
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    rank, region, base, mode = dist.get_rank(), os.environ["AWS_REGION"], sys.argv[1], sys.argv[2]
    m, o = build(0)
    m(torch.randn(3, 4)).sum().backward(); o.step()
    msd, osd = get_state_dict(m, o)
    sd = {"model": msd, "optim": osd, "train": {"step": 5}}
    uri = f"{base}/step-00000005"
    if mode == "sync":
        dcp.save(sd, storage_writer=S3StorageWriter(region, uri))
    else:
        ckpt_pg = dist.new_group(backend="gloo")  # dedicated group for the background save
        kind = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
        fut = dcp.async_save(sd, storage_writer=S3StorageWriter(region, uri), process_group=ckpt_pg,
                             async_checkpointer_type=kind)
        fut.result(timeout=300)
    dist.barrier()
    m2, o2 = build(1)
    msd2, osd2 = get_state_dict(m2, o2)
    sd2 = {"model": msd2, "optim": osd2, "train": {"step": -1}}
    dcp.load(sd2, storage_reader=S3StorageReader(region, uri))
    set_state_dict(m2, o2, model_state_dict=sd2["model"], optim_state_dict=sd2["optim"])
    ok = sd2["train"]["step"] == 5 and all(torch.equal(a, b) for a, b in
                                           zip(m.state_dict().values(), m2.state_dict().values()))
    print(f"RANK{rank} OK={ok}", flush=True)
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":  # required: the PROCESS async executor spawns and re-imports __main__
    main()
'''


@pytest.mark.parametrize("mode", ["sync", "thread", "process"])
def test_dcp_two_ranks_gloo_s3(s3c, s3_server, tmp_path, mode):
    import socket
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "two_rank.py"
    script.write_text(_TWO_RANK_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = str(Path(sys.executable).parent / "torchrun")
    prefix = f"exp-2r-{mode}"
    env = s3_server.full_env()
    env.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    proc = subprocess.run([torchrun, "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={port}",
                           str(script), s3_server.uri(prefix), mode],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "RANK0 OK=True" in out and "RANK1 OK=True" in out, out[-4000:]
    keys = s3_server.list_keys(prefix + "/")
    assert keys == [f"{prefix}/step-00000005/{n}" for n in (".metadata", "__0_0.distcp", "__1_0.distcp")], keys


def test_dcp_load_everything_without_template(s3c, s3_env):
    """For inspect/convert: read a whole S3 DCP checkpoint into a plain dict without knowing its structure."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    uri = s3_env.uri("exp-inspect/step-00000004")
    sd = {"model": {"w": torch.arange(4.0), "b": torch.ones(2, dtype=torch.bfloat16)}, "train": {"step": 4}}
    dcp.save(sd, storage_writer=s3c.dcp.S3StorageWriter(s3_env.region, uri), no_dist=True)
    # dcp.load passes a *copy* of the dict to the planner, so an empty dict stays empty; the rebuilt nested
    # dict is planner.original_state_dict (format_utils.dcp_to_torch_save uses the private _load_state_dict).
    out, planner = {}, _EmptyStateDictLoadPlanner()
    dcp.load(out, storage_reader=s3c.dcp.S3StorageReader(s3_env.region, uri), planner=planner, no_dist=True)
    assert out == {}
    assert_same_tree(sd, planner.original_state_dict)
