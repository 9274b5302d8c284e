import os
import re
import subprocess

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


def read_version() -> str:
    # zero_engine/_version.py is the one place the version is written (read as text: nothing is imported).
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "zero_engine", "_version.py")) as f:
        return re.search(r'^VERSION = "([^"]+)"', f.read(), re.MULTILINE).group(1)


def git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class BuildWithGitInfo(build_py):
    """Record the commit and branch built (zero_engine.__git_hash__ / __git_branch__) in the built package."""

    def run(self):
        super().run()
        if self.dry_run:
            return
        target = os.path.join(self.build_lib, "zero_engine", "_git_info.py")
        with open(target, "w") as f:
            f.write(f"git_hash = {git('rev-parse', '--short', 'HEAD')!r}\n"
                    f"git_branch = {git('rev-parse', '--abbrev-ref', 'HEAD')!r}\n")


setup(
    name="zero_engine",
    version=read_version(),
    description="ZeRO-3 memory-optimization runtime for PyTorch, DeepSpeed-config compatible",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["zero_engine", "zero_engine.*"]),
    # csrc/ is compiled at first use by zero_engine.ops (JIT through torch.utils.cpp_extension + ninja).
    package_data={"zero_engine": ["../csrc/**/*", "../config_schemas/*.json"]},
    include_package_data=True,
    install_requires=["torch>=2.4", "pydantic>=2", "psutil", "ninja"],
    extras_require={
        "dev": ["pytest", "pytest-timeout", "jsonschema", "numpy", "matplotlib", "transformers>=5", "safetensors",
                "tqdm"],
        # zero_engine.hf (from_pretrained into shards, save_pretrained from shards); the package never requires it
        "hf": ["transformers>=5", "safetensors", "tqdm"],
        "plot": ["matplotlib"],
    },
    entry_points={"console_scripts": ["zero-engine=zero_engine.cli:main"]},
    cmdclass={"build_py": BuildWithGitInfo},
)
