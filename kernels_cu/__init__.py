"""CUDA C++ sources (data for sandbox.loader); a package only so that `pip install .` ships them."""
