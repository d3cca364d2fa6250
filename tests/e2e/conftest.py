import pytest

from server import Server


@pytest.fixture(scope="session")
def demo():
    """The bundled demo model, shared by the tests that do not need special flags."""
    server = Server("--max-model-len", "1024")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def client(demo):
    return demo.client()
