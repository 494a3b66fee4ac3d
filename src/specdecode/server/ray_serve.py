"""Scale-out on Ray Serve: the same OpenAI app as a Ray Serve deployment of N replicas,
each a batched server (its own Decoder with ``parallel`` slots and its worker thread),
with Ray's HTTP proxy and router in front.

Two ways to run it (needs the optional extra: ``pip install -e '.[ray]'``):

    specdecode serve --replicas 2 --parallel 4 --target NAME ...
    serve run specdecode.server.ray_serve:app_builder target=NAME replicas=2 parallel=4

The first starts a local Ray instance (or joins $RAY_ADDRESS) and Serve's proxy on
--host/--port; the second is Ray's own CLI with an application builder (arguments as
key=value: the Decoder's option names plus the fields of
:class:`specdecode.server.config.ServerOptions`: replicas, max_queue, max_body_bytes,
api_key, autoscaling as JSON, num_cpus, metrics_port, model_name, warmup). Either way one
ServerOptions object carries the server's options to every replica.

Autoscaling: ``--autoscaling '{"min_replicas": 1, "max_replicas": 4,
"target_ongoing_requests": 4}'`` passes Ray Serve's autoscaling_config through (then
--replicas is ignored). Each replica reserves ``num_cpus`` CPUs (default: its llama.cpp
threads).

Metrics: /metrics through the proxy answers from whichever replica the router picks.
Each replica's own Prometheus endpoint stays reachable at ``metrics_port + rank``
(``--metrics-port``; replica ranks 0..N-1), and /health names the replica that answered.
"""

from __future__ import annotations

import os
import re
import time
import typing
from typing import Any

from .. import errors
from ..errors import SpecDecodeError
from .config import ServerOptions, convert_strings

DEPLOYMENT_NAME = "specdecode"


def _ray():
    try:
        import ray
        from ray import serve
    except ImportError:
        raise SpecDecodeError("--replicas needs Ray Serve: pip install -e '.[ray]' (or pip install 'ray[serve]')",
                              param="--replicas") from None
    return ray, serve


def build_deployment(decoder_kwargs: dict, options: ServerOptions):
    """The Ray Serve application: ``options.replicas`` (default 1) copies of the OpenAI app
    (or ``options.autoscaling``), each loading its own Decoder(**decoder_kwargs) on its
    replica and serving it with ``options`` (host and port are Serve's proxy's).

    Raises SpecDecodeError without Ray.
    """
    ray, serve = _ray()
    if options.strict:  # strict mode keeps its speculation in a batch with a cache per slot
        decoder_kwargs = {**decoder_kwargs, "kv_per_sequence": True}
    threads = decoder_kwargs.get("n_threads")
    cpus = options.num_cpus if options.num_cpus is not None else float(threads or 1)

    def build_asgi_app():
        # Runs on each replica: load the models there, then the same app as `specdecode serve`.
        from ..api import Decoder
        from .app import create_app

        rank = serve.get_replica_context().rank  # an int, or (Ray >= 2.50) a ReplicaRank with .rank
        rank = int(getattr(rank, "rank", rank))
        decoder = Decoder(**{**decoder_kwargs, "progress": False})
        app = create_app(decoder, options)
        app.state.replica = f"{DEPLOYMENT_NAME}#{rank} (pid {os.getpid()})"
        if options.metrics_port is not None:
            from prometheus_client import start_http_server

            start_http_server(options.metrics_port + rank, registry=app.state.metrics.registry)
        return app

    deployment: dict[str, Any] = {"name": DEPLOYMENT_NAME, "ray_actor_options": {"num_cpus": cpus},
                                  "max_ongoing_requests": options.max_queue + decoder_kwargs.get("parallel", 1)}
    if options.autoscaling is not None:
        deployment["autoscaling_config"] = options.autoscaling
    else:
        deployment["num_replicas"] = options.replicas or 1

    @serve.deployment(**deployment)
    @serve.ingress(build_asgi_app)
    class SpecDecodeReplica:
        pass

    return SpecDecodeReplica.bind()


