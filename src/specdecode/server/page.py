"""The page at ``/`` of ``specdecode serve`` (its static files in ``ui/``: plain HTML, CSS and
JavaScript, no build step) and the two views it reads besides the OpenAI API:
``GET /v1/specdecode/info`` (the model, the drafters loaded) and ``GET /v1/specdecode/costs``
(the measured cost curve T(n) of the target, the step times observed while serving, and each
drafter's cost per drafted token). The page streams chat completions with the
``speculative.trace`` extension (:func:`specdecode.server.extensions.trace_of`).

Pure but for reading the package's files: no FastAPI here.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from ..control.planner import PlannedDrafter

# The files of the page, by URL path, with their media types. Served without the API key
# (they hold no generated text); the page asks for the key and keeps it in memory only.
UI_FILES = {"/": ("index.html", "text/html; charset=utf-8"),
            "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
            "/ui/style.css": ("style.css", "text/css; charset=utf-8")}


def ui_file(path: str) -> tuple[bytes, str]:
    """(content, media type) of the page's file at URL ``path`` (a key of UI_FILES)."""
    name, media = UI_FILES[path]
    return resources.files("specdecode.server").joinpath("ui", name).read_bytes(), media


def info_view(decoder: Any, model_name: str) -> dict:
    """What the page shows of the loaded pair: the model id, the draft option it was loaded
    with, the drafters a request may name (``speculative.draft``), K, whether the target
    verifies trees of drafts, and where the models run (:func:`placement_view`)."""
    drafter = decoder.drafter
    names = [m.name for m in drafter.members()] or ([drafter.name] if drafter.name != "none" else [])
    return {"model": model_name, "draft": decoder.draft_name, "drafters": names,
            "num_speculative_tokens": decoder.engine.num_speculative_tokens,
            "trees": decoder.target.supports_tree, "n_ctx": decoder.target.n_ctx, **placement_view(decoder)}


def placement_view(decoder: Any) -> dict:
    """Where the models run: the target's ``device`` (llama.cpp's device name, "CPU" where none),
    ``gpu_layers`` of ``n_layers``, ``device_description`` (the card), ``draft_models`` the same
    for each draft model with its ``name``, and ``runs_on``, all of it in words."""
    target = decoder.target.placement
    drafts = [{"name": b.name, **b.placement.to_dict(), "device_description": b.placement.description}
              for b in decoder.drafter.draft_backends()]
    words = [f"target {target.words()}"] + [f"draft model {b.name} {b.placement.words()}"
                                            for b in decoder.drafter.draft_backends()]
    return {**target.to_dict(), "device_description": target.description, "draft_models": drafts,
            "runs_on": "; ".join(words)}


def cost_view(decoder: Any, model_name: str) -> dict:
    """The cost curve the controller plans with: ``target`` = {"ns": [n], "seconds": [T(n)] as
    measured, "observed": [[n, seconds]] the medians of recent live steps}, ``copy_limit``
    L = 33 T(1) / T(33), and ``drafters`` = [{"name", "seconds_per_token"}]; ``target`` is
    None (with a ``note``) for a drafter at a fixed K, which plans with no curve."""
    curve = decoder.drafter.target_cost if isinstance(decoder.drafter, PlannedDrafter) else None
    if curve is None:
        return {"model": model_name, "target": None, "drafters": [],
                "note": f"the drafter {decoder.drafter.name!r} runs at a fixed K: no cost curve is planned with "
                        f"(serve with -k auto to see one)"}
    base = getattr(curve, "base", curve)
    observed = curve.observed_points() if hasattr(curve, "observed_points") else []
    return {"model": model_name,
            "target": {"ns": list(base.ns), "seconds": list(base.seconds), "observed": [list(p) for p in observed]},
            "copy_limit": round(33 * base(1) / base(33), 3),
            "drafters": [{"name": s.name, "seconds_per_token": s.draft_cost} for s in decoder.drafter.sources]}
