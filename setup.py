from setuptools import find_packages, setup

setup(
    name="sglang-eagle3",
    version="0.1.0",
    description="Train, serve and benchmark EAGLE-3 speculative decoding drafts (SGLang-compatible).",
    python_requires=">=3.10",
    packages=find_packages(include=["sglang_eagle3", "sglang_eagle3.*"]),
    # the C++ sources, compiled on first use (kernels/extension.py)
    package_data={"sglang_eagle3": ["kernels/csrc/*.cpp", "kernels/csrc/*.h"]},
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
        "dev": ["pytest", "hypothesis", "ruff", "import-linter"],
    },
    entry_points={
        "console_scripts": ["eagle3=sglang_eagle3.cli:main"],
        "sglang.srt.plugins": ["sglang_eagle3 = sglang_eagle3.serving.sglang_plugin:register"],
    },
)
