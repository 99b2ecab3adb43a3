"""rlcode: a JAX research codebase for training coding agents with reinforcement learning."""

from setuptools import find_packages, setup

# Ranges are the releases this project is tested against (lower bound) up to the next release
# line that may break the APIs we use (upper bound).
INSTALL_REQUIRES = [
    "jax>=0.10,<0.11",
    "jaxlib>=0.10,<0.11",
    "flax>=0.12,<0.13",
    "optax>=0.2.5,<0.3",
    "orbax-checkpoint>=0.12,<0.13",
    "chex>=0.1.90,<0.2",
    "ml-collections>=1.0,<2",
    "absl-py>=2.1,<3",
    "tensorboard>=2.18,<3",
    "numpy>=2.0,<3",
    "matplotlib>=3.9,<4",
    # Loads Hugging Face tokenizer.json files behind the project's tokenizer interface.
    "tokenizers>=0.20,<1",
    # The agent's `lint` tool.
    "pyflakes>=3,<4",
    # Models' own chat templates (rlcode.chat_template).
    "jinja2>=3.1,<4",
    # Triton ships Linux wheels only; elsewhere the Triton paths report themselves unavailable
    # and the XLA reference of every kernel is used.
    "triton>=3.4,<4; platform_system == 'Linux'",
]

EXTRAS_REQUIRE = {
    # ray is here so the test suite exercises the Ray sandbox backend on a local cluster.
    # pytest-xdist runs the suite on every core (README, Tests).
    # safetensors and transformers (without torch): the reference implementations of the checkpoint
    # format and of chat-template rendering, which the tests check ours against.
    "test": ["pytest>=8,<10", "pytest-xdist>=3.5,<4", "ray>=2.40,<3", "safetensors>=0.4,<1",
             "transformers>=4.50,<6"],
    "gpu": ["jax[cuda12]>=0.10,<0.11", "jax-triton>=0.3,<0.4"],
    "distributed": ["ray>=2.40,<3"],
}

setup(
    name="rlcode",
    version="0.1.0",
    description="Reinforcement learning for coding agents in JAX: objectives, policies, kernels, sandbox.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11",
    packages=find_packages(include=["rlcode", "rlcode.*", "kernels", "kernels.*", "experiments", "experiments.*"]),
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    classifiers=[
        "Programming Language :: Python :: 3.11",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
