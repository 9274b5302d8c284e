from setuptools import find_packages, setup

setup(
    name="zero_engine",
    version="0.1.0",
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
)
