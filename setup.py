"""Build script for the one compiled part: the store server's C read path. It is optional: where
it cannot be compiled, ftrun installs without it and the server runs its Python path (the same
results, more CPU per request). Everything else is configured in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "rendezvous.store._quickstore",
            ["rendezvous/store/_quickstore.c"],
            optional=True,
            extra_compile_args=["-O2", "-Wall"],
        )
    ]
)
