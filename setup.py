from setuptools import setup

setup(
    name="chainer-static-graph",
    version="0.1.0",
    description="Record a Chainer training step once, replay it as a static schedule.",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=["static_graph", "schedules", "schedules.onnx_export"],
    python_requires=">=3.8",
    # Chainer 7.8.1 imports on Python 3.12+ and NumPy 2 through
    # static_graph/chainer_import.py; on older Pythons it stays on NumPy 1,
    # as released.
    install_requires=[
        "chainer>=4",
        "numpy<2; python_version<'3.12'",
        "numpy; python_version>='3.12'",
    ],
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
        # CuPy 14 needs NumPy 2; CuPy 13 NumPy 1.
        "cuda": ["cupy-cuda12x<14; python_version<'3.12'",
                 "cupy-cuda12x>=14; python_version>='3.12'"],
        "onnx": ["onnx", "onnxruntime"],
        "plot": ["matplotlib"],
    },
)
