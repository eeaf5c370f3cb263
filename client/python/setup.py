"""Generates kvtier.v1 (the gRPC stubs and their .pyi type stubs) from the repository's
proto/ before the package is built, so that `pip install ./client/python` gives a package
that imports. The rest of the metadata is in pyproject.toml."""
import glob
import os

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO = os.path.normpath(os.path.join(HERE, "..", "..", "proto"))


def generate_stubs() -> None:
    protos = sorted(glob.glob(os.path.join(PROTO, "kvtier", "v1", "*.proto")))
    out = os.path.join(HERE, "kvtier", "v1")
    if not protos:
        if glob.glob(os.path.join(out, "kvtier_pb2.py")):
            return  # built before (an sdist carries them)
        raise RuntimeError(f"no .proto files under {PROTO}: build from the kvtier repository")
    from grpc_tools import protoc  # a build requirement (pyproject.toml)
    import grpc_tools

    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    args = ["protoc", f"-I{PROTO}", f"-I{include}", f"--python_out={HERE}",
            f"--pyi_out={HERE}", f"--grpc_python_out={HERE}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on " + " ".join(protos))
    init = os.path.join(out, "__init__.py")
    if not os.path.exists(init):
        with open(init, "w") as f:
            f.write('"""Stubs generated from proto/kvtier/v1 (kvtier_pb2, config_pb2, ...)."""\n')


class BuildPyWithStubs(build_py):
    def run(self):
        generate_stubs()
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
