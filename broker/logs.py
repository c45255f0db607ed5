"""Structured logs: one line per lifecycle event, ``key=value`` or JSON (``--log-json``).

Messages are written as ``event=NAME key=value ...``; the JSON formatter turns those pairs into
fields.  Under systemd (``$JOURNAL_STREAM`` set) the timestamp is left to the journal.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import re
import sys

_PAIR = re.compile(r"(\w+)=('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|\S+)")


def parse_pairs(message: str) -> dict[str, object]:
    fields: dict[str, object] = {}
    for key, raw in _PAIR.findall(message):
        if raw[:1] in ("'", '"'):
            try:
                fields[key] = ast.literal_eval(raw)
                continue
            except (ValueError, SyntaxError):
                pass
        fields[key] = int(raw) if raw.lstrip("-").isdigit() else raw
    return fields


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        doc = {"ts": round(record.created, 6), "level": record.levelname.lower(), "logger": record.name}
        pairs = parse_pairs(message)
        doc.update(pairs if "event" in pairs else {"message": message})
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def setup(level: str = "info", json_lines: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if json_lines:
        handler.setFormatter(JsonFormatter())
    elif os.environ.get("JOURNAL_STREAM"):
        handler.setFormatter(logging.Formatter("level=%(levelname)s logger=%(name)s %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
