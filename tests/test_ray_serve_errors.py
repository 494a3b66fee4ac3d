"""Ray Serve replicas that fail to start: the user reads the replica's own error (a corrupt
model file named, of its class), as from the single server, not Serve's "Deploying
application failed", and Serve and Ray are shut down behind it."""

from __future__ import annotations

import socket

import pytest
import ray

from specdecode.assembly import registry
from specdecode.errors import IncompatibleVocabularyError, ModelFileError, SpecDecodeError
from specdecode.server import ServerOptions
from specdecode.server.ray_serve import replica_error

# The shape of a failed deployment's status message in Ray Serve 2.x: the replica's
# traceback, as Serve's RuntimeError(traceback.format_exc()) wraps it.
STATUS = """Failed to update the deployments ['specdecode']. RuntimeError: Traceback (most recent call last):
  File "/site-packages/ray/serve/_private/replica.py", line 1867, in initialize
    await self._user_callable_wrapper.initialize_callable()
  File "/src/specdecode/backends/llama_cpp.py", line 111, in __init__
    raise ModelFileError(
specdecode.errors.{cls}: {message}
"""


def test_the_replicas_own_error_is_raised_with_its_class_and_message():
    e = replica_error(STATUS.format(cls="ModelFileError", message="llama.cpp could not load model file /m/x.gguf"),
                      "Deploying application specdecode failed")
    assert type(e) is ModelFileError and str(e) == "llama.cpp could not load model file /m/x.gguf"
    e = replica_error(STATUS.format(cls="IncompatibleVocabularyError", message="vocabularies differ: 49152 vs 151936"),
                      "x")
    assert type(e) is IncompatibleVocabularyError and "49152 vs 151936" in str(e)
    # A name that is not one of specdecode's error classes: the message, as SpecDecodeError.
    e = replica_error(STATUS.format(cls="Unheard", message="something"), "x")
    assert type(e) is SpecDecodeError and str(e) == "something"


def test_other_failures_quote_the_replicas_last_line_or_serves_own_error():
    e = replica_error("Traceback (most recent call last):\n  File ...\nMemoryError: out of memory\n",
                      "Deploying application specdecode failed")
    assert type(e) is SpecDecodeError and str(e) == "the Ray Serve replicas did not start: MemoryError: out of memory"
    e = replica_error("", "Deploying application specdecode failed: Failed to update the deployments")
    assert str(e) == ("the Ray Serve replicas did not start: Deploying application specdecode failed: "
                      "Failed to update the deployments")


def test_a_truncated_model_file_is_named_by_serve_replicas(tmp_path):
    """Real Ray Serve, one replica, a model file cut off in its tensors' data."""
    from specdecode.server.ray_serve import serve_replicas

    half = tmp_path / "half.gguf"
    with open(registry.resolve(registry.DEFAULT_DRAFT, progress=False), "rb") as f:
        half.write_bytes(f.read(50_000_000))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    try:
        options = ServerOptions(model_name="half", host="127.0.0.1", port=port, replicas=1, warmup=False)
        with pytest.raises(ModelFileError, match=r"half\.gguf: the file is corrupt, truncated"):
            serve_replicas(dict(target=str(half), draft="none", n_ctx=256, n_threads=1, progress=False), options,
                           block=False)
        assert not ray.is_initialized()  # shut down behind the error: nothing left running
    finally:
        if ray.is_initialized():
            ray.shutdown()
