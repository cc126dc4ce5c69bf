"""Parse GenerateRequest bytes ourselves so bad wire input becomes INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import functools
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, FileDescriptor
from google.protobuf.message import DecodeError, Message

from services.common.proto.meshserve.v1 import generation_pb2, sampling_pb2
from services.common.sampling_checks import MAX_CHAT_MESSAGES, MAX_STOP_STRINGS, check_count
from services.gateway.validation import ValidationError

_PACKAGE = "meshserve.v1"
_RAW_PACKAGE = "meshserve.v1.raw"
_UTF8_FIX = "send UTF-8 text, or token_ids"


def _mirror_file(fd: FileDescriptor) -> descriptor_pb2.FileDescriptorProto:
    """Copy a file descriptor into the raw package with every string field turned into bytes."""
    proto = descriptor_pb2.FileDescriptorProto()
    fd.CopyToProto(proto)
    proto.name = proto.name.replace("meshserve/v1/", "meshserve/v1/raw/")
    proto.package = _RAW_PACKAGE
    deps = [d.replace("meshserve/v1/", "meshserve/v1/raw/") for d in proto.dependency]
    del proto.dependency[:]
    proto.dependency.extend(deps)
    del proto.service[:]  # only the messages are needed
    proto.ClearField("options")

    def fix(messages: Any) -> None:
        for msg in messages:
            for field in msg.field:
                if field.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING:
                    field.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
                if field.type_name.startswith(f".{_PACKAGE}."):
                    field.type_name = f".{_RAW_PACKAGE}." + field.type_name[len(_PACKAGE) + 2 :]
            fix(msg.nested_type)

    fix(proto.message_type)
    return proto


@functools.cache
def raw_request_class() -> type[Message]:
    """The mirror of GenerateRequest whose string fields are bytes, so any payload parses."""
    pool = descriptor_pool.DescriptorPool()
    pool.Add(_mirror_file(sampling_pb2.DESCRIPTOR))
    pool.Add(_mirror_file(generation_pb2.DESCRIPTOR))
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_RAW_PACKAGE}.GenerateRequest"))


def _first_invalid_utf8(msg: Message, prefix: str = "") -> str | None:
    for field, value in msg.ListFields():
        path = f"{prefix}{field.name}"
        repeated = field.is_repeated
        items: list[Any] = list(value) if repeated else [value]
        for i, item in enumerate(items):
            item_path = f"{path}[{i}]" if repeated else path
            if field.type == FieldDescriptor.TYPE_BYTES and _is_mirrored_string(msg.DESCRIPTOR, field.name):
                try:
                    item.decode("utf-8")
                except UnicodeDecodeError:
                    return item_path
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                found = _first_invalid_utf8(item, item_path + ".")
                if found is not None:
                    return found
    return None


def _original_descriptor(raw: Any) -> Descriptor | None:
    name = raw.full_name
    if not name.startswith(_RAW_PACKAGE + "."):
        return None
    short = name[len(_RAW_PACKAGE) + 1 :]
    for fd in (generation_pb2.DESCRIPTOR, sampling_pb2.DESCRIPTOR):
        if short in fd.message_types_by_name:
            return fd.message_types_by_name[short]
    return None


def _is_mirrored_string(raw: Any, field_name: str) -> bool:
    # Only fields that are strings in the real contract must hold UTF-8; true bytes fields may hold anything.
    original = _original_descriptor(raw)
    return original is not None and original.fields_by_name[field_name].type == FieldDescriptor.TYPE_STRING


def parse_generate_request(data: bytes) -> generation_pb2.GenerateRequest:
    """Parse wire bytes into a GenerateRequest, raising ValidationError that names the offending field."""
    req = generation_pb2.GenerateRequest()
    try:
        req.ParseFromString(data)
        return req
    except DecodeError as exc:
        first_error: Exception = exc
    raw = raw_request_class()()
    try:
        raw.ParseFromString(data)
    except DecodeError:
        raise ValidationError(
            "request",
            f"the request is not a valid meshserve.v1.GenerateRequest message ({first_error}); "
            "build it with the generated meshserve.v1 stubs",
        ) from first_error
    # The caps on repeated strings first: walking a million chat messages for the bad one would hold
    # the event loop for seconds.
    check_count(len(raw.chat.messages), MAX_CHAT_MESSAGES, "chat.messages", "chat messages")  # type: ignore[attr-defined]
    check_count(len(raw.sampling.stop), MAX_STOP_STRINGS, "sampling.stop", "stop strings")  # type: ignore[attr-defined]
    path = _first_invalid_utf8(raw)
    if path is None:
        raise ValidationError(
            "request", f"the request could not be parsed as meshserve.v1.GenerateRequest ({first_error})"
        ) from first_error
    raise ValidationError(path, f"{path} is not valid UTF-8; {_UTF8_FIX}") from first_error


def _fill(msg: Message, fields: dict[str, Any]) -> None:
    for name, value in fields.items():
        field = msg.DESCRIPTOR.fields_by_name[name]
        if field.is_repeated:
            container = getattr(msg, name)
            for item in value:
                if field.type == FieldDescriptor.TYPE_MESSAGE:
                    _fill(container.add(), item)
                else:
                    container.append(item.encode() if isinstance(item, str) else item)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            sub = getattr(msg, name)
            sub.SetInParent()
            _fill(sub, value)
        else:
            setattr(msg, name, value.encode() if isinstance(value, str) else value)


def encode_raw_request(**fields: Any) -> bytes:
    """Serialize a GenerateRequest whose text fields may be arbitrary bytes (str values are UTF-8 encoded).

    Nested messages are dicts, e.g. `chat={"messages": [{"role": "user", "content": b"\\xff"}]}`.
    """
    msg = raw_request_class()()
    _fill(msg, fields)
    return msg.SerializeToString()