def app_builder(args: dict):
    """``serve run specdecode.server.ray_serve:app_builder key=value ...``: the Decoder's
    options (target, draft, num_speculative_tokens, n_ctx, n_threads, parallel, backend,
    ...) and the fields of :class:`ServerOptions` (replicas, max_queue, max_body_bytes,
    api_key, autoscaling as JSON, num_cpus, metrics_port, model_name: default the target,
    warmup: default true), each string converted to its option's type. Raises
    SpecDecodeError naming a value that does not convert or is out of range."""
    from ..api import Decoder
    from ..assembly import registry

    server_keys = ServerOptions.field_names()
    decoder_kwargs = convert_strings({k: v for k, v in args.items() if k not in server_keys},
                                     typing.get_type_hints(Decoder.__init__))
    options = ServerOptions.from_strings({"model_name": decoder_kwargs.get("target", registry.DEFAULT_TARGET),
                                          "warmup": True, **{k: v for k, v in args.items() if k in server_keys}})
    return build_deployment(decoder_kwargs, options)


def serve_replicas(decoder_kwargs: dict, options: ServerOptions, block: bool = True):
    """Start (or join, with $RAY_ADDRESS) Ray, run the deployment (:func:`build_deployment`)
    behind Serve's HTTP proxy on options.host:options.port, and block until interrupted
    (then shut Serve down). With block=False, return once the replicas are up (the caller
    shuts down: :func:`shutdown`)."""
    ray, serve = _ray()
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False,
                 log_to_driver=False, configure_logging=False)
    serve.start(http_options={"host": options.host, "port": options.port})
    try:
        serve.run(build_deployment(decoder_kwargs, options), name=DEPLOYMENT_NAME, route_prefix="/")
    except RuntimeError as e:  # a replica failed to start: say why, as the single server would
        status = _deployment_message(serve)
        shutdown()
        raise replica_error(status, str(e)) from None
    if not block:
        return
    replicas = (options.replicas or 1) if options.autoscaling is None else "autoscaled"
    print(f"specdecode: {replicas} Ray Serve replica(s) of {options.model_name!r} on "
          f"http://{options.host}:{options.port}/v1", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        shutdown()


def _deployment_message(serve) -> str:
    """The deployment's status message from Serve (a failed replica's traceback), or ""."""
    try:
        app = serve.status().applications.get(DEPLOYMENT_NAME)
        deployment = app.deployments.get(DEPLOYMENT_NAME) if app is not None else None
        return (deployment.message if deployment is not None else app.message if app is not None else "") or ""
    except Exception:  # Serve itself is in trouble: the caller names Serve's own error
        return ""


_RAISED = re.compile(r"^specdecode\.errors\.(\w+): (.+)$", re.MULTILINE)


def replica_error(status_message: str, serve_error: str) -> SpecDecodeError:
    """The error to show for a deployment whose replicas failed to start.

    status_message: the deployment's status message from Serve, which ends with the failed
    replica's traceback; where that traceback ends with one of specdecode's errors (a missing
    or corrupt model file, incompatible vocabularies, an out-of-range option), that error,
    of the same class, with its own message. Otherwise a SpecDecodeError quoting the last
    line of the replica's traceback (or serve_error, Serve's own message, where there is none).
    """
    raised = _RAISED.findall(status_message)
    if raised:
        name, message = raised[-1]
        cls = getattr(errors, name, SpecDecodeError)
        return cls(message) if isinstance(cls, type) and issubclass(cls, SpecDecodeError) else SpecDecodeError(message)
    lines = [line.strip() for line in status_message.strip().splitlines() if line.strip()]
    why = lines[-1] if lines else serve_error
    return SpecDecodeError(f"the Ray Serve replicas did not start: {why}")


def shutdown() -> None:
    """Stop Serve and the Ray instance this process started."""
    ray, serve = _ray()
    serve.shutdown()
    ray.shutdown()
