"""Scale-out on Ray Serve: the same OpenAI app as a Ray Serve deployment of N replicas,
each a batched server (its own Decoder with ``parallel`` slots and its worker thread),
with Ray's HTTP proxy and router in front.

Two ways to run it (needs the optional extra: ``pip install -e '.[ray]'``):

    specdecode serve --replicas 2 --parallel 4 --target NAME ...
    serve run specdecode.server.ray_serve:app_builder target=NAME replicas=2 parallel=4

The first starts a local Ray instance (or joins $RAY_ADDRESS) and Serve's proxy on
--host/--port; the second is Ray's own CLI with an application builder (arguments as
key=value, the Decoder's option names plus replicas, max_queue, api_key, autoscaling as
JSON, num_cpus, metrics_port).

Autoscaling: ``--autoscaling '{"min_replicas": 1, "max_replicas": 4,
"target_ongoing_requests": 4}'`` passes Ray Serve's autoscaling_config through (then
--replicas is ignored). Each replica reserves ``num_cpus`` CPUs (default: its llama.cpp
threads).

Metrics: /metrics through the proxy answers from whichever replica the router picks.
Each replica's own Prometheus endpoint stays reachable at ``metrics_port + rank``
(``--metrics-port``; replica ranks 0..N-1), and /health names the replica that answered.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from ..errors import SpecDecodeError
from .protocol import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE

DEPLOYMENT_NAME = "specdecode"


def _ray():
    try:
        import ray
        from ray import serve
    except ImportError:
        raise SpecDecodeError("--replicas needs Ray Serve: pip install -e '.[ray]' (or pip install 'ray[serve]')",
                              param="--replicas") from None
    return ray, serve


def build_deployment(decoder_kwargs: dict, model_name: str, replicas: int = 1, max_queue: int = DEFAULT_MAX_QUEUE,
                     api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                     autoscaling: dict | None = None, num_cpus: float | None = None,
                     metrics_port: int | None = None):
    """The Ray Serve application: ``replicas`` copies of the OpenAI app (or an
    autoscaling_config), each loading its own Decoder(**decoder_kwargs) on its replica.

    Raises SpecDecodeError for replicas < 1 or without Ray.
    """
    ray, serve = _ray()
    if autoscaling is None and (not isinstance(replicas, int) or replicas < 1):
        raise SpecDecodeError(f"--replicas {replicas} is out of range: expected >= 1", param="--replicas")
    threads = decoder_kwargs.get("n_threads")
    cpus = num_cpus if num_cpus is not None else float(threads or 1)

    def build_asgi_app():
        # Runs on each replica: load the models there, then the same app as `specdecode serve`.
        from ..api import Decoder
        from .app import create_app

        rank = serve.get_replica_context().rank  # an int, or (Ray >= 2.50) a ReplicaRank with .rank
        rank = int(getattr(rank, "rank", rank))
        decoder = Decoder(**{**decoder_kwargs, "progress": False})
        app = create_app(decoder, model_name=model_name, max_queue=max_queue, warmup=True, api_key=api_key,
                         max_body_bytes=max_body_bytes)
        app.state.replica = f"{DEPLOYMENT_NAME}#{rank} (pid {os.getpid()})"
        if metrics_port is not None:
            from prometheus_client import start_http_server

            start_http_server(metrics_port + rank, registry=app.state.metrics.registry)
        return app

    options: dict[str, Any] = {"name": DEPLOYMENT_NAME, "ray_actor_options": {"num_cpus": cpus},
                               "max_ongoing_requests": max_queue + decoder_kwargs.get("parallel", 1)}
    if autoscaling is not None:
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = replicas

    @serve.deployment(**options)
    @serve.ingress(build_asgi_app)
    class SpecDecodeReplica:
        pass

    return SpecDecodeReplica.bind()


def app_builder(args: dict):
    """``serve run specdecode.server.ray_serve:app_builder key=value ...``: target, draft,
    num_speculative_tokens, n_ctx, n_threads, parallel, backend, ... (the Decoder's
    options), replicas, max_queue, api_key, autoscaling (JSON), num_cpus, metrics_port."""
    args = dict(args)
    ints = ("replicas", "max_queue", "n_ctx", "n_threads", "parallel", "metrics_port", "max_body_bytes")
    for key in ints:
        if key in args:
            args[key] = int(args[key])
    k = args.get("num_speculative_tokens", "auto")
    if k != "auto":
        args["num_speculative_tokens"] = int(k)
    serve_keys = ("replicas", "max_queue", "api_key", "autoscaling", "num_cpus", "metrics_port", "max_body_bytes")
    opts = {key: args.pop(key) for key in serve_keys if key in args}
    if isinstance(opts.get("autoscaling"), str):
        opts["autoscaling"] = json.loads(opts["autoscaling"])
    if "num_cpus" in opts:
        opts["num_cpus"] = float(opts["num_cpus"])
    from ..assembly import registry

    model = args.get("target", registry.DEFAULT_TARGET)
    return build_deployment(args, model_name=model, **opts)


def serve_replicas(decoder_kwargs: dict, model_name: str, host: str, port: int, replicas: int, max_queue: int,
                   api_key: str | None, max_body_bytes: int, autoscaling: dict | None = None,
                   metrics_port: int | None = None, block: bool = True):
    """Start (or join, with $RAY_ADDRESS) Ray, run the deployment behind Serve's HTTP proxy
    on host:port, and block until interrupted (then shut Serve down). With block=False,
    return once the replicas are up (the caller shuts down: :func:`shutdown`)."""
    ray, serve = _ray()
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False,
                 log_to_driver=False, configure_logging=False)
    serve.start(http_options={"host": host, "port": port})
    app = build_deployment(decoder_kwargs, model_name, replicas=replicas, max_queue=max_queue, api_key=api_key,
                           max_body_bytes=max_body_bytes, autoscaling=autoscaling, metrics_port=metrics_port)
    serve.run(app, name=DEPLOYMENT_NAME, route_prefix="/")
    if not block:
        return
    print(f"specdecode: {replicas if autoscaling is None else 'autoscaled'} Ray Serve replica(s) of {model_name!r} "
          f"on http://{host}:{port}/v1", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        shutdown()


def shutdown() -> None:
    """Stop Serve and the Ray instance this process started."""
    ray, serve = _ray()
    serve.shutdown()
    ray.shutdown()
