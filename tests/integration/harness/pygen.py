"""Python modules generated from proto/ with grpc_tools (the real grpcio client), shared by the tests that speak the
internal protocol. health.proto is copied under another folder name: a top-level `grpc` package of generated code
would shadow grpcio."""
import importlib
import pathlib
import shutil
import sys

MODULES = ("baton.v1.generate_pb2", "baton.v1.generate_pb2_grpc", "baton.v1.node_pb2", "baton.v1.node_pb2_grpc",
           "baton_health.health_pb2", "baton_health.health_pb2_grpc")


def generate(proto_dir: pathlib.Path, src: pathlib.Path, out: pathlib.Path) -> dict:
    """Compiles the protos found under proto_dir into out (src: scratch copy) and returns {module name: module}."""
    from grpc_tools import protoc

    shutil.copytree(proto_dir / "baton", src / "baton")
    (src / "baton_health").mkdir()
    shutil.copy(proto_dir / "grpc" / "health" / "v1" / "health.proto", src / "baton_health" / "health.proto")
    files = ["baton/v1/generate.proto", "baton/v1/node.proto", "baton_health/health.proto"]
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    rc = protoc.main(["protoc", f"-I{src}", f"-I{include}", f"--python_out={out}", f"--grpc_python_out={out}", *files])
    assert rc == 0, "grpc_tools.protoc failed"
    sys.path.insert(0, str(out))
    try:
        return {name: importlib.import_module(name) for name in MODULES}
    finally:
        sys.path.remove(str(out))


def api_stubs(tmp_path_factory) -> tuple:
    """(generate_pb2, generate_pb2_grpc): the public baton.v1.Generation API, for tests that are its clients."""
    root = pathlib.Path(__file__).resolve().parents[3]
    mods = generate(root / "proto", tmp_path_factory.mktemp("protos"), tmp_path_factory.mktemp("pygen"))
    return mods["baton.v1.generate_pb2"], mods["baton.v1.generate_pb2_grpc"]
