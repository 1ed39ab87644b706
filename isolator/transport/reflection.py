"""gRPC server reflection, both versions: ``grpc.reflection.v1`` (grpcurl and current clients ask
for it first) and ``grpc.reflection.v1alpha`` (older clients).

grpcio-reflection ships only v1alpha, and its symbol lookup cannot find a method
(``grpcurl describe gpuisolator.v1.Isolator.Prepare`` failed). This servicer answers both versions
with the same code: the two protocols are the same messages under two package names, so the
v1alpha message classes carry v1 on the wire unchanged, and a v1 copy of the descriptor is added
to the pool so that the v1 service describes itself too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection_pb2 as pb

V1ALPHA = "grpc.reflection.v1alpha.ServerReflection"
V1 = "grpc.reflection.v1.ServerReflection"
V1_FILE = "grpc/reflection/v1/reflection.proto"


def _add_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    """Put grpc/reflection/v1/reflection.proto in ``pool``: v1alpha's file under the v1 package."""
    try:
        pool.FindFileByName(V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(proto)
    proto.name = V1_FILE
    proto.package = "grpc.reflection.v1"
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    for message in proto.message_type:
        for fld in message.field:
            if fld.type_name.startswith(old):
                fld.type_name = new + fld.type_name[len(old) :]
    for service in proto.service:
        for method in service.method:
            method.input_type = new + method.input_type[len(old) :]
            method.output_type = new + method.output_type[len(old) :]
    pool.Add(proto)


class Reflection:
    """Answers ServerReflectionInfo streams for the services named at construction."""

    def __init__(self, service_names: Iterable[str], pool: descriptor_pool.DescriptorPool | None = None) -> None:
        self._pool = pool or descriptor_pool.Default()
        _add_v1_descriptor(self._pool)
        self._services = tuple(sorted({*service_names, V1, V1ALPHA}))

    @property
    def services(self) -> tuple[str, ...]:
        return self._services

    def answer(self, request: Any) -> Any:
        kind = request.WhichOneof("message_request")
        try:
            if kind == "file_by_filename":
                return self._files(request, self._pool.FindFileByName(request.file_by_filename))
            if kind == "file_containing_symbol":
                return self._files(request, self._file_of_symbol(request.file_containing_symbol))
            if kind == "file_containing_extension":
                ext = request.file_containing_extension
                message = self._pool.FindMessageTypeByName(ext.containing_type)
                extension = self._pool.FindExtensionByNumber(message, ext.extension_number)
                return self._files(request, extension.file)  # type: ignore[attr-defined]
            if kind == "all_extension_numbers_of_type":
                message = self._pool.FindMessageTypeByName(request.all_extension_numbers_of_type)
                numbers = sorted(e.number for e in self._pool.FindAllExtensions(message))
                return pb.ServerReflectionResponse(
                    valid_host=request.host,
                    original_request=request,
                    all_extension_numbers_response=pb.ExtensionNumberResponse(
                        base_type_name=message.full_name, extension_number=numbers
                    ),
                )
            if kind == "list_services":
                return pb.ServerReflectionResponse(
                    valid_host=request.host,
                    original_request=request,
                    list_services_response=pb.ListServiceResponse(
                        service=[pb.ServiceResponse(name=name) for name in self._services]
                    ),
                )
        except KeyError:
            return self._error(request, grpc.StatusCode.NOT_FOUND, "not found")
        return self._error(request, grpc.StatusCode.INVALID_ARGUMENT, "unknown reflection request")

    def _file_of_symbol(self, symbol: str) -> Any:
        try:
            return self._pool.FindFileContainingSymbol(symbol)
        except KeyError:
            # A method (Service.Method) or an enum value: the pool finds only its parent.
            parent, _, leaf = symbol.rpartition(".")
            if not parent:
                raise
            try:
                service = self._pool.FindServiceByName(parent)
            except KeyError:
                raise KeyError(symbol) from None
            if leaf not in service.methods_by_name:
                raise KeyError(symbol) from None
            return service.file

    def _files(self, request: Any, file: Any) -> Any:
        """The file and every file it depends on, dependencies first."""
        ordered: list[Any] = []
        seen: set[str] = set()

        def visit(f: Any) -> None:
            if f.name in seen:
                return
            seen.add(f.name)
            for dep in f.dependencies:
                visit(dep)
            ordered.append(f)

        visit(file)
        ordered.reverse()  # the requested file first, as grpc's own implementations answer
        blobs = []
        for f in ordered:
            proto = descriptor_pb2.FileDescriptorProto()
            f.CopyToProto(proto)
            blobs.append(proto.SerializeToString())
        return pb.ServerReflectionResponse(
            valid_host=request.host,
            original_request=request,
            file_descriptor_response=pb.FileDescriptorResponse(file_descriptor_proto=blobs),
        )

    @staticmethod
    def _error(request: Any, code: grpc.StatusCode, message: str) -> Any:
        return pb.ServerReflectionResponse(
            valid_host=request.host,
            original_request=request,
            error_response=pb.ErrorResponse(error_code=code.value[0], error_message=message),
        )
