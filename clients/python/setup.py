"""Generates lorastep/v1 (messages and gRPC stubs) from the repository's proto/ before
setuptools looks for packages, so `pip install clients/python` needs no generated files in
the tree (protoc and grpc_python_plugin: Debian's protobuf-compiler, protobuf-compiler-grpc)."""
import os
import subprocess

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_ROOT = os.path.normpath(os.path.join(HERE, "..", "..", "proto"))


def generate_stubs():
    protos = [os.path.join(PROTO_ROOT, "lorastep", "v1", f) for f in ("trainer.proto", "worker.proto")]
    if not all(os.path.exists(p) for p in protos):
        if os.path.exists(os.path.join(HERE, "lorastep", "v1", "trainer_pb2.py")):
            return  # an sdist or a tree with generated stubs
        raise SystemExit(f"lorastep: {PROTO_ROOT} has no lorastep/v1 protos; install from a repository checkout")
    subprocess.check_call(["protoc", f"--proto_path={PROTO_ROOT}", f"--python_out={HERE}", f"--grpc_python_out={HERE}",
                           "--plugin=protoc-gen-grpc_python=/usr/bin/grpc_python_plugin", *protos])
    open(os.path.join(HERE, "lorastep", "v1", "__init__.py"), "a").close()


generate_stubs()
setup()
