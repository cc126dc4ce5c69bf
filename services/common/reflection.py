"""gRPC server reflection under both grpc.reflection.v1 and grpc.reflection.v1alpha.

grpcio-reflection ships only v1alpha, and clients that speak only v1 (grpcurl and Postman try v1 first,
some tools know nothing else) get UNIMPLEMENTED from it. The v1 reflection.proto is v1alpha's, message
for message and field for field, in another package, so the wire format is the same: the one v1alpha
servicer answers both services. Its descriptor is derived from v1alpha's and added to the default pool,
so that a v1 client can also describe the reflection service itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection as v1alpha_reflection
from grpc_reflection.v1alpha import reflection_pb2

V1ALPHA_SERVICE_NAME: str = v1alpha_reflection.SERVICE_NAME
V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
_V1ALPHA_PACKAGE = "grpc.reflection.v1alpha"
_V1_PACKAGE = "grpc.reflection.v1"
# Where grpc keeps it (github.com/grpc/grpc-proto), with its own file options.
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _add_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    """Add grpc.reflection.v1's file to the pool, unless something (a newer grpcio-reflection) did."""
    try:
        pool.FindServiceByName(V1_SERVICE_NAME)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name = _V1_FILE
    proto.package = _V1_PACKAGE
    proto.options.Clear()
    proto.options.java_package = "io.grpc.reflection.v1"
    proto.options.java_outer_classname = "ServerReflectionProto"
    proto.options.java_multiple_files = True
    proto.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    old, new = f".{_V1ALPHA_PACKAGE}.", f".{_V1_PACKAGE}."
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(old):
                field.type_name = new + field.type_name.removeprefix(old)
    for service in proto.service:
        for method in service.method:
            method.input_type = new + method.input_type.removeprefix(old)
            method.output_type = new + method.output_type.removeprefix(old)
    pool.AddSerializedFile(proto.SerializeToString())


def enable_server_reflection(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Serve reflection v1 and v1alpha on `server`, listing `service_names` and both reflection services."""
    _add_v1_descriptor(descriptor_pool.Default())
    servicer = v1alpha_reflection.aio.ReflectionServicer([*service_names, V1ALPHA_SERVICE_NAME, V1_SERVICE_NAME])
    methods = {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
        )
    }
    for name in (V1ALPHA_SERVICE_NAME, V1_SERVICE_NAME):
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, methods),))
        server.add_registered_method_handlers(name, methods)
