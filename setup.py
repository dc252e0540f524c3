from setuptools import setup

setup(
    name="chainer-static-graph",
    version="0.1.0",
    description="Record a Chainer training step once, replay it as a static schedule.",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=["static_graph", "schedules"],
    python_requires=">=3.8,<3.12",
    install_requires=["chainer>=4", "numpy<2"],
    extras_require={
        "test": [
            "pytest",
            "hypothesis",
            "scikit-learn",
            "onnx",
            "onnxruntime",
            "matplotlib",
            "mpi4py",
            "mpich",
        ],
        "mn": ["mpi4py", "mpich"],
        "cuda": ["cupy-cuda12x<14"],
        "onnx": ["onnx", "onnxruntime"],
        "plot": ["matplotlib"],
    },
)
