"""Log lines in JSON, per process, when `kvloom serve --log-format json` asked for them (KVLOOM_LOG_FORMAT).

Given `ray.LoggingConfig(encoding="JSON")`, Ray formats the root logger of the driver and of every worker
as JSON. Serve's own logger ("ray.serve") keeps a text stream handler of its own in every process; kvloom's
processes (the driver, the router and the replicas) give it Ray's JSON formatter too. The driver's console
side is cluster/logs.py.
"""

import logging
import os

LOG_FORMAT_ENV = "KVLOOM_LOG_FORMAT"


def json_logs() -> bool:
    return os.environ.get(LOG_FORMAT_ENV) == "json"


def serve_logger_as_json() -> None:
    """Serve's console handler in this process writes JSON, when JSON logs were asked for."""
    if not json_logs():
        return
    from ray._common.formatters import JSONFormatter

    for handler in logging.getLogger("ray.serve").handlers:
        if type(handler) is logging.StreamHandler:
            handler.setFormatter(JSONFormatter())
