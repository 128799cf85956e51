from setuptools import find_packages, setup

setup(
    name="sglang-eagle3",
    version="0.1.0",
    description="Train, serve and benchmark EAGLE-3 speculative decoding drafts (SGLang-compatible).",
    python_requires=">=3.10",
    packages=find_packages(include=["sglang_eagle3", "sglang_eagle3.*"]),
    package_data={"sglang_eagle3": ["csrc/*.cpp", "csrc/*.h"]},      # compiled on first use (kernels.py) into the cache
    install_requires=[
        "torch>=2.4",
        "transformers>=4.57",
        "safetensors",
        "tokenizers",
        "gguf",
        "numpy",
        "tqdm",
        "matplotlib",
    ],
    extras_require={
        "train": ["deepspeed", "datasets", "tensorboard"],
        "serve": ["fastapi", "uvicorn", "openai", "httpx", "psutil"],
        "sglang": ["sglang==0.5.23"],
        "dev": ["pytest", "hypothesis"],
    },
    entry_points={
        "console_scripts": ["eagle3=sglang_eagle3.cli:main"],
        "sglang.srt.plugins": ["sglang_eagle3 = sglang_eagle3.sglang_plugin:register"],
    },
)
