"""Import-time stand-ins for the peers' own Python packages (vllm, sglang).

Test files import the peer's classes at module level; with these stubs the files load, and a
test that actually uses one of the peer's classes fails with PeerInternal, which the report
classifies as "needs the peer's own Python classes" (out of scope).
"""

import importlib.abc
import importlib.machinery
import sys
import types


class PeerInternal(Exception):
    pass


class _StubMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub_class(f"{cls.__qualname__}.{name}")

    def __getitem__(cls, item):
        return cls


def _stub_class(qualname):
    def _init(self, *a, **k):
        raise PeerInternal(f"{qualname} is the peer's own Python code")
    return _StubMeta(qualname.rsplit(".", 1)[-1], (), {"__init__": _init, "__qualname__": qualname})


class StubModule(types.ModuleType):
    overrides = {}

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        if full in StubModule.overrides:
            return StubModule.overrides[full]
        return _stub_class(full)


class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = roots

    def find_spec(self, fullname, path, target=None):
        if any(fullname == r or fullname.startswith(r + ".") for r in self.roots):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = StubModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


def install(roots, overrides):
    StubModule.overrides.update(overrides)
    sys.meta_path.insert(0, StubFinder(set(roots)))
