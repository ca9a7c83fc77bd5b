"""Generates the gRPC code from protos/ whenever the package is built (wheel or editable)."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent


def generate_protos() -> None:
    from grpc_tools import protoc  # build requirement, see pyproject.toml

    protos = sorted(str(p.relative_to(ROOT / "protos")) for p in (ROOT / "protos").rglob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    out = str(ROOT)
    args = ["protoc", f"-I{ROOT / 'protos'}", f"-I{include}", f"--python_out={out}",
            f"--pyi_out={out}", f"--grpc_python_out={out}",
            *(str(ROOT / "protos" / p) for p in protos)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        generate_protos()
        super().run()


if __name__ == "__main__":  # setuptools runs this file as __main__; `make proto` imports it
    setup(cmdclass={"build_py": BuildPyWithProtos})
