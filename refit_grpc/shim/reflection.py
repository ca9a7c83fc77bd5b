"""Server reflection, both versions: `grpc.reflection.v1` (what current grpcurl, Postman and
grpc-java ask first) and `grpc.reflection.v1alpha` (what older clients, grpcurl <= 1.8.6 among them,
only know).

grpcio-reflection (1.85.1) ships only `grpc_reflection.v1alpha`. The v1 protocol is the same
messages, field for field, under another package, so this module builds the v1 file descriptor
from the v1alpha one (package and type names renamed), adds it to the default descriptor pool
(so reflection describes the v1 service too), and serves the v1 method with the v1alpha servicer:
the bytes on the wire are identical.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection as v1alpha
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

V1ALPHA_SERVICE_NAME = v1alpha.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
V1_FILE = "grpc/reflection/v1/reflection.proto"
SERVICE_NAMES = (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)


def v1_file_descriptor():
    """The `grpc.reflection.v1` file descriptor, added to the default pool on first use."""
    pool = descriptor_pool.Default()
    try:
        return pool.FindFileByName(V1_FILE)
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    old = f".{proto.package}."
    proto.name, proto.package = V1_FILE, V1_PACKAGE
    proto.options.Clear()
    proto.options.java_package = "io.grpc.reflection.v1"
    proto.options.java_multiple_files = True
    proto.options.java_outer_classname = "ServerReflectionProto"
    proto.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    for message in proto.message_type:
        for f in message.field:
            if f.type_name:
                f.type_name = f.type_name.replace(old, f".{V1_PACKAGE}.")
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, f".{V1_PACKAGE}.")
            method.output_type = method.output_type.replace(old, f".{V1_PACKAGE}.")
    pool.Add(proto)
    return pool.FindFileByName(V1_FILE)


def enable_server_reflection(service_names: Iterable[str], server: grpc.Server) -> None:
    """Serve reflection v1 and v1alpha for `service_names` (the reflection services themselves
    are listed too)."""
    v1_file_descriptor()
    # One servicer for both: its answers are v1alpha messages, byte for byte v1's.
    servicer = v1alpha.ReflectionServicer([*service_names, *SERVICE_NAMES])
    for service in SERVICE_NAMES:
        server.add_generic_rpc_handlers((_handler(service, servicer),))


def _handler(service: str, servicer: v1alpha.ReflectionServicer) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(service, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
            response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString),
    })
