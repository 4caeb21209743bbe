"""Ray Serve autoscaling on model work rather than open connections.

Serve's default policy scales on ongoing HTTP requests per replica. The web page keeps long-lived connections open
(a heartbeat stream per page, an event stream per waiting click) that cost no model time, so a few idle tabs would
look like load and start GPU replicas. Each replica instead reports `model_requests` — model runs admitted and not
finished plus page clicks waiting in Gradio's queue — and this policy wants one replica per
`target_ongoing_requests` of those (plus whatever waits in Serve's routers). Serve applies `min_replicas`,
`max_replicas`, the scaling factors and the up/down-scale delays around it.

Serve pickles the policy by value into its controller, so the module depends on the standard library only.
"""
from __future__ import annotations

from typing import Any

MODEL_REQUESTS = "model_requests"


def scale_on_model_requests(ctx: Any) -> tuple[float, dict[str, Any]]:
    """Custom Serve autoscaling policy (`AutoscalingContext` -> (desired replicas, policy state))."""
    reported = (ctx.aggregated_metrics or {}).get(MODEL_REQUESTS) or {}
    if not reported:  # no replica has reported yet (starting up): keep the current target
        return ctx.target_num_replicas, {}
    in_routers = ctx.total_queued_requests or 0.0
    return (sum(reported.values()) + in_routers) / ctx.config.get_target_ongoing_requests(), {}
